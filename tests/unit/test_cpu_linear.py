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


@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_packed_linear_matches_f_linear_at_every_batch_size(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    linear = nn.Linear(64, 96, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(96, 64, generator=gen))
        linear.bias.copy_(torch.randn(96, generator=gen))
    x = torch.randn(rows, 64, generator=gen)
    ref = F.linear(x, linear.weight, linear.bias)
    packed = PackedLinear(linear, batch_hint=32)
    torch.testing.assert_close(packed(x), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear_matmul(packed, x), ref, rtol=1e-5, atol=1e-5)
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


def test_only_float32_on_cpu_is_packed() -> None:
    assert packing_applies(torch.device("cpu"), torch.float32)
    assert not packing_applies(torch.device("cpu"), torch.bfloat16)
    assert not packing_applies(torch.device("cuda"), torch.float32)
    assert probe_packing(32) is None
    model = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8))
    assert pack_linear_layers(model, batch_hint=4) == 1
    assert isinstance(model[0], nn.Linear) and isinstance(model[1], PackedLinear)
