"""The FP8 cache's exact tail in the Triton kernels (exact_tail.py describes the tail itself).

A step on the CUDA backend does, per layer:
1. `tail_residuals`: one program per new token recomputes its FP8 block value (the same
   quantization the cache write just did), stores the E4M3 residual and its scale in a step
   buffer ([tokens, 2 * kvh, d], K's heads then V's) and, for tokens that are sinks, in the
   store too (before attention: a request may hit a first block computed in the same step);
2. the attention kernels read, for each key position j their query a reads exactly, block
   value + residual: the residual from the step buffer (j in this step's tokens), the ring
   (j in [lo, first new position)) or the sink slot (j < lo); the scores get q.r and the
   output p.r, both as extra tile products only in tiles that hold an exact position;
3. `write_ring`: the tokens that enter a ring are copied from the step buffer (after
   attention: a long chunk overwrites ring positions its first queries still read).

Query a reads position j exactly iff j has a residual (j >= lo or j < the sinks) and j is in
its window cut at its segment's start (j > a - W and j >= a // (K * W) * (K * W)) or a sink. Every index is a per-token or per-sequence tensor of fixed
shape, so a CUDA-graph bucket holds them in static buffers (cuda_graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from infer8.attention.exact_tail import TailMetadata, first_exact
from infer8.attention.tail_defaults import EXACT_TAIL_SEGMENT_WINDOWS

# Columns of the per-sequence tail table the attention kernels read (constexpr: jit code may
# read module globals only as constants).
LO, NUM_SINKS, RING_ROW, SINK_ROW = (tl.constexpr(c) for c in range(4))
SEGMENT_WINDOWS = tl.constexpr(EXACT_TAIL_SEGMENT_WINDOWS)  # a segment's length in windows


@dataclass
class TritonTailStep:
    """This step's tail indices as the kernels read them (static buffers under CUDA graphs)."""

    window: int  # W
    ring: int  # W - 1 ring positions per row
    ring_slots: torch.Tensor  # [tokens] int64: store slot a token enters after attention, or -1
    sink_slots: torch.Tensor  # [tokens] int64: store slot of a sink token, or -1
    decode: torch.Tensor  # [num_decode, 4] int32: lo, sinks, ring row, sink row
    prefill: torch.Tensor  # [num_prefill, 4] int32


def build_tail_step(
    tail: TailMetadata, num_tokens: int, decode_ids: list[int], prefill_ids: list[int],
    query_start_loc: list[int], seq_lens: list[int], device: torch.device,
) -> TritonTailStep:  # fmt: skip
    """Return the kernels' view of a step's TailMetadata (its slot lists, as per-token tables)."""
    ring_slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    ring_slots[tail.write_token_ids] = tail.write_slots
    sink_slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    sink_slots[tail.sink_write_token_ids] = tail.sink_write_slots
    ring = tail.ring_size

    def table(ids: list[int]) -> torch.Tensor:
        rows = []
        for i in ids:
            s0 = seq_lens[i] - (query_start_loc[i + 1] - query_start_loc[i])
            lo = first_exact(s0, tail.window, tail.exact_starts[i])
            rows.append([lo, tail.num_sinks[i], tail.rows[i], max(tail.sink_rows[i], 0)])
        return torch.tensor(rows, dtype=torch.int32, device=device).view(len(ids), 4)

    return TritonTailStep(
        tail.window, ring, ring_slots, sink_slots, table(decode_ids), table(prefill_ids)
    )


# -- what the attention kernels call ----------------------------------------------------------


