"""The multi-LoRA Triton kernels against a torch reference: on CUDA natively, on CPU interpreted.

The reference loops over the slots in float64 on the same inputs, so the kernels are held to
their own arithmetic: float32 sums (a few 2**-24 of the sum of absolute products) and one
rounding of the output to y's dtype. Tokens without an adapter keep their row bit for bit.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (Linux x86_64 test extra)")

from tests.gpu.triton_modules import DEVICE, HAS_CUDA  # noqa: E402

if not HAS_CUDA:  # triton reads it when a kernel is defined
    os.environ["TRITON_INTERPRET"] = "1"
from infer8.lora import triton_ops  # noqa: E402

if not HAS_CUDA and isinstance(triton_ops.lora_shrink_kernel, triton.runtime.JITFunction):
    triton_ops = importlib.reload(triton_ops)  # imported earlier without the interpreter

IN_FEATURES, OUT_FEATURES, NUM_SLOTS = 72, 200, 3  # not multiples of the kernels' tiles
# Relative to |result|: bf16 keeps 8 significant bits, so one rounding (to nearest on a GPU,
# truncation under the interpreter) is under 2**-7; float32's is inside FP32_REL below.
OUT_REL = {torch.float32: 0.0, torch.bfloat16: 2.0**-6}
# float32 sums of ~in + rank + 1 terms: under (in + rank + 1) * 2**-24 = 7.2e-6 of the
# absolute sum (|y| + |x| @ |a|.T @ |b|), whatever the order.
FP32_REL = 1e-5


def _reference(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slot_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return y + the LoRA terms in float64 and the absolute sum that bounds their rounding."""
    want, bound = y.double().clone(), y.double().abs()
    for s in range(a.shape[0]):
        rows = slot_ids == s
        xs, a_s, b_s = x[rows].double(), a[s].double(), b[s].double()
        want[rows] += (xs @ a_s.T) @ b_s
        bound[rows] += (xs.abs() @ a_s.abs().T) @ b_s.abs()
    return want, bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 144: a fused qkv's three rank-48 adapters, over one rank tile
@pytest.mark.parametrize("rank", [8, 48, 144])
@pytest.mark.parametrize("slots", [[2], [-1], [0, -1, 2, 2, -1, 0, 1]])
def test_lora_add_matches_reference(dtype: torch.dtype, rank: int, slots: list[int]) -> None:
    gen = torch.Generator().manual_seed(rank * 100 + len(slots))
    num_tokens = len(slots)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)

    x = rand(num_tokens, IN_FEATURES)
    a = rand(NUM_SLOTS, rank, IN_FEATURES, scale=0.2)
    b = rand(NUM_SLOTS, rank, OUT_FEATURES, scale=0.2)
    # y: a view into a wider buffer (strided rows, as in a fused projection's output)
    y_buf = rand(num_tokens, OUT_FEATURES + 24)
    y = y_buf[:, :OUT_FEATURES]
    before = y_buf.clone()
    slot_ids = torch.tensor(slots, dtype=torch.int32, device=DEVICE)

    triton_ops.triton_lora_add(x, y, a, b, slot_ids)

    x, a, b, slot_ids, y_buf, before = (t.cpu() for t in (x, a, b, slot_ids, y_buf, before))
    want, bound = _reference(x, before[:, :OUT_FEATURES], a, b, slot_ids)
    tol = OUT_REL[dtype] * want.abs() + FP32_REL * bound
    err = (y_buf[:, :OUT_FEATURES].double() - want).abs()
    assert (err <= tol).all(), f"max error {err.max():.3g}, over tolerance {(err - tol).max():.3g}"
    no_adapter = slot_ids < 0
    assert torch.equal(y_buf[no_adapter], before[no_adapter]), "an unadapted row moved"
    assert torch.equal(y_buf[:, OUT_FEATURES:], before[:, OUT_FEATURES:]), "wrote past the view"
    # the test can tell: every adapted row moves by over 100 times its tolerance somewhere
    moved = (want - before[:, :OUT_FEATURES].double()).abs()
    assert ((moved / tol).amax(dim=1)[~no_adapter] > 100).all()
