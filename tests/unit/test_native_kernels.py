"""The native C kernels against the torch reference: gather + dequantize, the tail residual and
the FP8 write bit for bit; the fused decode attention to float32 rounding (another summation
order), exact tail included."""

from __future__ import annotations

import pytest
import torch

from infer8.attention.kv_cache import KVCacheSpec, allocate_kv_cache
from infer8.attention.metadata import build_attention_metadata
from infer8.attention.reference import attend_cache, read_blocks, write_blocks
from infer8.kernels.cpu import NativeKernels
from infer8.kernels.cpu.build import build_library
from infer8.kernels.cpu.library import NativeLibrary
from infer8.quant import fp8
from tests.utils import float_ordinals


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> NativeKernels:
    lib = NativeLibrary(build_library(tmp_path_factory.mktemp("native")))
    return NativeKernels.from_library(lib)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("mode", ["dynamic", "static_head", "static_channel"])
def test_gather_dequant_matches_reference(
    native: NativeKernels, dtype: torch.dtype, mode: str, out_dtype: torch.dtype
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
    native.kv.dequantize_blocks(q, scale if static is None else None, static, ids, out)
    if static is None:
        ref = fp8.dequantize(q[:, ids], scale[:, ids][..., None], out_dtype)
    else:
        ref = fp8.dequantize(q[:, ids], static[:, None, None, :], out_dtype)
    assert torch.equal(out, ref)


def test_all_fp8_codes_round_trip_exactly(native: NativeKernels) -> None:
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        codes = torch.arange(256, dtype=torch.uint8).view(dtype)
        finite = codes[torch.isfinite(codes.float())]
        n = finite.numel()
        cache = torch.zeros(1, 1, n, 1, dtype=dtype)
        cache.view(-1)[:] = finite
        ones = torch.ones(1, 1, n, dtype=torch.bfloat16)
        out = torch.empty(1, 1, n, 1, dtype=torch.bfloat16)
        native.kv.dequantize_blocks(cache, ones, None, torch.tensor([0]), out)
        assert torch.equal(out.view(-1).float(), finite.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_block_gather_matches_index_select(native: NativeKernels, dtype: torch.dtype) -> None:
    cache = torch.randn(3, 9, 4, 16).to(dtype)
    ids = torch.tensor([8, 0, 3, 3, 5], dtype=torch.int64)
    out = torch.empty(3, 5, 4, 16, dtype=dtype)
    native.kv.gather(cache, ids, out)
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
    native: NativeKernels, block_dtype: torch.dtype, x_dtype: torch.dtype
) -> None:
    from infer8.attention import exact_tail

    x = _spread_rows(4000, x_dtype)
    got = native.kv.tail_residual(x, block_dtype)
    ref = exact_tail.tail_values(x[:, None], block_dtype, [None])
    assert torch.equal(got[0].view(torch.uint8), ref[0][:, 0].view(torch.uint8))
    assert torch.equal(got[1], ref[1][:, 0])
    assert torch.equal(got[2], ref[2][:, 0])


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_write_fp8_stores_what_the_torch_write_stores(
    native: NativeKernels, cache_dtype: torch.dtype, x_dtype: torch.dtype
) -> None:
    x = _spread_rows(500, x_dtype)
    slots = torch.randperm(64 * 16)[:500]  # scattered over 64 blocks of 16
    cache = torch.zeros(3, 64, 16, 64, dtype=cache_dtype)
    scales = torch.zeros(3, 64, 16, dtype=fp8.SCALE_DTYPE)
    native.kv.write_fp8(x, slots, cache, scales)
    scale = fp8.dynamic_scale(x, cache_dtype)
    ref, ref_scales = torch.zeros_like(cache), torch.zeros_like(scales)
    ref.view(3, -1, 64)[:, slots] = fp8.quantize(x, scale[..., None], cache_dtype).transpose(0, 1)
    ref_scales.view(3, -1)[:, slots] = scale.transpose(0, 1)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(scales, ref_scales)


@pytest.mark.parametrize("hadamard", [True, False])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("d", [128, 64, 32])  # in registers (AVX-512: 128, 64), and the loop
def test_prefill_tail_is_the_write_and_the_tail_values_bit_for_bit(
    native: NativeKernels, cache_dtype: torch.dtype, x_dtype: torch.dtype, hadamard: bool, d: int
) -> None:
    """One native pass over a prefill step's K and V (strided views of a fused projection):
    the rotated rows quantized into the blocks, their residuals and tail values as the torch
    functions return them, and their block values as a read of the blocks returns them."""
    from infer8.attention import exact_tail

    torch.manual_seed(0)
    kvh, tokens = 3, 300
    spec = KVCacheSpec(1, kvh, d, 16, cache_dtype, 6, 2, hadamard)
    cache = allocate_kv_cache(spec, 40, torch.device("cpu"), num_tail_rows=2)[0]
    want = allocate_kv_cache(spec, 40, torch.device("cpu"), num_tail_rows=2)[0]
    x = torch.randn(tokens, 15, d) * torch.logspace(-6, 3, tokens)[:, None, None]
    x[0] = 0  # a zero row, subnormal FP8 values, saturation
    qkv = x.view(tokens, 15 * d).to(x_dtype)
    k = qkv[:, 9 * d : 12 * d].view(tokens, kvh, d)
    v = qkv[:, 12 * d :].view(tokens, kvh, d)
    slots = torch.randperm(40 * 16)[:tokens]
    residual, tail, block = native.kv.prefill_tail(k, v, slots, cache)
    if hadamard:  # the rows rotated as the kernel rotates them (a fast Walsh-Hadamard pass)
        k, v = native.elementwise.rotate(k), native.elementwise.rotate(v)
    write_blocks(want, k, v, slots)
    ref_q, ref_scale, ref_tail = exact_tail.tail_values(
        torch.stack([k, v], dim=1), cache_dtype, (None, None)
    )
    for got_t, want_t in ((cache.k, want.k), (cache.v, want.v)):
        assert torch.equal(got_t.view(torch.uint8), want_t.view(torch.uint8))
    assert torch.equal(cache.k_scale, want.k_scale) and torch.equal(cache.v_scale, want.v_scale)
    assert torch.equal(
        residual[0].view(torch.uint8), ref_q.view(tokens, 2 * kvh, d).view(torch.uint8)
    )
    assert torch.equal(residual[1], ref_scale.view(tokens, 2 * kvh))
    assert torch.equal(tail[0].transpose(0, 1), ref_tail[:, 0])
    assert torch.equal(tail[1].transpose(0, 1), ref_tail[:, 1])
    table = torch.arange(40)
    for side, values in enumerate(read_blocks(want, table, 40 * 16, x_dtype)):
        assert torch.equal(block[side], values[:, slots])


@pytest.mark.parametrize(
    "cache_dtype, dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float8_e4m3fn, torch.float32),
        (torch.float8_e5m2, torch.float32),
        (torch.float8_e4m3fn, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("kvh, group, d", [(3, 3, 64), (2, 4, 128), (1, 8, 72), (4, 1, 64)])
def test_decode_attention_matches_the_torch_decode(
    native: NativeKernels,
    cache_dtype: torch.dtype,
    dtype: torch.dtype,
    kvh: int,
    group: int,
    d: int,
) -> None:
    """Blocks read in place (ragged lengths, permuted blocks), no gathered copy. The kernel
    tiles query heads by 3 and head dims by 16: GQA 3 (the default model), 4, 8 and none,
    head dims 64, 128 and 72 (a partial tile) cover each remainder."""
    torch.manual_seed(0)
    bs = 16
    cache = allocate_kv_cache(KVCacheSpec(1, kvh, d, bs, cache_dtype), 40, torch.device("cpu"))[0]
    lens = [1, 15, 16, 17, 70, 130]
    perm = torch.randperm(39).add(1).tolist()
    blocks = []
    for n in lens:
        blocks.append(perm[: -(-n // bs)])
        perm = perm[-(-n // bs) :]
    full = build_attention_metadata(lens, [0] * len(lens), blocks, bs, torch.device("cpu"))
    k = torch.randn(full.num_real_tokens, kvh, d, dtype=dtype) * 3
    k[::7] *= 1e-3  # FP8 subnormals
    v = torch.randn(full.num_real_tokens, kvh, d, dtype=dtype)
    write_blocks(cache, k, v, full.slot_mapping)
    meta = build_attention_metadata(
        [1] * len(lens), [n - 1 for n in lens], blocks, bs, torch.device("cpu")
    )
    q = torch.randn(len(lens), kvh * group, d, dtype=dtype)
    want = attend_cache(q, cache, meta, d**-0.5)
    table, seq_lens = meta.decode_block_tables, torch.tensor(lens)
    got = native.decode.decode_attention(q, cache, table, seq_lens, d**-0.5)
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    # float32: summation order only (~2e-7 measured); bf16: the torch path rounds the
    # dequantized blocks to bf16, the kernel folds the scales in float32 (~5e-3)
    assert rel < (1e-6 if dtype == torch.float32 else 1e-2), rel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_scores_every_e4m3_code_as_the_torch_path_does(
    native: NativeKernels, dtype: torch.dtype
) -> None:
    """Each finite E4M3 code, subnormals and signs included, as a whole key row (unit scale)
    against a zero key: the second key's probability is sigmoid(its score), its query scaled so
    that the score is 0.5-2 in magnitude, so a code read as another value moves it by > 0.05.
    bf16 queries take the AVX512-BF16 path where the CPU has it (codes turned into bf16)."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    codes = codes[torch.isfinite(codes.float()) & (codes.float() != 0)]
    n, d, bs = codes.numel(), 64, 16
    spec = KVCacheSpec(1, 1, d, bs, torch.float8_e4m3fn)
    cache = allocate_kv_cache(spec, n + 1, torch.device("cpu"))[0]
    cache.k[0, 1:, 1] = codes[:, None]  # block b + 1: a zero key, then code b's row
    cache.v[0, 1:, 1] = torch.ones((), dtype=torch.float8_e4m3fn)  # the second value: ones
    cache.k_scale.fill_(1.0)
    cache.v_scale.fill_(1.0)
    log_score = torch.log2(codes.float().abs() * d * d**-0.5)  # of a unit query
    q = (2.0 ** -torch.round(log_score))[:, None, None].expand(n, 1, d).to(dtype)
    table = torch.arange(1, n + 1)[:, None]
    seq_lens = torch.full((n,), 2)
    meta = build_attention_metadata([1] * n, [1] * n, table.tolist(), bs, torch.device("cpu"))
    want = attend_cache(q, cache, meta, d**-0.5)
    got = native.decode.decode_attention(q, cache, table, seq_lens, d**-0.5)
    p = torch.sigmoid(codes.float().sign() * 2.0 ** (log_score - torch.round(log_score)))
    assert (got.float()[:, 0] - p[:, None]).abs().max() < 0.01
    assert (got.float() - want.float()).abs().max() < 0.01


@pytest.mark.parametrize("daz", [False, True])
@pytest.mark.parametrize("scale", [2.0, 512.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_sums_every_e4m3_code_as_its_value(
    native: NativeKernels, dtype: torch.dtype, scale: float, daz: bool
) -> None:
    """Each E4M3 code, subnormals, signs and zeros included, as a value: a one-token sequence
    (probability 1) whose value row holds 64 codes returns their values times the row's scale,
    exactly (every E4M3 value times a power of two is a bf16 value). With AVX-512 the kernel
    widens codes as value * 2^-120 (subnormal codes as float32 denormals) with 2^120 in the
    scale, unless a scale is >= 2^8 (512: 2^120 would overflow) or the thread reads denormals
    as zero (`daz`: torch.set_flush_denormal, the calling thread's tasks), then as value / 256."""
    if daz and not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        _sum_every_e4m3_code(native, dtype, scale)
    finally:
        torch.set_flush_denormal(False)


def _sum_every_e4m3_code(native: NativeKernels, dtype: torch.dtype, scale: float) -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    codes = codes[torch.isfinite(codes.float())]  # 254: NaNs are never stored
    rows = torch.cat([codes, codes[: -codes.numel() % 64]]).view(-1, 64).repeat(8, 1)  # 32 x 64
    n, d, bs = rows.shape[0], 64, 16
    spec = KVCacheSpec(1, 1, d, bs, torch.float8_e4m3fn)
    cache = allocate_kv_cache(spec, n, torch.device("cpu"))[0]
    cache.v[0, :, 0] = rows
    cache.v_scale.fill_(scale)
    cache.k_scale.fill_(1.0)
    q = torch.randn(n, 1, d, dtype=dtype)
    table, seq_lens = torch.arange(n)[:, None], torch.ones(n, dtype=torch.int64)
    got = native.decode.decode_attention(q, cache, table, seq_lens, d**-0.5)
    assert torch.equal(got.float()[:, 0], rows.float() * scale)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_write_rows_stores_what_index_copy_stores(
    native: NativeKernels, x_dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    """16/32-bit cache writes from a fused projection's strided rows, bit for bit."""
    torch.manual_seed(0)
    kvh, d, tokens = 3, 64, 300
    cache = torch.randn(kvh, 40, 16, d).to(cache_dtype)
    want = cache.clone()
    qkv = torch.randn(tokens, 15 * d, dtype=x_dtype) * 3
    k = qkv[:, 9 * d : 12 * d].view(tokens, kvh, d)  # a strided view, as a model layer passes
    slots = torch.randperm(40 * 16)[:tokens]
    want.view(kvh, -1, d).index_copy_(1, slots, k.transpose(0, 1).to(cache_dtype))
    native.kv.write_rows(k, slots, cache)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [128, 64, 4])  # in registers (AVX-512), or the scalar butterflies
def test_rotate_is_the_hadamard_matmul(native: NativeKernels, dtype: torch.dtype, d: int) -> None:
    """The fast Walsh-Hadamard transform of strided rows equals x @ H to float32 rounding."""
    from infer8.attention.exact_tail import hadamard, rotate

    torch.manual_seed(0)
    qkv = torch.randn(33, 12, d, dtype=dtype) * 5
    k = qkv[:, 9:]  # a view of a fused projection: strided rows
    got, want = native.elementwise.rotate(k), rotate(k, hadamard(d))
    assert got.is_contiguous() and got.dtype == dtype
    if dtype == torch.bfloat16:  # float32 sums in another order, then one rounding to bf16:
        # at most one unit in the last place (2^-7 of the value)
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2**-7)
    else:
        err = (got - want).abs().max().item()
        assert err <= 1e-6 * want.abs().max().item(), err
    back = native.elementwise.rotate(native.elementwise.rotate(k.float()))  # H is its own inverse
    torch.testing.assert_close(back, k.float(), atol=1e-5, rtol=0)


# float32: to float32 rounding; bf16: the torch ops' own roundings, so at most one bf16 step
# apart (a float32 sum in another order can land on the other side of a rounding boundary)
_TOL = {torch.float32: {"rtol": 2e-6, "atol": 2e-6}, torch.bfloat16: {"rtol": 8e-3, "atol": 1e-5}}


def _bf16_steps_apart(got: torch.Tensor, want: torch.Tensor) -> int:
    """The largest distance between two bf16 tensors in representable values (-0 == +0)."""
    return int((float_ordinals(got) - float_ordinals(want)).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, h", [(1, 576), (37, 576), (300, 77)])
def test_rms_norm_with_the_residual_add_matches_torch(
    native: NativeKernels, rows: int, h: int, dtype: torch.dtype
) -> None:
    """One pass: x += add in place, then the norm of the sum; x's rows may be strided."""
    from infer8.layers.elementwise import TorchElementwise

    torch.manual_seed(0)
    weight = torch.randn(h).to(dtype)
    base = (torch.randn(rows, h + 5) * 4).to(dtype)
    x, add = base[:, :h], torch.randn(rows, h).to(dtype)
    want_x = x + add
    want = TorchElementwise().rms_norm(want_x.clone(), weight, 1e-5)
    got = native.elementwise.rms_norm(x, weight, 1e-5, add)
    assert torch.equal(x, want_x)  # the residual stream, updated in place (bf16: rounded)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **_TOL[dtype])
    torch.testing.assert_close(native.elementwise.rms_norm(x, weight, 1e-5), want, **_TOL[dtype])
    if dtype == torch.bfloat16:
        assert _bf16_steps_apart(got, want) <= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [1536, 77])
def test_silu_and_mul_matches_torch(native: NativeKernels, inter: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    gate_up = torch.randn(33, 2 * inter) * 8
    gate_up[0, :8] = torch.tensor([-200.0, -88.0, -30.0, -1e-30, 0.0, 1e-30, 30.0, 200.0])
    gate_up = gate_up.to(dtype)
    want = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    got = native.elementwise.silu_and_mul(gate_up)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=_TOL[dtype]["rtol"], atol=1e-30)
    if dtype == torch.bfloat16:  # (silu(-200): e^-200 underflows to 0 in torch, ~1e-35 here)
        normal = want.abs() > 1e-30
        assert _bf16_steps_apart(got[normal], want[normal]) <= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_matches_apply_rope(native: NativeKernels, dtype: torch.dtype) -> None:
    """q and k heads of a fused projection's output (a strided view), rotated in place."""
    from infer8.layers.elementwise import apply_rope

    torch.manual_seed(0)
    qkv = torch.randn(19, (9 + 3 + 3) * 64).to(dtype)
    qk = qkv[:, : 12 * 64].view(19, 12, 64)
    cos, sin = torch.randn(19, 32).to(dtype), torch.randn(19, 32).to(dtype)
    want = apply_rope(qk.clone(), cos[:, None], sin[:, None])
    v_before = qkv[:, 12 * 64 :].clone()
    got = native.elementwise.rope_(qk, cos, sin)
    assert got.data_ptr() == qkv.data_ptr()
    if dtype == torch.bfloat16:  # every product and sum rounded as torch rounds them
        assert torch.equal(qk, want)
    torch.testing.assert_close(qk, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, 12 * 64 :], v_before)  # V untouched


def test_write_store_matches_the_torch_write(native: NativeKernels) -> None:
    """The exact tail's store write: the same bytes in the same slots, nothing else touched."""
    from infer8.attention.exact_tail import write_store

    torch.manual_seed(0)
    heads, seats, stride, d, tokens = 6, 5, 27, 64, 9
    res = (
        (torch.randn(tokens, heads, d) * 50).to(torch.float8_e4m3fn),
        torch.rand(tokens, heads).to(torch.bfloat16),
    )
    store = (
        (torch.randn(heads, seats, stride, d) * 50).to(torch.float8_e4m3fn),
        torch.rand(heads, seats, stride).to(torch.bfloat16),
    )
    want = tuple(t.clone() for t in store)
    before = store[0].clone()
    token_ids = torch.tensor([8, 0, 3, 5])
    slots = torch.tensor([0, 1 * stride + 7, 4 * stride + 26, 2 * stride])
    write_store(want, res, token_ids, slots)
    native.kv.write_store(store, res, token_ids, slots)
    assert not torch.equal(want[0].view(torch.uint8), before.view(torch.uint8))
    for got, ref in zip(store, want):
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    native.kv.write_store(store, res, token_ids[:0], slots[:0])  # nothing to write
    for got, ref in zip(store, want):
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))


def test_greedy_is_the_argmax_of_the_sanitized_logits(native: NativeKernels) -> None:
    """NaN, infinities, values beyond the clamp limit, ties (the first wins), rows of every
    length modulo the 8 lanes: the sampler's finite_ then argmax, index for index."""
    from infer8.worker.penalties import LOGIT_LIMIT, finite_

    torch.manual_seed(0)
    for n in (1, 7, 8, 13, 49152):
        x = torch.randn(9, n) * 10
        x[1, n // 2] = float("nan")
        x[2, :] = float("nan")  # every value NaN: the first index, as argmax of -limit
        x[3, n // 3] = float("inf")
        x[3, -1] = float("inf")  # two +inf clamp to equal maxima: the first
        x[4, :] = float("-inf")
        x[5, -1] = 3e20  # beyond the limit, tied with another after the clamp
        x[5, 0] = 2e20
        x[6, n - 1] = 1e3  # the maximum last (in the scalar tail when n % 8)
        x[7, :] = 1.0  # all equal
        want = finite_(x.clone()).argmax(dim=-1).tolist()
        assert native.sampling.greedy(x, LOGIT_LIMIT) == want, n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len, n", [(1, 1), (13, 13), (128, 128), (5, 40), (77, 300)])
def test_causal_attention_matches_sdpa(
    native: NativeKernels, dtype: torch.dtype, q_len: int, n: int
) -> None:
    """A fresh prompt's attention (and a chunk's after n - q_len earlier keys), GQA 9 over 3:
    float64 SDPA's values to float32 rounding; bf16 no further from them than bf16 SDPA."""
    torch.manual_seed(0)
    q = (torch.randn(q_len, 9, 64) * 2).to(dtype).transpose(0, 1)  # a view, as _attend passes
    k, v = (torch.randn(3, n, 64) * 2).to(dtype), torch.randn(3, n, 64).to(dtype)
    mask = torch.ones(q_len, n, dtype=torch.bool).tril(n - q_len)
    want = torch.nn.functional.scaled_dot_product_attention(
        q[None].double(), k[None].double(), v[None].double(), mask, scale=0.125, enable_gqa=True
    )[0]
    got = native.prefill.causal_attention(q, k, v, 0.125)
    assert got.shape == want.shape and got.dtype == dtype

    def rel(x: torch.Tensor) -> float:
        return ((x.double() - want).norm() / want.norm()).item()

    if dtype == torch.float32:
        assert rel(got) < 1e-6
        return
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q[None], k[None], v[None], mask, scale=0.125, enable_gqa=True
    )[0]
    assert rel(got) < max(1.5 * rel(sdpa), 1e-3), (rel(got), rel(sdpa))


def test_nucleus_candidates_hold_each_rows_top_p_and_top_k_set(native: NativeKernels) -> None:
    """The sampler's native candidates: every token above the row's smallest candidate (a
    threshold set, ties included), the row's top-p set and top-k inside it, the softmax's
    denominator as the torch path computes it; a row with more than `cap` candidates is left
    to the caller (-1)."""
    gen = torch.Generator().manual_seed(0)
    vocab = 3001  # not a multiple of 8: the scalar tail of each pass
    x = torch.randn(6, vocab, generator=gen)
    x[0] *= 8.0  # peaked
    x[1] *= 0.5  # flat: thousands of tokens within a unit of the maximum
    x[2, 100:110] = x[2].max() + 3.0  # ten tied maxima
    x[3, -1] = x[3].max() + 40.0  # one token: the rest more than 32 units down
    top_p = torch.tensor([0.9, 0.95, 0.5, 0.9, 1.0, 0.3])
    top_k = torch.tensor([vocab, vocab, vocab, vocab, 50, 7])
    ids, count, row_max, row_sum = native.sampling.nucleus_candidates(x, top_p, top_k, 1024)
    assert count[1] == -1  # too many for the cap
    assert torch.equal(row_max, x.amax(1))
    want_sum = (x - x.amax(1, keepdim=True)).clamp(min=-87.0).exp().sum(1)
    torch.testing.assert_close(row_sum, want_sum, rtol=1e-5, atol=0)
    for r in (0, 2, 3, 4, 5):
        n = int(count[r])
        assert n > 0
        chosen = ids[r, :n]
        assert bool((chosen[1:] > chosen[:-1]).all())  # index order, no repeats
        smallest = x[r, chosen].min()
        assert int((x[r] >= smallest).sum()) == n  # a threshold set: ties included
        probs = torch.softmax(x[r].double(), 0)
        sorted_probs = probs.sort(descending=True).values
        nucleus = int(((sorted_probs.cumsum(0) - sorted_probs) < top_p[r]).sum())
        assert n >= (nucleus if top_p[r] < 1 else 0)
        assert n >= (int(top_k[r]) if top_k[r] < vocab else 0)
    assert count[3] == 1 and ids[3, 0] == vocab - 1
    assert count[2] >= 10 and set(range(100, 110)) <= set(ids[2, : int(count[2])].tolist())


def test_struct_arguments_match_the_c_layout(native: NativeKernels) -> None:
    """Every struct-argument function's ctypes Structure has the C struct's field offsets and
    size (csrc/args.h), so each value lands in the parameter its name says."""
    import ctypes

    for name, struct in native.lib.structs.items():
        offsets, size = native.lib.layout(name)
        assert [getattr(struct, field).offset for field, _ in struct._fields_] == offsets, name
        assert ctypes.sizeof(struct) == size, name
    assert len(native.lib.structs) == 5


def test_a_wrong_field_is_refused_before_the_call(native: NativeKernels) -> None:
    with pytest.raises(TypeError, match=r"missing fields \[.*'out'.*\], unknown fields \[\]"):
        native.lib.call("decode_layer", q=0)
    fields = {name: 0 for name, _ in native.lib.structs["prefill_tail"]._fields_}
    with pytest.raises(TypeError, match=r"unknown fields \['typo'\]"):
        native.lib.call("prefill_tail", **fields, typo=1)
    with pytest.raises(AttributeError, match="no function 'decode_layer_v2'"):
        native.lib.decode_layer_v2  # noqa: B018
