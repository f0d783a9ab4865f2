"""The Triton kernels compile for real GPUs (sm_90 Hopper, sm_80 Ampere), on a machine without one.

The interpreter (the other tests here) runs the kernels' Python, not Triton's compiler, so a
kernel it accepts can still fail to compile: unsupported constructs, types that do not unify
across branches, FP8 types a target lacks. compile_kernels.py compiles every kernel down to a
cubin with Triton's bundled toolchain, one configuration per kernel branch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (Linux x86_64 test extra)")

SCRIPT = Path(__file__).with_name("compile_kernels.py")
ROOT = SCRIPT.parents[2]


@pytest.mark.slow
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU the other tests compile and run the kernels"
)
@pytest.mark.parametrize("arch, kernels", [
    (90, {"decode_kernel", "prefill_kernel", "reduce_kernel", "write_kv_kernel",
          "_tail_residual_kernel", "_ring_write_kernel", "rotate_q_kernel",
          "lora_shrink_kernel", "lora_expand_kernel"}),
    (80, {"decode_kernel", "prefill_kernel", "reduce_kernel", "write_kv_kernel",
          "lora_shrink_kernel", "lora_expand_kernel"}),
])  # fmt: skip
def test_every_kernel_compiles_to_a_cubin(arch: int, kernels: set[str], tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from an earlier run's cache
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    # the script's own folder heads sys.path: name this checkout, not an installed infer8
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--arch", str(arch), "--configs", "ci"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(report["kernels"]) == kernels
    assert len(report["configs"]) == (2 if arch == 90 else 1)
