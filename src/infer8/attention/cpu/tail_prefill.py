"""Prefill attention with an FP8 cache's exact tail: which value each (query, key) pair reads.

A prefill query at position a reads positions from exact_tail.first_exact(a) (its window, cut at
its segment's start) and its sequence's sinks as block value + residual, the rest as block
values (exact_tail.py). Two forms of the same rule, per sequence:

- `prefill_parts`: key ranges and a band for split_prefill_attention (long contexts: SDPA's
  flash kernel per range, no [q_len, keys] mask);
- `dense_parts`: two values per key for two_value_attention (contexts of at most
  DENSE_TAIL_MAX_LEN positions, where the split form's ~40 small calls cost more than the math).

Sequences go one at a time. Padding many short prompts into one two_value_attention call was
measured slower (118 ms against 71 ms for 32 prompts of 128 tokens, one layer): its [G, H, L, L]
float32 scores leave the caches, and the element-wise passes over them become memory-bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from infer8.attention.cpu.split_prefill import (
    Band,
    KeyRange,
    split_prefill_attention,
    two_value_attention,
)
from infer8.attention.exact_tail import first_exact, first_exact_t
from infer8.attention.tail_defaults import tail_segment

if TYPE_CHECKING:
    from infer8.attention.exact_tail import TailMetadata
    from infer8.kernels.cpu.prefill import PrefillKernels

# A prefill chunk with an exact tail attends densely (two_value_attention) up to this many
# positions of context: below it the split form's ~40 small calls per sequence cost more than
# the dense form's [heads, q_len, seq_len] products (benchmarks/kv_step_ab.py --prefill-tokens).
DENSE_TAIL_MAX_LEN = 256


@dataclass(frozen=True)
class SequenceTail:
    """What one prefill sequence's tail reads beside its blocks (see TailMetadata)."""

    residuals: tuple[torch.Tensor, torch.Tensor]  # K's and V's dequantized store rows read
    new: tuple[torch.Tensor, torch.Tensor]  # [q_len, kvh, d] tail values of the step's K, V
    ring: torch.Tensor  # read indices of the ring positions [lo, first new position)
    sinks: torch.Tensor  # read indices of the stored sinks [0, min(S, lo))
    num_sinks: int
    exact_start: int  # the first position its row holds exactly
    window: int

    def bounds(self, seq_len: int) -> tuple[int, int, int]:
        """Return (s0, lo, num_quant): the chunk's first position, the first ring position it
        reads, how many positions some query reads quantized."""
        s0 = seq_len - self.new[0].shape[0]
        num_quant = min(seq_len, first_exact(seq_len - 1, self.window, self.exact_start))
        return s0, s0 - self.ring.numel(), num_quant


def sequence_attention(
    q: torch.Tensor,
    blocks: tuple[torch.Tensor, torch.Tensor],
    residuals: tuple[torch.Tensor, torch.Tensor],
    new: tuple[torch.Tensor, torch.Tensor],
    tail: TailMetadata,
    seq_id: int,
    scale: float,
    dense_max_len: int = DENSE_TAIL_MAX_LEN,
    native: PrefillKernels | None = None,
) -> torch.Tensor:
    """Attend one sequence's chunk q [H, q_len, d] over its context with its tail.

    blocks: its K and V blocks dequantized ([kvh, seq_len, d]; this call's own copies, changed);
    residuals: the dequantized store rows read (TailMetadata); new: [q_len, kvh, d] tail values
    of this step's K and V. Dense up to dense_max_len positions, by key ranges beyond;
    `native` (float32 or bf16 CPU) computes the dense form, and the band of the split one, in C.
    """
    k, v = blocks
    seq_len, q_len = k.shape[1], q.shape[1]
    seq_tail = SequenceTail(
        residuals,
        new,
        tail.ring_read_slots[seq_id],
        tail.sink_read_slots[seq_id],
        tail.num_sinks[seq_id],
        tail.exact_starts[seq_id],
        tail.window,
    )
    if seq_len <= dense_max_len:
        exact, reads = dense_parts(k, v, seq_tail)
        keys, values, q_start = (k, exact[0]), (v, exact[1]), seq_len - q_len
        if native is not None and native.two_value_supported(q):
            return native.two_value_attention(q, keys, values, reads, q_start, scale)
        return two_value_attention(q, keys, values, reads, q_start, scale)
    ranges, band = prefill_parts(k, v, seq_tail)
    return split_prefill_attention(q, ranges, band, scale, native)


