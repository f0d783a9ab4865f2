"""The FP8 cache's exact tail (and rotated keys) in the Triton kernels, against the reference.

tests/attention_schedule.py runs a few steps through both backends, each on its own copy of the
cache. Outputs must agree to the compute dtype's rounding after every step, the stores the
kernels write must hold what the reference writes, and the tail must matter: the same kernels
without it are far off.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (Linux x86_64 test extra)")

from tests.gpu import triton_modules  # noqa: E402

_MODULES = triton_modules.load()
triton_backend = _MODULES["backend"]
HAS_CUDA, DEVICE = triton_modules.HAS_CUDA, triton_modules.DEVICE

from infer8.attention.reference import ReferenceAttention  # noqa: E402
from tests.attention_schedule import run_schedule, tail_spec  # noqa: E402


def _run_schedule(dtype: torch.dtype, hadamard: bool, tail_on_triton: bool = True):  # type: ignore[no-untyped-def]  # noqa: E501
    ref, tri = ReferenceAttention(), triton_backend.TritonAttention(DEVICE)
    spec = tail_spec(hadamard=hadamard)
    return run_schedule(ref, tri, dtype, DEVICE, spec, other_tail=tail_on_triton)


@pytest.mark.parametrize(
    "dtype, hadamard",
    [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)],
    ids=["fp32", "fp32-hadamard", "bf16-hadamard"],
)
def test_tail_kernels_match_the_reference_step_after_step(
    dtype: torch.dtype, hadamard: bool
) -> None:
    torch.manual_seed(0)
    # float32: ~4e-7 measured, against 4e-2..8e-2 with the tail left out (the test below);
    # bf16: the reference rounds scores and outputs to bf16 (~7e-3 measured)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for step, got, want, tri_cache, ref_cache in _run_schedule(dtype, hadamard):
        assert torch.isfinite(got).all()
        rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert rel < tol, f"step {step}: relative error {rel}"
        if not hadamard:  # the same residual bytes in the store (sinks and rings)
            assert torch.equal(
                tri_cache.tail_store[0].view(torch.uint8),  # type: ignore[index]
                ref_cache.tail_store[0].view(torch.uint8),
            ), f"step {step}"  # type: ignore[index]  # noqa: E501
            assert torch.equal(tri_cache.tail_store[1], ref_cache.tail_store[1])  # type: ignore[index]


def test_leaving_the_tail_out_of_the_kernels_is_far_off() -> None:
    """What the test above would see if the kernels ignored the tail: errors ~FP8's, not fp32's."""
    torch.manual_seed(0)
    errors = [
        ((got - want).norm() / want.norm()).item()
        for _, got, want, _, _ in _run_schedule(torch.float32, False, tail_on_triton=False)
    ]
    assert min(errors) > 1e-3, errors