@triton.jit
def tail_exact(offs_n, mask_n, positions, lo, num_sinks, window):
    """Return which (query, key) pairs of a tile read the key exactly: [len(positions), BLOCK_N].

    Also returns, per key, whether it has a residual at all (for load_residual).
    """
    has_res = mask_n & ((offs_n >= lo) | (offs_n < num_sinks))
    segment = window * SEGMENT_WINDOWS
    in_window = (offs_n[None, :] > positions[:, None] - window) & (
        offs_n[None, :] >= (positions // segment * segment)[:, None]
    )
    return has_res[None, :] & (in_window | (offs_n < num_sinks)[None, :]), has_res


@triton.jit
def first_exact_position(lo, position, window):
    """Return the first position a query at `position` reads exactly, sinks aside (as
    exact_tail.first_exact; lo: its row's first exact position)."""
    segment = window * SEGMENT_WINDOWS
    return tl.maximum(tl.maximum(position - window + 1, position // segment * segment), lo)


@triton.jit
def seq_tail(
    tail_seq_ptr,
    seq,
    kv_head,
    num_kv_heads,
    head_dim,
    store_ptr,
    store_scale_ptr,
    new_ptr,
    new_scale_ptr,
    store_stride_h,
    store_scale_stride_h,
):
    """Return a sequence's tail row (lo, sinks, ring row, sink row) and load_residual's first
    pointers for K's and V's residual heads of kv_head: (store, its scales, step buffer, its
    scales), each offset to the head."""
    row = tail_seq_ptr + seq.to(tl.int64) * 4
    lo, num_sinks = tl.load(row + LO), tl.load(row + NUM_SINKS)
    ring_row, sink_row = tl.load(row + RING_ROW), tl.load(row + SINK_ROW)
    k_head = kv_head.to(tl.int64)
    v_head = k_head + num_kv_heads
    res_k = (store_ptr + k_head * store_stride_h, store_scale_ptr + k_head * store_scale_stride_h,
             new_ptr + k_head * head_dim, new_scale_ptr + k_head)  # fmt: skip
    res_v = (store_ptr + v_head * store_stride_h, store_scale_ptr + v_head * store_scale_stride_h,
             new_ptr + v_head * head_dim, new_scale_ptr + v_head)  # fmt: skip
    return lo, num_sinks, ring_row, sink_row, res_k, res_v


@triton.jit
def tile_has_tail(n0, lo, num_sinks, min_position, window, BLOCK_N: tl.constexpr):
    """Return whether keys [n0, n0 + BLOCK_N) hold an exact position for a query >= min_position."""
    last = n0 + BLOCK_N - 1
    segment = window * SEGMENT_WINDOWS
    first = tl.maximum(min_position - window + 1, min_position // segment * segment)
    return (n0 < num_sinks) | ((last >= lo) & (last >= first))


@triton.jit
def load_residual(
    store_ptr,
    store_scale_ptr,
    new_ptr,
    new_scale_ptr,
    offs_n,
    offs_d,
    mask_d,
    has_res,
    s0,
    lo,
    ring,
    ring_mod,
    ring_row,
    sink_row,
    new_row0,
    row_width,
    head_dim,
    num_res_heads,
    DOT_DTYPE: tl.constexpr,
):
    """Gather the residuals of keys offs_n for one head: [BLOCK_N, BLOCK_D] and scales [BLOCK_N].

    Pointers are offset to the head already. Keys without a residual give zeros (scale 0).
    From this step's buffer (j >= s0, row new_row0 + j - s0), the ring (lo <= j < s0, offset
    j % ring of ring_row; ring_mod = max(ring, 1)) or the sink slot (j < lo, offset ring + j
    of sink_row).
    """
    is_new = has_res & (offs_n >= s0)
    in_store = has_res & (offs_n < s0)
    slot = tl.where(
        offs_n >= lo,
        ring_row * row_width + offs_n % ring_mod,
        sink_row * row_width + ring + offs_n,
    ).to(tl.int64)
    new_row = (new_row0 + offs_n - s0).to(tl.int64)
    mask_store = in_store[:, None] & mask_d[None, :]
    mask_new = is_new[:, None] & mask_d[None, :]
    stored = tl.load(
        store_ptr + slot[:, None] * head_dim + offs_d[None, :], mask=mask_store, other=0.0
    )
    fresh = tl.load(
        new_ptr + new_row[:, None] * (num_res_heads * head_dim) + offs_d[None, :],
        mask=mask_new,
        other=0.0,
    )
    tile = tl.where(mask_new, fresh.to(tl.float32), stored.to(tl.float32)).to(DOT_DTYPE)
    scale = tl.load(store_scale_ptr + slot, mask=in_store, other=0.0).to(tl.float32)
    scale += tl.load(new_scale_ptr + new_row * num_res_heads, mask=is_new, other=0.0).to(tl.float32)
    return tile, scale


__all__ = [
    "TritonTailStep",
    "build_tail_step",
    "first_exact_position",
    "load_residual",
    "seq_tail",
    "tail_exact",
    "tile_has_tail",
]
