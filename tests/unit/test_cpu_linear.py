"""oneDNN-packed CPU linear layers: same results as F.linear (float32 rounding), every layer packed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from infer8.distributed.layers import ParallelLMHead, RowParallelLinear
from infer8.worker.cpu_linear import (
    PackedLinear,
    linear_matmul,
    pack_linear_layers,
    packed_dtypes,
    packing_applies,
    probe_packing,
)

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)


class _DoublingGroup:
    """A stand-in tensor-parallel group whose collectives are visible in the result."""

    world_size, rank = 2, 0

    def all_reduce(self, y: torch.Tensor) -> torch.Tensor:
        return 2 * y

    def all_gather(self, y: torch.Tensor) -> torch.Tensor:
        return torch.cat([y, -y], dim=-1)


_BF16 = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(
        torch.bfloat16 not in packed_dtypes(), reason="oneDNN has no bf16 on this CPU"
    ),
)


@pytest.mark.parametrize("dtype", [torch.float32, _BF16])
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_packed_linear_matches_f_linear_at_every_batch_size(rows: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows)
    linear = nn.Linear(64, 96, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(96, 64, generator=gen))
        linear.bias.copy_(torch.randn(96, generator=gen))
    linear = linear.to(dtype)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    ref = F.linear(x, linear.weight, linear.bias)
    packed = PackedLinear(linear, batch_hint=32)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the outputs' rounding
    assert packed(x).dtype == dtype
    torch.testing.assert_close(packed(x), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(linear_matmul(packed, x), ref, rtol=tol, atol=tol)
    assert packed.packed_weight.layout == torch._mkldnn


def test_packing_keeps_the_tensor_parallel_collectives() -> None:
    group = _DoublingGroup()
    model = nn.Module()
    model.o_proj = RowParallelLinear(16, 8, group)  # type: ignore[arg-type]
    model.lm_head = ParallelLMHead(8, 10, group)  # type: ignore[arg-type]  # 5 rows per rank
    x = torch.randn(3, 16)
    h = torch.randn(3, 8)
    ref_o, ref_head = model.o_proj(x), model.lm_head(h)
    assert pack_linear_layers(model, batch_hint=8) == 2
    assert isinstance(model.o_proj, PackedLinear) and isinstance(model.lm_head, PackedLinear)
    torch.testing.assert_close(model.o_proj(x), ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.lm_head(h), ref_head, rtol=1e-5, atol=1e-5)
    # the matmul alone (for the roofline) has no collective
    torch.testing.assert_close(linear_matmul(model.o_proj, x), ref_o / 2, rtol=1e-5, atol=1e-5)


def test_float32_and_native_bf16_on_cpu_are_packed() -> None:
    assert packing_applies(torch.device("cpu"), torch.float32)
    bf16_native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert packing_applies(torch.device("cpu"), torch.bfloat16) == bf16_native
    assert not packing_applies(torch.device("cpu"), torch.float16)
    assert not packing_applies(torch.device("cuda"), torch.float32)
    assert probe_packing(32) is None
    if bf16_native:
        assert probe_packing(32, torch.bfloat16) is None
    model = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8))
    assert pack_linear_layers(model, batch_hint=4) == 1  # only the compute dtype's layers
    assert isinstance(model[0], nn.Linear) and isinstance(model[1], PackedLinear)
    if bf16_native:
        assert pack_linear_layers(model, batch_hint=4, dtype=torch.bfloat16) == 1
        assert isinstance(model[0], PackedLinear)
