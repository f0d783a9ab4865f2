"""Device functions of the Triton attention kernels: a paged-cache tile widened in registers with
its per-token scales (the prefill kernel and decode_tail_kernel), the FP8 exact tail's residual
terms added to scores and values, the online-softmax step every attention kernel runs, and the
prefill kernel's causal step over one tile of keys."""

from __future__ import annotations

import triton
import triton.language as tl

from infer8.attention.triton.tail import load_residual, tail_exact, tile_has_tail


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


@triton.jit
def softmax_step(scores, m_i, l_i):
    """One online-softmax step (base 2) over a tile's scores [rows, BLOCK_N]: return the new
    running max, the factor that rescales what came before, the tile's weights and the new
    running sum."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def attend_tile(
    q,
    m_i,
    l_i,
    acc,
    n0,
    limit,
    positions,
    min_position,
    kv,
    qk_scale,
    tail,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    HAS_TAIL: tl.constexpr,
):
    """One online-softmax step: keys [n0, n0 + BLOCK_N) (those below `limit`) into the running
    max m_i, sum l_i (base 2) and output acc of the queries q (at `positions`, the first at
    `min_position`). Returns (m_i, l_i, acc).

    kv: (K cache, K scales, V cache, V scales, the sequence's block-table row, KV head, offs_d,
    mask_d, the cache's and the scales' strides); tail (read with HAS_TAIL): (lo, sinks, window,
    K's and V's residual pointers, then load_residual's per-sequence arguments from the first
    new position on). A query sees keys up to its own position.
    """
    (k_cache_ptr, k_scale_ptr, v_cache_ptr, v_scale_ptr, table_row, kv_head, offs_d, mask_d,
     stride_ch, stride_cb, stride_cs, stride_sh, stride_sb) = kv  # fmt: skip
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < limit
    k, k_s = load_kv_tile(
        k_cache_ptr, k_scale_ptr, table_row, kv_head, offs_n, offs_d, mask_n, mask_d,
        stride_ch, stride_cb, stride_cs, stride_sh, stride_sb, BLOCK_SIZE, SCALE_MODE, DOT_DTYPE,
    )  # fmt: skip
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    scores = scores * (k_s * qk_scale)[None, :]
    if HAS_TAIL:
        (lo, num_sinks, window, res_k, res_v, first_new, ring, ring_mod, ring_row, sink_row,
         new_row0, row_width, head_dim, num_heads2) = tail  # fmt: skip
        exact, has_res = tail_exact(offs_n, mask_n, positions, lo, num_sinks, window)
        in_tail = tile_has_tail(n0, lo, num_sinks, min_position, window, BLOCK_N)
        res_at = (offs_n, offs_d, mask_d, has_res, first_new, lo, ring, ring_mod, ring_row,
                  sink_row, new_row0, row_width, head_dim, num_heads2)  # fmt: skip
        if in_tail:
            scores = tail_scores(scores, q, exact, res_k, res_at, qk_scale, PRECISION, DOT_DTYPE)
    visible = mask_n[None, :] & (offs_n[None, :] <= positions[:, None])
    scores = tl.where(visible, scores, float("-inf"))
    m_new, alpha, p, l_i = softmax_step(scores, m_i, l_i)
    v, v_s = load_kv_tile(
        v_cache_ptr, v_scale_ptr, table_row, kv_head, offs_n, offs_d, mask_n, mask_d,
        stride_ch, stride_cb, stride_cs, stride_sh, stride_sb, BLOCK_SIZE, SCALE_MODE, DOT_DTYPE,
    )  # fmt: skip
    pv = (p * v_s[None, :]).to(OUT_DTYPE).to(DOT_DTYPE)
    acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=PRECISION)
    if HAS_TAIL:
        if in_tail:
            acc = tail_values(acc, p, exact, res_v, res_at, OUT_DTYPE, PRECISION, DOT_DTYPE)
    return m_new, l_i, acc
