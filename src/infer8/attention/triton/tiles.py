"""Device functions the Triton attention kernels share: a paged-cache tile widened in registers
with its per-token scales, and the FP8 exact tail's residual terms added to scores and values."""

from __future__ import annotations

import triton
import triton.language as tl

from infer8.attention.triton.tail import load_residual


@triton.jit
def load_kv_tile(
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
def tail_scores(scores, q, exact, res, res_at, qk_scale, PRECISION: tl.constexpr,
                 DOT_DTYPE: tl.constexpr):  # fmt: skip
    """Add q.r (K's residuals) to the scores of the exactly read (query, key) pairs."""
    r, r_s = load_residual(*res, *res_at, DOT_DTYPE)
    s_r = tl.dot(q, tl.trans(r), input_precision=PRECISION) * (r_s * qk_scale)[None, :]
    return tl.where(exact, scores + s_r, scores)


@triton.jit
def tail_values(acc, p, exact, res, res_at, out_dtype: tl.constexpr, PRECISION: tl.constexpr,
                 DOT_DTYPE: tl.constexpr):  # fmt: skip
    """Add p.r (V's residuals) over the exactly read pairs to the output accumulator."""
    r, r_s = load_residual(*res, *res_at, DOT_DTYPE)
    p_r = (tl.where(exact, p, 0.0) * r_s[None, :]).to(out_dtype).to(DOT_DTYPE)
    return acc + tl.dot(p_r, r, input_precision=PRECISION)
