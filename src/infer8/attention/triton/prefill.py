"""Varlen causal prefill attention over the paged cache (a chunk's queries against its cached
prefix and itself), reading FP8 blocks and the exact tail's residuals as decode does."""

from __future__ import annotations

import triton
import triton.language as tl

from infer8.attention.triton.tail import seq_tail
from infer8.attention.triton.tiles import attend_tile
from infer8.attention.triton.write import rotate_rows


# The block table's row stride is the step's longest context in blocks: unspecialized, so a
# new width never compiles the kernel again while serving (tests/gpu/count_compiles.py).
@triton.jit(do_not_specialize=["stride_bt"])
def prefill_kernel(
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
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    HAS_TAIL: tl.constexpr,
    ROTATE: tl.constexpr,
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
    if ROTATE:
        q = rotate_rows(q, rot_ptr, head_dim, BLOCK_D)
    q = q.to(q_ptr.dtype.element_ty).to(DOT_DTYPE)
    table_row = block_table_ptr + i.to(tl.int64) * stride_bt
    kv = (k_cache_ptr, k_scale_ptr, v_cache_ptr, v_scale_ptr, table_row, kv_head, offs_d, mask_d,
          stride_ch, stride_cb, stride_cs, stride_sh, stride_sb)  # fmt: skip
    tail = 0  # read only with HAS_TAIL
    if HAS_TAIL:  # as in decode_kernel; this chunk's residuals start at row q_start
        lo, num_sinks, ring_row, sink_row, res_k, res_v = seq_tail(
            tail_seq_ptr, i, kv_head, num_kv_heads, head_dim, tail_store_ptr,
            tail_store_scale_ptr, tail_new_ptr, tail_new_scale_ptr, store_stride_h,
            store_scale_stride_h,
        )  # fmt: skip
        tail = (lo, num_sinks, window, res_k, res_v, context_len, ring, ring_mod, ring_row,
                sink_row, q_start, row_width, head_dim, 2 * num_kv_heads)  # fmt: skip

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    # Keys past this tile's last query are never seen; a tile past the chunk reads nothing.
    # Every row sees key 0 in the first tile, so the running max is finite from there on.
    kv_end = tl.where(
        m_tile * BLOCK_M < q_len, tl.minimum(seq_len, context_len + (m_tile + 1) * BLOCK_M), 0
    )
    for n0 in range(0, kv_end, BLOCK_N):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, n0, seq_len, positions, context_len + m_tile * BLOCK_M, kv,
            qk_scale, tail, BLOCK_N, BLOCK_SIZE, SCALE_MODE, PRECISION, DOT_DTYPE,
            q_ptr.dtype.element_ty, HAS_TAIL,
        )  # fmt: skip

    if SCALE_MODE == 2:
        static_off = kv_head * stride_static_h + offs_d * stride_static_d
        acc = acc * tl.load(v_static_ptr + static_off, mask=mask_d, other=0.0)[None, :]
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if ROTATE:
        out = rotate_rows(out, rot_ptr, head_dim, BLOCK_D)
    tl.store(
        out_ptr + rows * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )
