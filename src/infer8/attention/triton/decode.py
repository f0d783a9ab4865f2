"""Split-K decode attention over the paged cache: each (sequence, KV head, split) program reads
its share of the context (1-byte FP8 blocks dequantized in registers, the exact tail's residuals
added), and reduce_kernel merges the splits by log-sum-exp (rotating the output back when keys are
rotated). Launchers and layout: launch.py."""

from __future__ import annotations

import triton
import triton.language as tl

from infer8.attention.triton.tail import seq_tail
from infer8.attention.triton.tiles import attend_tile
from infer8.attention.triton.write import rotate_rows, round_to_model


@triton.jit
def decode_kernel(
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
    rot_ptr,
    tail_store_ptr,
    tail_store_scale_ptr,
    tail_new_ptr,
    tail_new_scale_ptr,
    tail_seq_ptr,
    window,
    ring,
    ring_mod,
    row_width,
    store_stride_h,
    store_scale_stride_h,
    num_kv_heads,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    DIRECT: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    HAS_TAIL: tl.constexpr,
    ROTATE: tl.constexpr,
    COMPACT_Q: tl.constexpr,
):
    """One split of one sequence's context for the GROUP query heads of one KV head.

    Flash-decoding: each program keeps a running max / sum / accumulator over its split; with
    DIRECT (one split) it writes the normalized output, else a partial output and its
    log-sum-exp (base 2) for reduce_kernel. How a context is split depends only on its own
    length and the grid's split count, never on the batch: eager steps and CUDA-graph replays
    of any bucket compute the same numbers. HAS_TAIL: an FP8 cache's exact tail (tail.py)
    corrects the scores and output at its positions; ROTATE (DIRECT only: a split grid reads q
    rotated once per sequence by rotate_q_kernel and reduce_kernel rotates the output): q is
    rotated in and the output rotated back (Hadamard-rotated keys and values). COMPACT_Q:
    sequence b's query is row b of q, not row token_idx[b] (the rotated queries).
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
    q_row = b.to(tl.int64) if COMPACT_Q else token
    q = tl.load(
        q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    ).to(tl.float32)  # [BLOCK_G, BLOCK_D]
    if SCALE_MODE == 2:
        static_off = kv_head * stride_static_h + offs_d * stride_static_d
        q = q * tl.load(k_static_ptr + static_off, mask=mask_d, other=0.0)[None, :]
    if ROTATE:
        q = rotate_rows(q, rot_ptr, head_dim, BLOCK_D)
    q = q.to(q_ptr.dtype.element_ty).to(DOT_DTYPE)
    table_row = block_table_ptr + b.to(tl.int64) * stride_bt
    kv = (k_cache_ptr, k_scale_ptr, v_cache_ptr, v_scale_ptr, table_row, kv_head, offs_d, mask_d,
          stride_ch, stride_cb, stride_cs, stride_sh, stride_sb)  # fmt: skip
    positions, tail = 0, 0  # read only with HAS_TAIL
    if HAS_TAIL:  # this sequence's tail, and the K / V residual heads of this KV head
        lo, num_sinks, ring_row, sink_row, res_k, res_v = seq_tail(
            tail_seq_ptr, b, kv_head, num_kv_heads, head_dim, tail_store_ptr,
            tail_store_scale_ptr, tail_new_ptr, tail_new_scale_ptr, store_stride_h,
            store_scale_stride_h,
        )  # fmt: skip
        positions = tl.zeros((BLOCK_G,), tl.int32) + (seq_len - 1)
        tail = (lo, num_sinks, window, res_k, res_v, seq_len - 1, ring, ring_mod, ring_row,
                sink_row, token, row_width, head_dim, 2 * num_kv_heads)  # fmt: skip

    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for n0 in range(start, end, BLOCK_N):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, n0, end, positions, seq_len - 1, kv, qk_scale, tail, BLOCK_N,
            BLOCK_SIZE, SCALE_MODE, PRECISION, DOT_DTYPE, q_ptr.dtype.element_ty, HAS_TAIL,
            False,
        )  # fmt: skip

    if SCALE_MODE == 2:
        static_off = kv_head * stride_static_h + offs_d * stride_static_d
        acc = acc * tl.load(v_static_ptr + static_off, mask=mask_d, other=0.0)[None, :]
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty sequence (padding) gives zeros
    if ROTATE:  # H is its own inverse (with several splits reduce_kernel rotates instead)
        out = rotate_rows(out, rot_ptr, head_dim, BLOCK_D)
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
def _combine_splits(
    mid_out_ptr, mid_lse_ptr, b, h, num_used, stride_mb, stride_mh, stride_ms, stride_lb,
    stride_lh, head_dim, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Return query head h of sequence b: its num_used split partials by their LSE weights."""
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
    return tl.sum(partial * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)


@triton.jit
def reduce_kernel(
    mid_out_ptr,
    mid_lse_ptr,
    out_ptr,
    token_idx_ptr,
    seq_lens_ptr,
    rot_ptr,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    stride_ot,
    stride_oh,
    num_heads,
    head_dim,
    num_splits,
    min_split_tokens,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROTATE: tl.constexpr,
    X_MODE: tl.constexpr,
):
    """Combine sequence b's split partials by their log-sum-exp weights into out[token_idx[b]].

    One query head per program, or with ROTATE (Hadamard-rotated values) BLOCK_H heads: their
    fp32 outputs are rotated back in fp32 and rounded once to out's dtype.
    """
    b = tl.program_id(0)
    seq_len = tl.load(seq_lens_ptr + b)
    token = tl.load(token_idx_ptr + b).to(tl.int64)
    num_used = tl.cdiv(seq_len, _split_size(seq_len, num_splits, min_split_tokens, BLOCK_N))
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    mids = (mid_out_ptr, mid_lse_ptr, b)
    strides = (stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, head_dim)
    if ROTATE:
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        rows = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
        for i in range(0, BLOCK_H):
            # a head past the last repeats it: its row is rotated on its own, never stored
            h = tl.minimum(tl.program_id(1) * BLOCK_H + i, num_heads - 1)
            out = _combine_splits(*mids, h, num_used, *strides, BLOCK_S, BLOCK_D)
            rows = tl.where((tl.arange(0, BLOCK_H) == i)[:, None], out[None, :], rows)
        rows = round_to_model(rotate_rows(rows, rot_ptr, head_dim, BLOCK_D), X_MODE)
        tl.store(
            out_ptr + token * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
            rows.to(out_ptr.dtype.element_ty),
            mask=(offs_h[:, None] < num_heads) & mask_d[None, :],
        )
    else:
        h = tl.program_id(1)
        out = _combine_splits(*mids, h, num_used, *strides, BLOCK_S, BLOCK_D)
        tl.store(
            out_ptr + token * stride_ot + h * stride_oh + offs_d,
            out.to(out_ptr.dtype.element_ty),
            mask=mask_d,
        )
