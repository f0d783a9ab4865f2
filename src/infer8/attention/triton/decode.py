"""Split-K decode attention over the paged cache: each (sequence, KV head, split) program of
decode_kernel reads its share of the context (1-byte FP8 blocks widened in registers), with an
exact tail decode_tail_kernel reads the sinks and the window (block values plus residuals), and
reduce_kernel merges the splits by log-sum-exp (rotating the output back when keys are rotated).
Launchers and layout: launch.py."""

from __future__ import annotations

import triton
import triton.language as tl

from infer8.attention.triton.tail import (
    LO,
    NUM_SINKS,
    SEGMENT_WINDOWS,
    first_exact_position,
    load_residual,
    seq_tail,
)
from infer8.attention.triton.tiles import load_kv_tile, softmax_step
from infer8.attention.triton.write import rotate_rows, round_to_model


# The block table's row stride is the step's longest context in blocks: unspecialized, so a
# new width never compiles the kernel again while serving (tests/gpu/count_compiles.py).
@triton.jit(do_not_specialize=["stride_bt"])
def decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    k_static_ptr,
    v_static_ptr,
    out_ptr,
    mid_out_ptr,
    mid_lse_ptr,
    token_idx_ptr,
    seq_lens_ptr,
    block_table_ptr,
    tail_seq_ptr,
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
    min_split_tokens,
    window,
    v_scale_delta,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TAIL_BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    DIRECT: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    SKIP_TAIL: tl.constexpr,
    COMPACT_Q: tl.constexpr,
    WIDE: tl.constexpr,
    WORDS: tl.constexpr,
    PTX_CVT: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """One split of one sequence's context for the GROUP query heads of one KV head.

    Flash-decoding: each program keeps a running max / sum / accumulator over its split; with
    DIRECT (one split) it writes the normalized output, else a partial output and its
    log-sum-exp (base 2) for reduce_kernel (a split without tokens writes -inf and loads
    nothing). How a context is split depends only on its own length and the grid's split
    count, never on the batch: eager steps and CUDA-graph replays of any bucket compute the
    same numbers. SKIP_TAIL: an FP8 cache's exact tail is read by decode_tail_kernel; this
    kernel reads the positions between the sinks and the tail's first tile (main_range).
    COMPACT_Q: sequence b's query is row b of q, not row token_idx[b] (the rotated queries).
    WIDE: a cache head spans 2 GiB or more (64-bit offsets within a head). WORDS, PTX_CVT:
    _load_tile. SPLIT: an fp32 model over an FP8 cache (fp16 operands, two terms).

    The loop is built for the pipeliner (num_stages 5: table entries a stage ahead of the
    tiles they address, and a two-deep ring of K/V tiles, the copies of tile t + 2 issued
    while tile t is computed): tiles are counted by index (their starts are multiples
    of BLOCK_N), head_dim is a constexpr, no load is masked (positions outside the split
    read one inside and their scores are masked), and the dynamic scales are read as 32-bit
    words of two tokens, K's and V's in one load, so every load of the loop is an
    asynchronous copy of at least 4 bytes per thread. Over an FP8 cache the products run on
    fp16 operands (one conversion per two values, _load_tile) with K's scale on the scores
    and V's on the softmax weights.
    """
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    token = tl.load(token_idx_ptr + b).to(tl.int64)
    lo_n, hi_n = main_range(tail_seq_ptr, b, seq_len, window, SKIP_TAIL, TAIL_BLOCK_N)
    split_size = _split_size(hi_n, tl.num_programs(2), min_split_tokens, BLOCK_N)
    start = tl.maximum(split * split_size, lo_n)
    end = tl.minimum(split * split_size + split_size, hi_n)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    acc_unit = 1.0  # dynamic scales: what one unit of acc is worth
    if start < end:
        q_row = b.to(tl.int64) if COMPACT_Q else token
        q = tl.load(
            q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_g[:, None] & mask_d[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_G, BLOCK_D]
        if SCALE_MODE == 2:
            static_off = kv_head * stride_static_h + offs_d * stride_static_d
            q = q * tl.load(k_static_ptr + static_off, mask=mask_d, other=0.0)[None, :]
        q = q * qk_scale
        q_lo = q  # read with SPLIT only
        if SPLIT:  # an fp32 query as two fp16 terms: the products keep ~22 bits of q
            q_hi = q.to(DOT_DTYPE)
            q_lo = (q - q_hi.to(tl.float32)).to(DOT_DTYPE)
            q = q_hi
        else:
            q = q.to(DOT_DTYPE)
        head = kv_head.to(tl.int64)
        k_head = k_cache_ptr + head * stride_ch
        v_head = v_cache_ptr + head * stride_ch
        # the scales as 32-bit words: two tokens of one block per word (block sizes are even);
        # V's at v_scale_delta words from K's, both read by one load
        ks_head = (k_scale_ptr + head * stride_sh).to(tl.pointer_type(tl.int32), bitcast=True)
        table_row = block_table_ptr + b.to(tl.int64) * stride_bt
        for t in range(start // BLOCK_N, tl.cdiv(end, BLOCK_N)):
            offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = (offs_n >= start) & (offs_n < end)
            # Loads without masks (a mask per load and stage in flight runs out of predicate
            # registers): positions outside [start, end) read a position inside, and their
            # scores are masked. Unsigned: dividing by the block size is a shift.
            n = tl.minimum(tl.maximum(offs_n, start), end - 1).to(tl.uint32)
            in_block = (n % BLOCK_SIZE).to(tl.int32)
            block = tl.load(table_row + n // BLOCK_SIZE).to(tl.int32)
            if WIDE:
                row = block.to(tl.int64) * stride_cb + in_block * stride_cs
            else:
                row = block * stride_cb + in_block * stride_cs
            k = _load_tile(k_head, row, HEAD_DIM, BLOCK_D, DOT_DTYPE, WORDS, PTX_CVT)
            v = _load_tile(v_head, row, HEAD_DIM, BLOCK_D, DOT_DTYPE, WORDS, PTX_CVT)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            if SPLIT:
                scores = tl.dot(q_lo, tl.trans(k), scores, input_precision=PRECISION)
            if SCALE_MODE == 1:
                word = (block * stride_sb + in_block) >> 1
                kv_w = tl.load(ks_head + word[:, None] + tl.arange(0, 2)[None, :] * v_scale_delta)
                k_w, v_w = tl.split(kv_w)
                k_s = _bf16_of_word(k_w, in_block)
                v_s = _bf16_of_word(v_w, in_block)
                scores = scores * k_s[None, :]
            scores = tl.where(mask_n[None, :], scores, float("-inf"))
            m_new, alpha, p, l_i = softmax_step(scores, m_i, l_i)
            if SCALE_MODE == 1:
                # V's scales ride on p, normalized by the tile's largest (p stays in [0, 1])
                # acc is kept in units of the last tile's largest V scale, so the product
                # accumulates in the MMA: acc_unit * acc is the output accumulator
                v_max = tl.max(v_s, axis=0)
                rescale = alpha * (acc_unit / v_max)
                acc = _times_v(p * (v_s * (1.0 / v_max))[None, :], v, acc * rescale[:, None],
                               PRECISION, DOT_DTYPE, SPLIT)  # fmt: skip
                acc_unit = v_max
            else:
                acc = _times_v(p, v, acc * alpha[:, None], PRECISION, DOT_DTYPE, SPLIT)
            m_i = m_new

    if SCALE_MODE == 2:
        static_off = kv_head * stride_static_h + offs_d * stride_static_d
        acc = acc * tl.load(v_static_ptr + static_off, mask=mask_d, other=0.0)[None, :]
    # an empty sequence (padding) gives zeros
    out = acc * (acc_unit / tl.where(l_i > 0, l_i, 1.0))[:, None]
    mask_out = mask_g[:, None] & mask_d[None, :]
    if DIRECT:
        tl.store(
            out_ptr + token * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask_out,
        )
    else:
        mid = b.to(tl.int64) * stride_mb + heads * stride_mh + split * stride_ms
        tl.store(mid_out_ptr + mid[:, None] + offs_d[None, :], out, mask=mask_out)
        lse_off = b.to(tl.int64) * stride_lb + heads * stride_lh + split
        tl.store(mid_lse_ptr + lse_off, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), mask=mask_g)


@triton.jit
def _times_v(w, v, acc, PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr, SPLIT: tl.constexpr):
    """Return acc + w @ v for softmax weights w (fp32): in DOT_DTYPE, or (SPLIT: an fp32
    model) as two DOT_DTYPE terms."""
    w_hi = w.to(DOT_DTYPE)
    acc = tl.dot(w_hi, v, acc, input_precision=PRECISION)
    if SPLIT:
        acc = tl.dot((w - w_hi.to(tl.float32)).to(DOT_DTYPE), v, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _load_tile(head_ptr, row, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               DOT_DTYPE: tl.constexpr, WORDS: tl.constexpr, PTX_CVT: tl.constexpr):  # fmt: skip
    """Return the cache rows `row` (element offsets from head_ptr) as a [rows, BLOCK_D] tile of
    DOT_DTYPE (columns from HEAD_DIM on are zeros).

    WORDS (an FP8 cache read as fp16 operands; HEAD_DIM a multiple of 4): the rows are read as
    32-bit words, each widened into its four values and joined back into rows. Reading words
    keeps the compiler from tracing the operand back to bytes: the tile is then an ordinary
    fp16 operand (ldmatrix reads, the transposed one for V included), not bytes gathered one
    at a time from shared memory. PTX_CVT (on a GPU): a word is widened by PTX's pairwise
    conversion, two instructions a word; else (the interpreter) byte by byte.
    """
    offs_d = tl.arange(0, BLOCK_D)
    if WORDS:
        offs_w = tl.arange(0, BLOCK_D // 4)
        words = tl.load(
            head_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + (row >> 2)[:, None]
            + offs_w[None, :],
            mask=(offs_w < HEAD_DIM // 4)[None, :],
            other=0,
        )  # fmt: skip
        e0, e1, e2, e3 = _widen_words(words, head_ptr.dtype.element_ty, PTX_CVT)
        return tl.join(tl.join(e0, e2), tl.join(e1, e3)).reshape(row.shape[0], BLOCK_D)
    tile = tl.load(
        head_ptr + row[:, None] + offs_d[None, :],
        mask=(offs_d < HEAD_DIM)[None, :],
        other=0.0,
    )
    return tile.to(DOT_DTYPE)


@triton.jit
def _widen_words(words, fp8: tl.constexpr, PTX_CVT: tl.constexpr):
    """Return the four FP8 values packed in int32 words (lowest byte first) as fp16."""
    if PTX_CVT:
        if fp8 == tl.float8e4nv:
            cvt: tl.constexpr = "cvt.rn.f16x2.e4m3x2"
        else:
            cvt: tl.constexpr = "cvt.rn.f16x2.e5m2x2"
        # each cvt widens a 16-bit pair, its low byte into the low half
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 t0, t1; mov.b32 {lo, hi}, $4; "
            + cvt + " t0, lo; " + cvt + " t1, hi; mov.b32 {$0, $1}, t0; mov.b32 {$2, $3}, t1; }",
            "=h,=h,=h,=h,r", [words], dtype=(tl.float16,) * 4, is_pure=True, pack=1,
        )  # fmt: skip
    e0 = (words & 255).to(tl.uint8).to(fp8, bitcast=True).to(tl.float16)
    e1 = ((words >> 8) & 255).to(tl.uint8).to(fp8, bitcast=True).to(tl.float16)
    e2 = ((words >> 16) & 255).to(tl.uint8).to(fp8, bitcast=True).to(tl.float16)
    e3 = ((words >> 24) & 255).to(tl.uint8).to(fp8, bitcast=True).to(tl.float16)
    return e0, e1, e2, e3


@triton.jit
def _bf16_of_word(word, in_block):
    """Return a token's bf16 scale (as fp32) from the 32-bit word holding its pair: the low
    half for tokens at even offsets in their block, the high half for odd ones."""
    bits = tl.where((in_block & 1) == 0, word << 16, word & -65536)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def main_range(tail_seq_ptr, b, seq_len, window, SKIP_TAIL: tl.constexpr,
               TAIL_BLOCK_N: tl.constexpr):  # fmt: skip
    """Return [lo, hi): the positions decode_kernel reads of sequence b's context.

    Without SKIP_TAIL the whole context. With it, decode_tail_kernel reads the sinks and
    every position from the TAIL_BLOCK_N tile that holds the first exactly read one: those
    are the positions whose scores and values the exact tail corrects.
    """
    if SKIP_TAIL:
        row = tail_seq_ptr + b.to(tl.int64) * 4
        first = first_exact_position(tl.load(row + LO), seq_len - 1, window)
        hi = first // TAIL_BLOCK_N * TAIL_BLOCK_N
        lo = tl.minimum(tl.load(row + NUM_SINKS), hi)
    else:
        lo = 0
        hi = seq_len
    return lo, hi


# The block table's row stride is the step's longest context in blocks: unspecialized, so a
# new width never compiles the kernel again while serving (tests/gpu/count_compiles.py).
@triton.jit(do_not_specialize=["stride_bt"])
def decode_tail_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    k_static_ptr,
    v_static_ptr,
    mid_out_ptr,
    mid_lse_ptr,
    token_idx_ptr,
    seq_lens_ptr,
    block_table_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
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
    slot,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    COMPACT_Q: tl.constexpr,
):
    """The exact tail's share of one sequence's context for the GROUP query heads of one KV
    head: the sinks and the positions from the tile of the first exactly read one (the rest is
    decode_kernel's, main_range), block values plus their E4M3 residuals where the query reads
    them exactly (tail.py). Writes a partial output and its log-sum-exp into `slot` of
    reduce_kernel's buffers (the one after decode_kernel's splits).

    A separate kernel so that decode_kernel's loop carries none of the tail's registers; it
    reads at most the window plus a tile and the sinks.
    """
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    token = tl.load(token_idx_ptr + b).to(tl.int64)
    sink_end, tail_start = main_range(tail_seq_ptr, b, seq_len, window, True, BLOCK_N)

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
    q = q.to(q_ptr.dtype.element_ty).to(tl.float32) * qk_scale
    table_row = block_table_ptr + b.to(tl.int64) * stride_bt
    kv = (k_cache_ptr, k_scale_ptr, v_cache_ptr, v_scale_ptr, table_row, kv_head, offs_d, mask_d,
          stride_ch, stride_cb, stride_cs, stride_sh, stride_sb)  # fmt: skip
    lo, num_sinks, ring_row, sink_row, res_k, res_v = seq_tail(
        tail_seq_ptr, b, kv_head, num_kv_heads, head_dim, tail_store_ptr, tail_store_scale_ptr,
        tail_new_ptr, tail_new_scale_ptr, store_stride_h, store_scale_stride_h,
    )  # fmt: skip
    # load_residual's arguments after offs_n, offs_d, mask_d and has_res
    res_at = (seq_len - 1, lo, ring, ring_mod, ring_row, sink_row, token, row_width, head_dim,
              2 * num_kv_heads, num_sinks)  # fmt: skip

    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    # the sinks, then the window's tiles: one loop over both ranges
    num_sink_tiles = tl.cdiv(sink_end, BLOCK_N)
    num_tiles = num_sink_tiles + tl.cdiv(seq_len - tail_start, BLOCK_N)
    for i in range(0, num_tiles):
        in_sinks = i < num_sink_tiles
        n0 = tl.where(in_sinks, i * BLOCK_N, tail_start + (i - num_sink_tiles) * BLOCK_N)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < tl.where(in_sinks, sink_end, seq_len)
        m_i, l_i, acc = _attend_exact_tile(
            q, m_i, l_i, acc, offs_n, mask_n, seq_len - 1, kv, res_k, res_v, res_at, window,
            BLOCK_SIZE, SCALE_MODE,
        )  # fmt: skip

    if SCALE_MODE == 2:
        static_off = kv_head * stride_static_h + offs_d * stride_static_d
        acc = acc * tl.load(v_static_ptr + static_off, mask=mask_d, other=0.0)[None, :]
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    mid = b.to(tl.int64) * stride_mb + heads * stride_mh + slot * stride_ms
    tl.store(
        mid_out_ptr + mid[:, None] + offs_d[None, :], out, mask=mask_g[:, None] & mask_d[None, :]
    )
    lse_off = b.to(tl.int64) * stride_lb + heads * stride_lh + slot
    tl.store(mid_lse_ptr + lse_off, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), mask=mask_g)


@triton.jit
def _attend_exact_tile(q, m_i, l_i, acc, offs_n, mask_n, position, kv, res_k, res_v, res_at,
                       window, BLOCK_SIZE: tl.constexpr, SCALE_MODE: tl.constexpr):  # fmt: skip
    """One online-softmax step of decode_tail_kernel over keys offs_n (those in mask_n).

    A decode query has one position, so whether it reads a key exactly is a per-key fact: each
    key and value is built in fp32 as its block value times its scale, plus residual times
    residual scale where read exactly (tail.py), and the products run in fp32.
    """
    (k_cache_ptr, k_scale_ptr, v_cache_ptr, v_scale_ptr, table_row, kv_head, offs_d, mask_d,
     stride_ch, stride_cb, stride_cs, stride_sh, stride_sb) = kv  # fmt: skip
    (s0, lo, ring, ring_mod, ring_row, sink_row, new_row0, row_width, head_dim, num_heads2,
     num_sinks) = res_at  # fmt: skip
    has_res = mask_n & ((offs_n >= lo) | (offs_n < num_sinks))
    segment = window * SEGMENT_WINDOWS
    in_window = (offs_n > position - window) & (offs_n >= position // segment * segment)
    exact = has_res & (in_window | (offs_n < num_sinks))
    at = (offs_n, offs_d, mask_d, exact, s0, lo, ring, ring_mod, ring_row, sink_row, new_row0,
          row_width, head_dim, num_heads2)  # fmt: skip
    k, k_s = load_kv_tile(
        k_cache_ptr, k_scale_ptr, table_row, kv_head, offs_n, offs_d, mask_n, mask_d,
        stride_ch, stride_cb, stride_cs, stride_sh, stride_sb, BLOCK_SIZE, SCALE_MODE, tl.float32,
    )  # fmt: skip
    r, r_s = load_residual(*res_k, *at, tl.float32)
    k = k * k_s[:, None] + r * r_s[:, None]
    scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    scores = tl.where(mask_n[None, :], scores, float("-inf"))
    m_new, alpha, p, l_i = softmax_step(scores, m_i, l_i)
    v, v_s = load_kv_tile(
        v_cache_ptr, v_scale_ptr, table_row, kv_head, offs_n, offs_d, mask_n, mask_d,
        stride_ch, stride_cb, stride_cs, stride_sh, stride_sb, BLOCK_SIZE, SCALE_MODE, tl.float32,
    )  # fmt: skip
    r, r_s = load_residual(*res_v, *at, tl.float32)
    v = v * v_s[:, None] + r * r_s[:, None]
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _split_size(seq_len, num_splits, min_split_tokens, BLOCK_N: tl.constexpr):
    """Return the tokens per split of a context: an even share, at least min_split_tokens."""
    share = tl.maximum(tl.cdiv(seq_len, num_splits), min_split_tokens)
    return tl.cdiv(share, BLOCK_N) * BLOCK_N


@triton.jit
def _combine_splits(
    mid_out_ptr, mid_lse_ptr, b, h, num_slots, stride_mb, stride_mh, stride_ms, stride_lb,
    stride_lh, head_dim, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Return query head h of sequence b: its num_slots split partials by their LSE weights
    (a split without tokens wrote -inf and zeros)."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_slots
    mask_d = offs_d < head_dim
    base = b.to(tl.int64) * stride_mb + h * stride_mh + offs_s * stride_ms
    lse_off = b.to(tl.int64) * stride_lb + h * stride_lh + offs_s
    lse = tl.load(mid_lse_ptr + lse_off, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # [BLOCK_S]
    partial = tl.load(
        mid_out_ptr + base[:, None] + offs_d[None, :],
        mask=(lse > float("-inf"))[:, None] & mask_d[None, :],
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
    num_slots,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROTATE: tl.constexpr,
    X_MODE: tl.constexpr,
):
    """Combine sequence b's split partials (decode_kernel's splits, then decode_tail_kernel's
    slot) by their log-sum-exp weights into out[token_idx[b]].

    One query head per program, or with ROTATE (Hadamard-rotated values) BLOCK_H heads: their
    fp32 outputs are rotated back in fp32 and rounded once to out's dtype.
    """
    b = tl.program_id(0)
    token = tl.load(token_idx_ptr + b).to(tl.int64)
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
            out = _combine_splits(*mids, h, num_slots, *strides, BLOCK_S, BLOCK_D)
            rows = tl.where((tl.arange(0, BLOCK_H) == i)[:, None], out[None, :], rows)
        rows = round_to_model(rotate_rows(rows, rot_ptr, head_dim, BLOCK_D), X_MODE)
        tl.store(
            out_ptr + token * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
            rows.to(out_ptr.dtype.element_ty),
            mask=(offs_h[:, None] < num_heads) & mask_d[None, :],
        )
    else:
        h = tl.program_id(1)
        out = _combine_splits(*mids, h, num_slots, *strides, BLOCK_S, BLOCK_D)
        tl.store(
            out_ptr + token * stride_ot + h * stride_oh + offs_d,
            out.to(out_ptr.dtype.element_ty),
            mask=mask_d,
        )
