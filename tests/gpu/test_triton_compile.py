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
    (90, {"decode_kernel", "decode_tail_kernel", "prefill_kernel", "reduce_kernel",
          "write_kv_kernel", "_tail_residual_kernel", "_ring_write_kernel", "rotate_q_kernel",
          "lora_shrink_kernel", "lora_expand_kernel"}),
    (80, {"decode_kernel", "prefill_kernel", "reduce_kernel", "write_kv_kernel",
          "lora_shrink_kernel", "lora_expand_kernel"}),
])  # fmt: skip
def test_every_kernel_compiles_to_a_cubin(arch: int, kernels: set[str], tmp_path: Path) -> None:
    report = _compile(tmp_path, "--arch", str(arch), "--configs", "ci")
    assert set(report["kernels"]) == kernels
    assert len(report["configs"]) == (2 if arch == 90 else 1)


def _compile(cache_dir: Path, *args: str, script: Path = SCRIPT) -> dict:
    """Run a compile-only script in a fresh process (no interpreter, an empty kernel cache)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)  # compile for real, not from an earlier run's cache
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    # the script's own folder heads sys.path: name this checkout, not an installed infer8
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(script), *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# What the decode kernels may ask of an sm_90 GPU (tests/gpu/compile_kernels.py --report):
# - at most 128 registers and no stack (spills), so four programs of 4 warps share an SM and
#   keep their tiles in flight;
# - no synchronous global load (LDG) in decode_kernel's main loop: table entries, scales and
#   K/V tiles all arrive by asynchronous copies issued stages ahead;
# - instructions per context token over an FP8 cache against a bf16 cache's: static scales
#   <= 1.3x (measured 1.15x: the conversions, one instruction per two values of K and V and
#   the widened tiles' trip through shared memory, less the half of bf16's copies FP8 saves);
#   dynamic per-token scales <= 1.6x (measured 1.58x: K's on the scores, V's normalized per
#   tile on the softmax weights, ~0.43x more).
MAX_REGISTERS = 128
MAX_RATIO = {"static": 1.3, "dynamic": 1.6}


@pytest.mark.slow
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU the other tests compile and run the kernels"
)
def test_fp8_decode_kernels_fit_registers_and_stream_without_synchronous_loads(
    tmp_path: Path,
) -> None:
    report = _compile(tmp_path, "--arch", "90", "--configs", "all", "--kernels", "decode",
                      "--report")["report"]  # fmt: skip
    lines = ["config                                   kernel             direct regs stack"
             "  loop  /token  LDG  LDGSTS"]  # fmt: skip
    for row in report:
        lines.append(
            f"{row['config']:40} {row['kernel']:18} {row['direct']!s:6} {row['registers']:4} "
            f"{row['stack']:5} {row.get('loop_instructions', ''):>5} "
            f"{row.get('per_token', 0):7.2f} {row.get('sync_loads', ''):>4} "
            f"{row.get('async_copies', ''):>6}"
        )  # fmt: skip
    print("\n".join(lines))  # the table, in the test's output
    bf16 = [r for r in report if r["config"].startswith("bfloat16/bfloat16/")
            and r["kernel"] == "decode_kernel"]  # fmt: skip
    assert bf16, "no bf16-cache baseline"
    baseline = max(r["per_token"] for r in bf16)
    fp8 = [r for r in report if "float8" in r["config"]]
    assert {r["kernel"] for r in fp8} == {"decode_kernel", "decode_tail_kernel"}
    for row in fp8:
        where = f"{row['config']} {row['kernel']} (direct={row['direct']})"
        assert row["registers"] <= MAX_REGISTERS, f"{where}: {row['registers']} registers"
        assert row["stack"] == 0, f"{where}: {row['stack']} bytes of stack (spills)"
        if row["kernel"] != "decode_kernel":
            continue
        assert row["sync_loads"] == 0, f"{where}: {row['sync_loads']} LDG in the main loop"
        assert row["async_copies"] > 0, f"{where}: no asynchronous copy in the main loop"
        if row["config"].startswith("bfloat16/"):  # the same model dtype as the baseline
            scales = row["config"].split("/")[2]
            ratio = row["per_token"] / baseline
            assert ratio <= MAX_RATIO[scales], f"{where}: {ratio:.2f}x bf16's instructions"


@pytest.mark.slow
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU the other tests compile and run the kernels"
)
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
def test_no_kernel_compiles_after_start_up(cache: str, tmp_path: Path) -> None:
    """Decode batches of 1 to 512 and mixed steps at contexts of 1 to 32K tokens reuse the
    kernels start-up compiled (tests/gpu/count_compiles.py): a table width, a batch or a
    context never specializes a kernel again."""
    report = _compile(tmp_path, "--cache", cache, script=SCRIPT.with_name("count_compiles.py"))
    assert report["at_start"] > 0 and "decode_kernel" in report["kernels_at_start"]
    assert report["after_start"] == [], report["after_start"][:10]
