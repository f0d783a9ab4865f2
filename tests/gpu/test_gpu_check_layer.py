"""benchmarks/gpu_check.py's timed layer forward, run here under the Triton interpreter."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (Linux x86_64 test extra)")

from tests.gpu import triton_modules  # noqa: E402

triton_modules.load()  # TRITON_INTERPRET is set on CPU before the kernels are defined
DEVICE = triton_modules.DEVICE
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("exact_tail", [False, True], ids=["plain", "tail-and-rotation"])
def test_the_timed_layer_forward_attends_with_the_fp8_default(exact_tail: bool) -> None:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks/gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    dtype = torch.float8_e4m3fn if exact_tail else torch.bfloat16
    call = gpu_check.build_layer_decode(DEVICE, 2, 40, dtype, exact_tail, num_kv_heads=2, group=2)
    out = call().clone()
    assert out.shape == (2, 4, 128) and torch.isfinite(out).all() and out.abs().sum() > 0
    again = call()  # a timed call repeats the work; with a tail its ring write lands in a slot
    # the next call's window reads (a step repeated at one position), hence only close
    torch.testing.assert_close(again, out, atol=0 if not exact_tail else 0.05, rtol=0)
