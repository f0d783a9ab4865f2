"""Triton attention over the paged cache (the CUDA backend): fused quantize-on-write, split-K
decode and varlen prefill that read 1-byte FP8 blocks and dequantize them in registers.

The cache layout is the reference's: K/V [num_kv_heads, num_blocks, block_size, head_dim],
dynamic FP8 scales [num_kv_heads, num_blocks, block_size] in bf16, or static scales
[kvh or 1, head_dim or 1] in fp32. Dequantization never materializes a 16-bit copy: FP8 tiles
are widened in registers (exactly: every e4m3/e5m2 value is a bf16/fp16 value) and the scales
are folded into the math instead of the tiles (a per-token K scale multiplies that token's
score column, a per-token V scale its softmax weight, a static per-channel K scale the query).

The kernels also run on CPU tensors under TRITON_INTERPRET=1 (how CI checks them against
TorchRefAttention); the engine itself uses this backend only on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from infer8.attention.metadata import AttentionMetadata
from infer8.quant import fp8
from infer8.worker.kv_cache import LayerKVCache

_LOG2E = 1.4426950408889634
# Scale modes of a cache, as the kernels see them.
_NO_SCALE, _DYNAMIC, _STATIC = 0, 1, 2
# (mantissa bits, smallest normal, magic constant) per storage format, for _round_to_grid. The
# magic is 1.5 * 2**(23 + e) where 2**e is the format's subnormal spacing, so (x + magic) -
# magic rounds x to that spacing in fp32 (round to nearest even).
_GRID = {
    torch.float8_e4m3fn: (3, 2.0**-6, 1.5 * 2.0 ** (23 - 9)),
    torch.float8_e5m2: (2, 2.0**-14, 1.5 * 2.0 ** (23 - 16)),
    torch.bfloat16: (7, 0.0, 0.0),  # shares fp32's exponent: no separate subnormal case
}


def is_interpreted() -> bool:
    """Return whether these kernels were defined under TRITON_INTERPRET=1 (CPU tensors)."""
    return not isinstance(_write_kv_kernel, triton.runtime.JITFunction)


# -- kernels --------------------------------------------------------------------------------


@triton.jit
def _round_to_grid(x, MANT_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, MAGIC: tl.constexpr):
    """Round fp32 x to the nearest (ties to even) value with MANT_BITS mantissa bits.

    The cast that follows is then exact. Hardware casts round the same way; the interpreter's
    fp32 -> fp8/bf16 casts do not (bf16 truncates; fp8 loses the carry when rounding crosses a
    power of two, e.g. -31.6 -> -16 in e4m3), so rounding here makes both bit-identical to torch.
    """
    SHIFT: tl.constexpr = 23 - MANT_BITS
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> SHIFT) & 1
    bits = (bits + ((1 << (SHIFT - 1)) - 1) + lsb) & (-(1 << SHIFT))
    y = bits.to(tl.float32, bitcast=True)
    if MIN_NORMAL > 0:
        tiny = (tl.abs(x) + MAGIC) - MAGIC
        tiny = tl.where(x < 0, -tiny, tiny)  # keeps -0.0 for tiny negatives, as torch does
        y = tl.where(tl.abs(x) < MIN_NORMAL, tiny, y)
    return y


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    slot_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    k_static_ptr,
    v_static_ptr,
    saturated_ptr,
    stride_xt,
    stride_xh,
    stride_vt,
    stride_vh,
    stride_ch,
    stride_cb,
    stride_cs,
    stride_sh,
    stride_sb,
    stride_static_h,
    stride_static_d,
    num_kv_heads,
    head_dim,
    fp8_max,
    scale_factor,
    min_scale,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    MANT_BITS: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    MAGIC: tl.constexpr,
):
    """Store one token's K and V (all KV heads) in its slot, quantizing for FP8 caches."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # negative slots are padding (CUDA-graph buckets): nothing to store
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
        # [BLOCK_H, BLOCK_D] fp32
        k = tl.load(
            k_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :],
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        v = tl.load(
            v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        cache_off = (
            offs_h[:, None].to(tl.int64) * stride_ch
            + block * stride_cb
            + offset * stride_cs
            + offs_d[None, :]
        )
        if SCALE_MODE == 1:  # dynamic: one bf16 scale per token and KV head
            scale_off = offs_h.to(tl.int64) * stride_sh + block * stride_sb + offset
            k_s = _round_to_grid(
                tl.maximum(tl.max(tl.abs(k), axis=1) * scale_factor, min_scale), 7, 0.0, 0.0
            )
            v_s = _round_to_grid(
                tl.maximum(tl.max(tl.abs(v), axis=1) * scale_factor, min_scale), 7, 0.0, 0.0
            )
            tl.store(k_scale_ptr + scale_off, k_s.to(tl.bfloat16), mask=offs_h < num_kv_heads)
            tl.store(v_scale_ptr + scale_off, v_s.to(tl.bfloat16), mask=offs_h < num_kv_heads)
            k = tl.math.div_rn(k, k_s[:, None])
            v = tl.math.div_rn(v, v_s[:, None])
        elif SCALE_MODE == 2:  # static: [kvh or 1, head_dim or 1], zero strides broadcast
            static_off = offs_h[:, None] * stride_static_h + offs_d[None, :] * stride_static_d
            k = tl.math.div_rn(k, tl.load(k_static_ptr + static_off, mask=mask, other=1.0))
            v = tl.math.div_rn(v, tl.load(v_static_ptr + static_off, mask=mask, other=1.0))
            clipped = tl.where(mask & (tl.abs(k) > fp8_max), 1, 0) + tl.where(
                mask & (tl.abs(v) > fp8_max), 1, 0
            )
            num_clipped = tl.sum(tl.sum(clipped, axis=1), axis=0).to(tl.int64)
            if num_clipped > 0:
                tl.atomic_add(saturated_ptr, num_clipped)
        if SCALE_MODE != 0:
            k = tl.clamp(k, -fp8_max, fp8_max)
            v = tl.clamp(v, -fp8_max, fp8_max)
        if MANT_BITS > 0:
            k = _round_to_grid(k, MANT_BITS, MIN_NORMAL, MAGIC)
            v = _round_to_grid(v, MANT_BITS, MIN_NORMAL, MAGIC)
        tl.store(k_cache_ptr + cache_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + cache_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_kv_tile(
    cache_ptr,
    scale_ptr,
    table_row_ptr,
    kv_head,
    offs_n,
    offs_d,
    mask_n,
    mask_d,
    stride_ch,
    stride_cb,
    stride_cs,
    stride_sh,
    stride_sb,
    BLOCK_SIZE: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Gather tokens offs_n of one sequence: a [BLOCK_N, BLOCK_D] tile and [BLOCK_N] scales.

    The tile is widened to DOT_DTYPE in registers (exact for FP8); the per-token scales are
    returned separately (ones unless the cache is dynamic FP8) so callers fold them in.
    """
    block = tl.load(table_row_ptr + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
    offset = offs_n % BLOCK_SIZE
    row = kv_head.to(tl.int64) * stride_ch + block * stride_cb + offset * stride_cs
    tile = tl.load(
        cache_ptr + row[:, None] + offs_d[None, :],
        mask=mask_n[:, None] & mask_d[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    if SCALE_MODE == 1:
        scale = tl.load(
            scale_ptr + kv_head.to(tl.int64) * stride_sh + block * stride_sb + offset,
            mask=mask_n,
            other=0.0,
        ).to(tl.float32)
    else:
        scale = tl.full(offs_n.shape, 1.0, tl.float32)
    return tile, scale


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    k_static_ptr,
    v_static_ptr,
    out_ptr,
    mid_out_ptr,
    mid_lse_ptr,
    token_idx_ptr,
    seq_lens_ptr,
    block_table_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ch,
    stride_cb,
    stride_cs,
    stride_sh,
    stride_sb,
    stride_static_h,
    stride_static_d,
    stride_bt,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    head_dim,
    min_split_tokens,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    DIRECT: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """One split of one sequence's context for the GROUP query heads of one KV head.

    Flash-decoding: each program keeps a running max / sum / accumulator over its split; with
    DIRECT (one split) it writes the normalized output, else a partial output and its
    log-sum-exp (base 2) for _reduce_kernel. How a context is split depends only on its own
    length and the grid's split count, never on the batch: eager steps and CUDA-graph replays
    of any bucket compute the same numbers.
    """
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    token = tl.load(token_idx_ptr + b).to(tl.int64)
    split_size = _split_size(seq_len, tl.num_programs(2), min_split_tokens, BLOCK_N)
    start = split * split_size
    end = tl.minimum(start + split_size, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < head_dim
    heads = kv_head * GROUP + offs_g
    q = tl.load(
        q_ptr + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    ).to(tl.float32)  # [BLOCK_G, BLOCK_D]
    if SCALE_MODE == 2:
        static_off = kv_head * stride_static_h + offs_d * stride_static_d
        q = q * tl.load(k_static_ptr + static_off, mask=mask_d, other=0.0)[None, :]
    q = q.to(q_ptr.dtype.element_ty).to(DOT_DTYPE)
    table_row = block_table_ptr + b.to(tl.int64) * stride_bt

    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        k, k_s = _load_kv_tile(
            k_cache_ptr, k_scale_ptr, table_row, kv_head, offs_n, offs_d, mask_n, mask_d,
            stride_ch, stride_cb, stride_cs, stride_sh, stride_sb,
            BLOCK_SIZE, SCALE_MODE, DOT_DTYPE,
        )  # fmt: skip
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_G, BLOCK_N]
        scores = scores * (k_s * qk_scale)[None, :]
        scores = tl.where(mask_n[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v, v_s = _load_kv_tile(
            v_cache_ptr, v_scale_ptr, table_row, kv_head, offs_n, offs_d, mask_n, mask_d,
            stride_ch, stride_cb, stride_cs, stride_sh, stride_sb,
            BLOCK_SIZE, SCALE_MODE, DOT_DTYPE,
        )  # fmt: skip
        p = (p * v_s[None, :]).to(q_ptr.dtype.element_ty).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    if SCALE_MODE == 2:
        static_off = kv_head * stride_static_h + offs_d * stride_static_d
        acc = acc * tl.load(v_static_ptr + static_off, mask=mask_d, other=0.0)[None, :]
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty sequence (padding) gives zeros
    mask_out = mask_g[:, None] & mask_d[None, :]
    if DIRECT:
        tl.store(
            out_ptr + token * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask_out,
        )
    else:
        is_used = tl.full((BLOCK_G,), 0, tl.int32) + start < seq_len  # [BLOCK_G]
        mid = b.to(tl.int64) * stride_mb + heads * stride_mh + split * stride_ms
        tl.store(
            mid_out_ptr + mid[:, None] + offs_d[None, :], out, mask=mask_out & is_used[:, None]
        )
        lse_off = b.to(tl.int64) * stride_lb + heads * stride_lh + split
        tl.store(
            mid_lse_ptr + lse_off, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), mask=mask_g & is_used
        )


@triton.jit
def _split_size(seq_len, num_splits, min_split_tokens, BLOCK_N: tl.constexpr):
    """Return the tokens per split of a context: an even share, at least min_split_tokens."""
    share = tl.maximum(tl.cdiv(seq_len, num_splits), min_split_tokens)
    return tl.cdiv(share, BLOCK_N) * BLOCK_N


@triton.jit
def _reduce_kernel(
    mid_out_ptr,
    mid_lse_ptr,
    out_ptr,
    token_idx_ptr,
    seq_lens_ptr,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    stride_ot,
    stride_oh,
    head_dim,
    num_splits,
    min_split_tokens,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Combine one (sequence, query head)'s split partials by their log-sum-exp weights."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    token = tl.load(token_idx_ptr + b).to(tl.int64)
    num_used = tl.cdiv(seq_len, _split_size(seq_len, num_splits, min_split_tokens, BLOCK_N))
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_used
    mask_d = offs_d < head_dim
    base = b.to(tl.int64) * stride_mb + h * stride_mh + offs_s * stride_ms
    lse_off = b.to(tl.int64) * stride_lb + h * stride_lh + offs_s
    lse = tl.load(mid_lse_ptr + lse_off, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(mask_s, tl.exp2(lse - m), 0.0)  # [BLOCK_S]
    partial = tl.load(
        mid_out_ptr + base[:, None] + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    total = tl.sum(w, axis=0)
    out = tl.sum(partial * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + token * stride_ot + h * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_d,
    )


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    k_static_ptr,
    v_static_ptr,
    out_ptr,
    q_start_ptr,
    q_lens_ptr,
    seq_lens_ptr,
    block_table_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ch,
    stride_cb,
    stride_cs,
    stride_sh,
    stride_sb,
    stride_static_h,
    stride_static_d,
    stride_bt,
    head_dim,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """BLOCK_M new tokens of one sequence, one query head, over its cached context.

    Query j of a chunk of q_len sits at position seq_len - q_len + j and sees keys up to it:
    full attention over the cached prefix, causal within the chunk.
    """
    i = tl.program_id(0)
    m_tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(q_start_ptr + i).to(tl.int64)
    q_len = tl.load(q_lens_ptr + i)
    seq_len = tl.load(seq_lens_ptr + i)
    context_len = seq_len - q_len

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < head_dim
    positions = context_len + offs_m
    rows = (q_start + offs_m)[:, None]
    q = tl.load(
        q_ptr + rows * stride_qt + head * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    ).to(tl.float32)  # [BLOCK_M, BLOCK_D]
    if SCALE_MODE == 2:
        static_off = kv_head * stride_static_h + offs_d * stride_static_d
        q = q * tl.load(k_static_ptr + static_off, mask=mask_d, other=0.0)[None, :]
    q = q.to(q_ptr.dtype.element_ty).to(DOT_DTYPE)
    table_row = block_table_ptr + i.to(tl.int64) * stride_bt

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    # Keys past this tile's last query are never seen; a tile past the chunk reads nothing.
    kv_end = tl.where(
        m_tile * BLOCK_M < q_len, tl.minimum(seq_len, context_len + (m_tile + 1) * BLOCK_M), 0
    )
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < seq_len
        k, k_s = _load_kv_tile(
            k_cache_ptr, k_scale_ptr, table_row, kv_head, offs_n, offs_d, mask_n, mask_d,
            stride_ch, stride_cb, stride_cs, stride_sh, stride_sb,
            BLOCK_SIZE, SCALE_MODE, DOT_DTYPE,
        )  # fmt: skip
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        scores = scores * (k_s * qk_scale)[None, :]
        visible = mask_n[None, :] & (offs_n[None, :] <= positions[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        # every row sees key 0 in the first tile, so m_new is finite from there on
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v, v_s = _load_kv_tile(
            v_cache_ptr, v_scale_ptr, table_row, kv_head, offs_n, offs_d, mask_n, mask_d,
            stride_ch, stride_cb, stride_cs, stride_sh, stride_sb,
            BLOCK_SIZE, SCALE_MODE, DOT_DTYPE,
        )  # fmt: skip
        p = (p * v_s[None, :]).to(q_ptr.dtype.element_ty).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    if SCALE_MODE == 2:
        static_off = kv_head * stride_static_h + offs_d * stride_static_d
        acc = acc * tl.load(v_static_ptr + static_off, mask=mask_d, other=0.0)[None, :]
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


# -- launchers ------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch shape of the attention kernels (tuned per device, not per call)."""

    decode_block_n: int = 64
    decode_num_warps: int = 4
    decode_num_stages: int = 2
    prefill_block_m: int = 64
    prefill_block_n: int = 64
    prefill_num_warps: int = 4
    prefill_num_stages: int = 2
    # A decode split streams at least this many context tokens (fewer splits for short ones).
    decode_min_split_tokens: int = 256


@dataclass(frozen=True)
class _CacheArgs:
    """One layer's cache as kernel arguments: tensors, strides and the scale mode."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_static: torch.Tensor
    v_static: torch.Tensor
    strides: tuple[int, ...]  # cache h, b, s; dynamic scale h, b; static h, d
    scale_mode: int


def _cache_args(cache: LayerKVCache) -> _CacheArgs:
    """Check the layout the kernels assume and flatten a LayerKVCache into kernel arguments."""
    k, v = cache.k, cache.v
    assert k.stride() == v.stride() and k.stride(-1) == 1, "K and V must share a dense layout"
    # Unused pointer arguments still need a tensor; the kernels never read them.
    k_scale = v_scale = k_static = v_static = k
    scale_strides = (0, 0)
    static_strides = (0, 0)
    if cache.k_scale is None:
        mode = _NO_SCALE
    elif cache.k_static_scale is None:
        mode = _DYNAMIC
        assert cache.v_scale is not None and cache.k_scale.stride(-1) == 1
        assert cache.k_scale.stride() == cache.v_scale.stride()
        k_scale, v_scale = cache.k_scale, cache.v_scale
        scale_strides = (cache.k_scale.stride(0), cache.k_scale.stride(1))
    else:
        mode = _STATIC
        assert cache.v_static_scale is not None
        k_static = cache.k_static_scale.float().contiguous()
        v_static = cache.v_static_scale.float().contiguous()
        assert k_static.dim() == 2 and k_static.shape == v_static.shape
        # [kvh or 1, head_dim or 1]: a size-1 dim broadcasts through a zero stride
        static_strides = tuple(
            0 if n == 1 else st for n, st in zip(k_static.shape, k_static.stride())
        )  # type: ignore[assignment]
    return _CacheArgs(
        k, v, k_scale, v_scale, k_static, v_static,
        (k.stride(0), k.stride(1), k.stride(2), *scale_strides, *static_strides),
        mode,
    )  # fmt: skip


def _grid_constants(dtype: torch.dtype) -> tuple[int, float, float]:
    """Return _round_to_grid's (mantissa bits, smallest normal, magic); 0 bits = plain cast."""
    return _GRID.get(dtype, (0, 0.0, 0.0))


def write_kv(
    cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store each token's K/V in its slot (slot < 0: skip), quantizing when the cache is FP8.

    k, v: [num_tokens, num_kv_heads, head_dim] (rows may be strided views of a fused QKV).
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    if cache.k_amax is not None:  # calibration observers, as in the reference
        assert cache.v_amax is not None
        torch.maximum(cache.k_amax, k.abs().amax(dim=0).float(), out=cache.k_amax)
        torch.maximum(cache.v_amax, v.abs().amax(dim=0).float(), out=cache.v_amax)
    args = _cache_args(cache)
    is_fp8 = args.scale_mode != _NO_SCALE
    fmax = fp8.fp8_max(cache.k.dtype) if is_fp8 else 0.0
    if args.scale_mode == _STATIC:
        assert cache.num_saturated is not None, "static scales count clipped values"
    saturated = cache.num_saturated if cache.num_saturated is not None else slot_mapping
    mant_bits, min_normal, magic = _grid_constants(cache.k.dtype)
    _write_kv_kernel[(num_tokens,)](
        k, v, slot_mapping, args.k, args.v, args.k_scale, args.v_scale,
        args.k_static, args.v_static, saturated,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *args.strides,
        num_kv_heads, head_dim, fmax,
        fp8.SCALE_ROUND_UP / fmax if is_fp8 else 1.0, fp8._MIN_SCALE,
        BLOCK_SIZE=cache.block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        SCALE_MODE=args.scale_mode,
        MANT_BITS=mant_bits,
        MIN_NORMAL=min_normal,
        MAGIC=magic,
    )  # fmt: skip


def choose_num_splits(num_kv_heads: int, num_sms: int) -> int:
    """Return the decode grid's split count: enough for one sequence to reach every SM.

    Chosen once per model and device, not per step: a context is cut into at most this many
    splits (each at least KernelConfig.decode_min_split_tokens long), so larger batches use
    fewer splits per sequence by themselves.
    """
    return min(64, triton.next_power_of_2(-(-num_sms // num_kv_heads)))


def paged_decode_attention(
    q: torch.Tensor,
    cache: LayerKVCache,
    out: torch.Tensor,
    token_idx: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int = 1,
    config: KernelConfig | None = None,
) -> None:
    """Attend one query token per sequence over its cached context, GQA-aware.

    q, out: [num_tokens, num_heads, head_dim]; sequence b reads q[token_idx[b]] and writes
    out[token_idx[b]]. seq_lens: [B] int32 (0: padding, gets zeros); block_tables:
    [B, max_blocks]. Each context is cut into at most num_splits splits (flash-decoding).
    """
    config = config or KernelConfig()
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0:
        return
    _, num_heads, head_dim = q.shape
    num_kv_heads = cache.k.shape[0]
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads and q.stride(-1) == 1 and out.stride(-1) == 1
    args = _cache_args(cache)
    block_n = config.decode_block_n
    min_split = config.decode_min_split_tokens
    direct = num_splits == 1
    block_d = max(16, triton.next_power_of_2(head_dim))
    if direct:
        mid_out = mid_lse = out  # unused
        mid_strides: tuple[int, ...] = (0, 0, 0, 0, 0)
    else:
        mid_out = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )  # [B, H, S, D]
        mid_lse = torch.empty(
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device
        )
        mid_strides = (*mid_out.stride()[:3], *mid_lse.stride()[:2])
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, args.k, args.v, args.k_scale, args.v_scale, args.k_static, args.v_static,
        out, mid_out, mid_lse, token_idx, seq_lens, block_tables,
        scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *args.strides,
        block_tables.stride(0), *mid_strides, head_dim, min_split,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        BLOCK_SIZE=cache.block_size,
        SCALE_MODE=args.scale_mode,
        DIRECT=direct,
        PRECISION=_precision(q.dtype),
        DOT_DTYPE=_dot_dtype(q.dtype),
        num_warps=config.decode_num_warps,
        num_stages=config.decode_num_stages,
    )  # fmt: skip
    if not direct:
        _reduce_kernel[(num_seqs, num_heads)](
            mid_out, mid_lse, out, token_idx, seq_lens, *mid_strides,
            out.stride(0), out.stride(1), head_dim, num_splits, min_split,
            BLOCK_N=block_n,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )  # fmt: skip


def paged_prefill_attention(
    q: torch.Tensor,
    cache: LayerKVCache,
    out: torch.Tensor,
    q_start: torch.Tensor,
    q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_q_len: int,
    scale: float,
    config: KernelConfig | None = None,
) -> None:
    """Attend packed variable-length chunks over their cached context (causal in the chunk).

    Sequence i owns rows [q_start[i], q_start[i] + q_lens[i]) of q and out ([num_tokens,
    num_heads, head_dim]) and has seq_lens[i] tokens of context, its chunk included, in the
    blocks of block_tables[i]. q_start, q_lens, seq_lens: [P] int32.
    """
    config = config or KernelConfig()
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or max_q_len == 0:
        return
    _, num_heads, head_dim = q.shape
    num_kv_heads = cache.k.shape[0]
    assert q.stride(-1) == 1 and out.stride(-1) == 1
    args = _cache_args(cache)
    block_m = config.prefill_block_m
    grid = (num_seqs, -(-max_q_len // block_m), num_heads)
    _prefill_kernel[grid](
        q, args.k, args.v, args.k_scale, args.v_scale, args.k_static, args.v_static,
        out, q_start, q_lens, seq_lens, block_tables,
        scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *args.strides,
        block_tables.stride(0), head_dim,
        GROUP=num_heads // num_kv_heads,
        BLOCK_M=block_m,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=config.prefill_block_n,
        BLOCK_SIZE=cache.block_size,
        SCALE_MODE=args.scale_mode,
        PRECISION=_precision(q.dtype),
        DOT_DTYPE=_dot_dtype(q.dtype),
        num_warps=config.prefill_num_warps,
        num_stages=config.prefill_num_stages,
    )  # fmt: skip


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """Return tl.dot's operand type: the model's, except bf16 under the interpreter.

    The interpreter multiplies bf16 operands as their raw uint16 bits; widening bf16 values to
    fp32 is exact and the products accumulate in fp32 either way, so the numbers match.
    """
    if dtype == torch.bfloat16:
        return tl.float32 if is_interpreted() else tl.bfloat16
    return {torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def _precision(dtype: torch.dtype) -> str:
    """Return tl.dot's input precision: full fp32 for fp32 models (no TF32 surprise)."""
    return "ieee" if dtype == torch.float32 else "tf32"


# -- the backend ----------------------------------------------------------------------------


@dataclass
class TritonStepMetadata:
    """The device tensors the kernels read, derived once per step from AttentionMetadata."""

    decode_token_ids: torch.Tensor  # [num_decode] int64
    decode_seq_lens: torch.Tensor  # [num_decode] int32
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks]
    prefill_q_start: torch.Tensor  # [num_prefill] int32
    prefill_q_lens: torch.Tensor  # [num_prefill] int32
    prefill_seq_lens: torch.Tensor  # [num_prefill] int32
    prefill_block_tables: torch.Tensor  # [num_prefill, max_blocks]
    prefill_max_q_len: int


class TritonAttention:
    """The CUDA attention backend: TorchRefAttention's interface over the Triton kernels.

    Owns the per-step derived metadata (built on the first layer's call, reused by the others)
    and the kernel configuration.
    """

    def __init__(
        self,
        device: torch.device,
        config: KernelConfig | None = None,
        num_splits: int | None = None,
    ) -> None:
        self.device = device
        self.config = config or KernelConfig()
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 4
        )
        self._num_splits = num_splits
        # Holding the metadata object itself (not its id) makes the identity check safe.
        self._step: tuple[AttentionMetadata, TritonStepMetadata] | None = None

    def num_splits(self, num_kv_heads: int) -> int:
        """Return the decode split count (fixed per backend, so graphs and eager agree)."""
        if self._num_splits is None:
            self._num_splits = choose_num_splits(num_kv_heads, self.num_sms)
        return self._num_splits

    def prepare(self, meta: AttentionMetadata) -> TritonStepMetadata:
        """Return the kernels' view of this step's metadata (built once per step)."""
        if self._step is not None and self._step[0] is meta:
            return self._step[1]
        dev = self.device
        decode_lens = [meta.seq_lens[i] for i in meta.decode_seq_ids]
        pre = meta.prefill_seq_ids
        starts = [meta.query_start_loc[i] for i in pre]
        q_lens = [meta.query_start_loc[i + 1] - meta.query_start_loc[i] for i in pre]
        step = TritonStepMetadata(
            decode_token_ids=meta.decode_token_ids,
            decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int32, device=dev),
            decode_block_tables=meta.decode_block_tables,
            prefill_q_start=torch.tensor(starts, dtype=torch.int32, device=dev),
            prefill_q_lens=torch.tensor(q_lens, dtype=torch.int32, device=dev),
            prefill_seq_lens=torch.tensor(
                [meta.seq_lens[i] for i in pre], dtype=torch.int32, device=dev
            ),
            prefill_block_tables=meta.block_tables[pre] if pre else meta.block_tables[:0],
            prefill_max_q_len=max(q_lens, default=0),
        )
        self._step = (meta, step)
        return step

    def bind(self, meta: AttentionMetadata, step: TritonStepMetadata) -> None:
        """Use `step` (e.g. static CUDA-graph buffers) whenever `meta` is passed in."""
        self._step = (meta, step)

    def write_kv(
        self, cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store each new token's K/V in its slot, quantizing when the cache is FP8."""
        write_kv(cache, k, v, slot_mapping)

    def forward(
        self,
        q: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend each sequence's new tokens over its cached context (causal within the chunk).

        q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]; padding
        tokens (index >= meta.num_real_tokens) get zeros.
        """
        step = self.prepare(meta)
        if out is None:
            out = torch.empty_like(q)
        if q.shape[0] > meta.num_real_tokens:
            out[meta.num_real_tokens :].zero_()
        if meta.decode_seq_ids:
            paged_decode_attention(
                q, cache, out, step.decode_token_ids, step.decode_seq_lens,
                step.decode_block_tables, scale, self.num_splits(cache.k.shape[0]), self.config,
            )  # fmt: skip
        if meta.prefill_seq_ids:
            paged_prefill_attention(
                q, cache, out, step.prefill_q_start, step.prefill_q_lens, step.prefill_seq_lens,
                step.prefill_block_tables, step.prefill_max_q_len, scale, self.config,
            )  # fmt: skip
        return out


__all__ = [
    "KernelConfig",
    "TritonAttention",
    "TritonStepMetadata",
    "choose_num_splits",
    "is_interpreted",
    "paged_decode_attention",
    "paged_prefill_attention",
    "write_kv",
]
