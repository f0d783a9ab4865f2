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

from infer8.attention import exact_tail  # noqa: E402
from infer8.attention.kv_cache import LayerKVCache  # noqa: E402
from infer8.attention.reference import ReferenceAttention  # noqa: E402
from tests.attention_schedule import HEAD_DIM, run_schedule, tail_spec  # noqa: E402


def _run_schedule(dtype: torch.dtype, hadamard: bool, tail_on_triton: bool = True):  # type: ignore[no-untyped-def]  # noqa: E501
    ref, tri = ReferenceAttention(), triton_backend.TritonAttention(DEVICE)
    spec = tail_spec(hadamard=hadamard)
    return run_schedule(ref, tri, dtype, DEVICE, spec, other_tail=tail_on_triton)


# float32 attention over the same cache contents: ~4e-7 measured, against 4e-2..8e-2 with the
# tail left out (the test below); eps32 x sqrt(context) x a few is ~1e-5.
FP32_TOL = 1e-5


def _rounding_flips(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]
) -> int:
    """Return how many FP8 codes differ between two (codes, scales) pairs.

    With rotated keys both sides quantize H @ x, a float32 sum whose order is the ISA's (BLAS for
    torch, numpy under the interpreter): the sums differ in the last bit, and a value that lands
    within that of an FP8 rounding midpoint rounds to the neighbouring code on one side only.
    Anything else (another scale, a code more than one step away, a sign) is a wrong value.
    """
    (codes_a, scales_a), (codes_b, scales_b) = got, want
    assert torch.equal(scales_a, scales_b), "scales differ"
    a, b = codes_a.view(torch.uint8).int(), codes_b.view(torch.uint8).int()
    differ = a != b
    # one sign (bit 7) and neighbouring codes: the magnitudes' byte order is their value order
    assert torch.equal((a ^ b)[differ] & 0x80, torch.zeros_like(a[differ])), "a sign flipped"
    assert ((a - b)[differ].abs() == 1).all(), "an FP8 code more than one step away"
    return int(differ.sum())


def _flip_tolerance(num_flips: int, out: torch.Tensor) -> float:
    """Return the relative output error that num_flips flipped FP8 codes can explain.

    A flipped residual moves a tail value by one E4M3 step of its residual (<= 2^-3 of it), and
    the residual is at most half an E4M3 step of the value (<= 2^-4 of it): <= 2^-7 of the
    element, an element being ~1/sqrt(d) of its row. One element among the output's rows.
    """
    num_rows = out.shape[0] * out.shape[1]
    return num_flips * 2.0**-7 / (HEAD_DIM * num_rows) ** 0.5


def _sync(dst: LayerKVCache, src: LayerKVCache) -> None:
    """Copy src's codes, scales and residuals into dst: the next step starts from one state."""
    for a, b in (
        (dst.k, src.k),
        (dst.v, src.v),
        (dst.k_scale, src.k_scale),
        (dst.v_scale, src.v_scale),
        *zip(dst.tail_store, src.tail_store),
    ):  # type: ignore[arg-type]
        a.copy_(b)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "dtype, hadamard, order",
    [
        (torch.float32, False, "isa"),
        (torch.float32, True, "isa"),
        (torch.float32, True, "reversed"),
        (torch.bfloat16, True, "isa"),
    ],
    ids=["fp32", "fp32-hadamard", "fp32-hadamard-reversed", "bf16-hadamard"],
)
def test_tail_kernels_match_the_reference_step_after_step(
    dtype: torch.dtype, hadamard: bool, order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outputs agree to float32's rounding plus what FP8 rounding flips explain, for either
    summation order of the rotation (the reference's sums in the ISA's order, or reversed)."""
    if order == "reversed":
        monkeypatch.setattr(exact_tail, "rotate", _rotate_reversed)
    torch.manual_seed(0)
    # bf16: the reference rounds scores and outputs to bf16 (~7e-3 measured)
    tol = FP32_TOL if dtype == torch.float32 else 2e-2
    num_codes = 0
    for step, got, want, tri_cache, ref_cache in _run_schedule(dtype, hadamard):
        assert torch.isfinite(got).all()
        err = (got.float() - want.float()).norm().item()
        rel = err / want.float().norm().item()
        tri_store, ref_store = tri_cache.tail_store, ref_cache.tail_store  # type: ignore[attr-defined]
        if not hadamard:  # the same residual bytes in the store (sinks and rings)
            assert torch.equal(tri_store[0].view(torch.uint8), ref_store[0].view(torch.uint8))
            assert torch.equal(tri_store[1], ref_store[1]), f"step {step}"
            assert rel < tol, f"step {step}: relative error {rel}"
            continue
        flips = sum([
            _rounding_flips(tri_store, ref_store),
            _rounding_flips((tri_cache.k, tri_cache.k_scale), (ref_cache.k, ref_cache.k_scale)),
            _rounding_flips((tri_cache.v, tri_cache.v_scale), (ref_cache.v, ref_cache.v_scale)),
        ])  # fmt: skip
        num_codes = tri_store[0].numel() + tri_cache.k.numel() + tri_cache.v.numel()
        # A flip needs the float32 sum within ~ d * eps32 * |x| of a midpoint; a residual's
        # midpoints are >= 2^-4 of it apart and it is >= 2^-5 of |x| for most codes:
        # P(flip) <= 2 * 32 * 2^-24 * 2^9 ~ 2e-3 per code.
        assert flips <= max(4, 2e-3 * num_codes), f"step {step}: {flips} flips"
        allowed = tol + _flip_tolerance(flips, got)
        assert rel <= allowed, f"step {step}: relative error {rel}, {flips} flips: {allowed}"
        _sync(tri_cache, ref_cache)  # flips do not carry into the next step's reads
    assert num_codes or not hadamard


def _rotate_reversed(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Return x @ rotation with the channels summed in the opposite order (another ISA's)."""
    return (x.float().flip(-1) @ rotation.flip(-2)).to(x.dtype)


def test_leaving_the_tail_out_of_the_kernels_is_far_off() -> None:
    """What the test above would see if the kernels ignored the tail: errors ~FP8's, not fp32's."""
    torch.manual_seed(0)
    errors = [
        ((got - want).norm() / want.norm()).item()
        for _, got, want, _, _ in _run_schedule(torch.float32, False, tail_on_triton=False)
    ]
    assert min(errors) > 1e-3, errors
