"""oneDNN-packed CPU linear layers: same results as F.linear (float32 rounding), every layer
packed, and oneDNN's per-shape kernel caches bounded."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from infer8.host_memory import HostMemory
from infer8.layers.parallel import ParallelLMHead, RowParallelLinear
from infer8.worker.cpu_linear import (
    _KERNEL_CACHE_ENV,
    KERNEL_CACHE_CAPACITY,
    PackedLinear,
    bound_kernel_caches,
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


# A fresh interpreter (the kernel caches read their capacity once, at the first oneDNN op):
# how many more MB glibc's heap holds in use after a packed layer has run at 400 row counts.
_GROWTH_OVER_ROW_COUNTS = """
import ctypes
import torch
from torch import nn
from infer8.worker.cpu_linear import PackedLinear, bound_kernel_caches
bound_kernel_caches()
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "a b c d e f g uordblks h i".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
layer = PackedLinear(nn.Linear(64, 64), batch_hint=16)
layer(torch.ones(1, 64))
before = libc.mallinfo2().uordblks
for rows in range(2, 402):
    layer(torch.ones(rows, 64))
print((libc.mallinfo2().uordblks - before) / 1e6)
"""


def _heap_growth_mb() -> float:
    env = {k: v for k, v in os.environ.items() if k not in _KERNEL_CACHE_ENV}
    out = subprocess.run(
        [sys.executable, "-c", _GROWTH_OVER_ROW_COUNTS],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not HostMemory().is_available, reason="glibc's allocator only")
def test_kernel_caches_stay_bounded_as_step_sizes_vary() -> None:
    """Each new row count compiles and caches a kernel (~0.6 MB: 400 row counts held ~230 MB
    with oneDNN's default caches); a server meets a new one with almost every mixed step, and
    its RSS grew ~20 MB a minute. 128 entries hold ~55-75 MB."""
    assert _heap_growth_mb() < 100


def test_kernel_cache_bound_leaves_a_setting_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in _KERNEL_CACHE_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "4096")
    bound_kernel_caches()
    assert os.environ["LRU_CACHE_CAPACITY"] == "4096"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(KERNEL_CACHE_CAPACITY)