def prefill_parts(
    k: torch.Tensor, v: torch.Tensor, tail: SequenceTail
) -> tuple[list[KeyRange], Band]:
    """Return one sequence's key ranges and band for split_prefill_attention.

    k, v: [kvh, seq_len, d] dequantized blocks (changed: the sinks' values). Query at position
    a reads [0, a - W] quantized (the first num_sinks at tail precision) through the ranges,
    and (a - W, a] through the band: from first_exact(a) at tail precision, the ones before
    quantized.
    """
    seq_len, window, ring_slots, sink_slots = k.shape[1], tail.window, tail.ring, tail.sinks
    s0, lo, num_quant = tail.bounds(seq_len)
    num_sink = min(tail.num_sinks, num_quant)
    first = s0 - window + 1  # the band's position 0; those below 0 are never read
    valid_from = max(0, -first)
    quant, band_q, band_e = [], [], []
    for x, res, x_new in zip((k, v), tail.residuals, tail.new):
        exact = torch.cat([x[:, lo:s0], x_new.transpose(0, 1).to(x.dtype)], dim=1)  # [lo, n)
        if ring_slots.numel():
            exact[:, : s0 - lo] += res[:, ring_slots]
        if num_sink:  # the sinks among the quantized keys (x is this call's own copy)
            from_store = min(num_sink, lo)
            x[:, :from_store] += res[:, sink_slots[:from_store]]
            x[:, from_store:num_sink] = exact[:, from_store - lo : num_sink - lo]
        shape = (x.shape[0], seq_len - first, x.shape[2])
        e = x.new_zeros(shape)
        e[:, lo - first :] = exact
        b = x.new_zeros(shape)
        b[:, valid_from:] = x[:, first + valid_from :]
        quant.append(x[:, :num_quant])
        band_q.append(b)
        band_e.append(e)
    # every query sees quantized [0, f); query s0 + i sees [f, s0 + i - W] too
    f = min(num_quant, max(first, 0))
    ranges = [
        KeyRange(quant[0][:, :f], quant[1][:, :f]),
        KeyRange(quant[0][:, f:], quant[1][:, f:], causal=True, q_start=f - s0 + window),
    ]
    band = Band(band_e[0], band_e[1], window, valid_from, band_q[0], band_q[1], first,
                tail.exact_start, tail_segment(window))  # fmt: skip
    return ranges, band


def dense_parts(
    k: torch.Tensor, v: torch.Tensor, tail: SequenceTail
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Return one sequence's tail values of every position and which pairs read them.

    The dense form of prefill_parts (same arguments, same rule) for two_value_attention:
    ([kvh, seq_len, d] K and V with block + residual wherever a residual is held, block values
    elsewhere), [q_len, seq_len] bool: query a reads position j exactly iff
    j >= first_exact(a), or j is one of the sinks among its quantized positions.
    """
    seq_len, ring_slots, sink_slots = k.shape[1], tail.ring, tail.sinks
    s0, lo, num_quant = tail.bounds(seq_len)
    exact = []
    for x, res, x_new in zip((k, v), tail.residuals, tail.new):
        if s0 == 0 and not sink_slots.numel():  # a fresh prompt: all of it this step's values
            exact.append(x_new.transpose(0, 1).contiguous())
            continue
        e = x.clone()
        if ring_slots.numel():
            e[:, lo:s0] += res[:, ring_slots]
        e[:, s0:] = x_new.transpose(0, 1)
        if sink_slots.numel():  # sinks below lo, from their slot (those above: ring or new)
            e[:, : sink_slots.numel()] += res[:, sink_slots]
        exact.append(e)
    num_sinks = min(tail.num_sinks, num_quant)
    reads = _reads(seq_len, s0, tail.exact_start, tail.window, num_sinks, k.device)
    return (exact[0], exact[1]), reads


def fresh_reads(seq_len: int, window: int, num_sinks: int) -> torch.Tensor:
    """Return dense_parts' reads for a prompt computed whole in one step (no ring, nothing
    held before it): [seq_len, seq_len] bool."""
    num_quant = first_exact(seq_len - 1, window)
    return _reads(seq_len, 0, 0, window, min(num_sinks, num_quant), torch.device("cpu"))


def _reads(
    seq_len: int, s0: int, exact_start: int, window: int, num_sinks: int, device: torch.device
) -> torch.Tensor:
    """[seq_len - s0, seq_len] bool: query a (positions s0..) reads position j's tail value iff
    j >= first_exact(a), or j < num_sinks."""
    pos = torch.arange(seq_len, device=device)[None, :]
    query = torch.arange(s0, seq_len, device=device)[:, None]
    return (pos >= first_exact_t(query, window, exact_start)) | (pos < num_sinks)
