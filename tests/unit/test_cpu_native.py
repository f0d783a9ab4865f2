"""The native C kernels (gather + dequantize, the tail residual, the FP8 write) are bit-exact
against the torch reference."""

from __future__ import annotations

import pytest
import torch

from infer8.attention.cpu_native import NativeFP8Gather, build_library
from infer8.quant import fp8


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> NativeFP8Gather:
    return NativeFP8Gather(build_library(tmp_path_factory.mktemp("native")))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("mode", ["dynamic", "static_head", "static_channel"])
def test_gather_dequant_matches_reference(
    native: NativeFP8Gather, dtype: torch.dtype, mode: str, out_dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    kvh, nblk, bs, d = 3, 11, 4, 64
    x = torch.randn(kvh, nblk, bs, d) * torch.logspace(-6, 2, nblk)[None, :, None, None]
    scale = fp8.dynamic_scale(x, dtype)  # [kvh, nblk, bs]
    static = None
    if mode == "static_head":
        static = torch.tensor([[0.01], [0.5], [3.0]])
    elif mode == "static_channel":
        static = torch.rand(kvh, d) + 0.01
    q = fp8.quantize(x, scale[..., None] if static is None else static[:, None, None, :], dtype)
    ids = torch.tensor([3, 0, 10, 3, 7], dtype=torch.int64)
    out = torch.full((kvh, len(ids), bs, d), float("nan"), dtype=out_dtype)  # poisoned
    native(q, scale if static is None else None, static, ids, out)
    if static is None:
        ref = fp8.dequantize(q[:, ids], scale[:, ids][..., None], out_dtype)
    else:
        ref = fp8.dequantize(q[:, ids], static[:, None, None, :], out_dtype)
    assert torch.equal(out, ref)


def test_all_fp8_codes_round_trip_exactly(native: NativeFP8Gather) -> None:
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        codes = torch.arange(256, dtype=torch.uint8).view(dtype)
        finite = codes[torch.isfinite(codes.float())]
        n = finite.numel()
        cache = torch.zeros(1, 1, n, 1, dtype=dtype)
        cache.view(-1)[:] = finite
        ones = torch.ones(1, 1, n, dtype=torch.bfloat16)
        out = torch.empty(1, 1, n, 1, dtype=torch.bfloat16)
        native(cache, ones, None, torch.tensor([0]), out)
        assert torch.equal(out.view(-1).float(), finite.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_block_gather_matches_index_select(native: NativeFP8Gather, dtype: torch.dtype) -> None:
    cache = torch.randn(3, 9, 4, 16).to(dtype)
    ids = torch.tensor([8, 0, 3, 3, 5], dtype=torch.int64)
    out = torch.empty(3, 5, 4, 16, dtype=dtype)
    native.gather(cache, ids, out)
    assert torch.equal(out.view(torch.uint8), cache.index_select(1, ids).view(torch.uint8))


def _spread_rows(num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """Return [num_tokens, 3, 64] rows of magnitudes 1e-6 .. 1e3 (subnormal FP8 values, ties,
    saturation), a zero row and a few edge values."""
    torch.manual_seed(0)
    x = torch.randn(num_tokens, 3, 64) * torch.logspace(-6, 3, num_tokens)[:, None, None]
    x[0] = 0
    x[1, 0, :5] = torch.tensor([1e-30, -3.0, 448.0, 500.0, -1e4])
    return x.to(dtype)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_tail_residual_matches_the_torch_functions_bit_for_bit(
    native: NativeFP8Gather, block_dtype: torch.dtype, x_dtype: torch.dtype
) -> None:
    from infer8.attention import exact_tail

    x = _spread_rows(4000, x_dtype)
    got = native.tail_residual(x, block_dtype)
    ref = exact_tail.tail_values(x[:, None], block_dtype, [None])
    assert torch.equal(got[0].view(torch.uint8), ref[0][:, 0].view(torch.uint8))
    assert torch.equal(got[1], ref[1][:, 0])
    assert torch.equal(got[2], ref[2][:, 0])


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_write_fp8_stores_what_the_torch_write_stores(
    native: NativeFP8Gather, cache_dtype: torch.dtype, x_dtype: torch.dtype
) -> None:
    x = _spread_rows(500, x_dtype)
    slots = torch.randperm(64 * 16)[:500]  # scattered over 64 blocks of 16
    cache = torch.zeros(3, 64, 16, 64, dtype=cache_dtype)
    scales = torch.zeros(3, 64, 16, dtype=fp8.SCALE_DTYPE)
    native.write_fp8(x, slots, cache, scales)
    scale = fp8.dynamic_scale(x, cache_dtype)
    ref, ref_scales = torch.zeros_like(cache), torch.zeros_like(scales)
    ref.view(3, -1, 64)[:, slots] = fp8.quantize(x, scale[..., None], cache_dtype).transpose(0, 1)
    ref_scales.view(3, -1)[:, slots] = scale.transpose(0, 1)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(scales, ref_scales)
