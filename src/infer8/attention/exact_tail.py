"""The exact tail of an FP8 KV cache: each sequence's latest and first tokens at 16-bit precision.

One rule for every path (a prefill chunk, a decode, a prefix hit, a host-tier load, a recompute
after preemption): a query at position `a` reads the keys and values of its window, positions
(a - W, a], cut at the start of its segment (positions are cut into segments of K windows,
tail_defaults.tail_segment), and the sequence's first S positions (its "attention sinks")
near-exactly, everything else from the FP8 blocks (first_exact). What a query reads is a
function of its position alone, so a request's numbers do not depend on how the scheduler
chunks it, what shares its step, or whether its prefix was cached: a prefix hit is shortened to
a segment start (core/exact_tail_seats.py), where nothing exact from before the hit is needed.
(An uncut window would need the exact values of the W positions before a hit, and recomputing
those needs the W before them, down to position 0.)
Storage:

- the FP8 blocks hold every token, quantized on write exactly as without a tail (dynamic
  per-token scales make "quantize when it leaves the window" the same values), so a
  prefix-cached block is always the quantized one and hits stay bit-identical;
- beside them, a second FP8 (E4M3) layer holds the *residual* of the tail's tokens: x minus its
  dequantized block value, with its own per-token scale. Block value + residual carries about 8
  mantissa bits (a bf16 copy's precision) at one byte per element, so the tail costs what FP8
  tokens cost, whatever the compute dtype. Every value a query reads "exactly" is block value +
  residual, a step's own tokens too;
- per layer, a store ([num_kv_heads, rows, W - 1 + S, head_dim] + scales) gives each seat a ring
  of W - 1 positions (those just before a step's own tokens; the scheduler gives one row to
  each running request) and S sink positions;
- sinks are keyed by the hash of the request's first block (core/exact_tail_seats.py): the
  request that computes block 0 writes them, and a request that hits that block in the prefix
  cache reads the same residuals, so a shared system prompt keeps exact sinks. A block whose
  sinks are gone (their slot was reused) is not a hit: the request computes from position 0;
- the ring is updated after attention (a long chunk would otherwise overwrite the positions it
  still has to read); sinks before it (a request may hit a block computed in the same step).

A request's row holds ring values only from the first position it computed since it was given
the row (`exact_start`, a segment boundary: 0 or a shortened hit), so no query reads its ring
before that.

Hadamard rotation (`kv_cache_hadamard`): K and q are multiplied by the same orthonormal
(Sylvester) Hadamard matrix per head before K is stored, so q.k is unchanged in exact arithmetic
while an outlier channel of K is spread over all of the head's channels before it meets FP8's
per-token scale; V is rotated alike and the attention output rotated back (H is its own
inverse). The rotation runs inside the backend's write and attend calls, not as a model pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from infer8.attention.tail_defaults import (  # noqa: F401  (their home for torch users)
    DEFAULT_EXACT_SINK_TOKENS,
    DEFAULT_EXACT_TAIL_TOKENS,
    DEFAULT_HADAMARD,
    tail_segment,
)
from infer8.quant import fp8

if TYPE_CHECKING:
    from infer8.attention.kv_cache import KVCacheSpec

# The residual layer is E4M3 whatever the cache's format: it is scaled per token, so it needs
# precision, not range (an E5M2 residual would leave ~6 mantissa bits instead of ~8).
RESIDUAL_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True)
class ExactTailConfig:
    """The resolved tail of one cache: window W, sinks S, rotation."""

    tokens: int = 0
    sink_tokens: int = 0
    hadamard: bool = False


def resolve_exact_tail(
    tail_tokens: int | None,
    hadamard: bool | None,
    is_fp8: bool,
    kernels_read_tail: bool,
    has_static_scales: bool,
    head_dim: int,
    sink_tokens: int | None = None,
    block_size: int = 16,
) -> ExactTailConfig:
    """Return the window, sinks and rotation of a cache; None means auto.

    Auto turns them on for an FP8 cache where the attention kernels read a tail (the CPU
    backend, and the Triton kernels on GPUs with E4M3, sm_89+: the residuals are E4M3) with
    dynamic scales (static scales are calibrated on unrotated K). Sinks need a window (they
    share its store) and fit in the first block (they are keyed by it).
    """
    if not is_fp8:
        return ExactTailConfig()
    pow2 = head_dim & (head_dim - 1) == 0
    if hadamard and has_static_scales:
        raise ValueError("kv_cache_hadamard needs dynamic scales (--kv-scale dynamic)")
    if hadamard and not pow2:
        raise ValueError(f"kv_cache_hadamard needs a power-of-two head_dim, got {head_dim}")
    if tail_tokens is None:
        tail_tokens = DEFAULT_EXACT_TAIL_TOKENS if kernels_read_tail else 0
    if sink_tokens is None:
        sink_tokens = DEFAULT_EXACT_SINK_TOKENS if tail_tokens else 0
    if sink_tokens and not tail_tokens:
        raise ValueError("kv_cache_exact_sink_tokens needs kv_cache_exact_tail_tokens >= 1")
    if sink_tokens > block_size:
        raise ValueError(
            f"kv_cache_exact_sink_tokens ({sink_tokens}) must fit in one block "
            f"(block_size {block_size})"
        )
    if hadamard is None:
        hadamard = DEFAULT_HADAMARD and kernels_read_tail and pow2 and not has_static_scales
    return ExactTailConfig(tail_tokens, sink_tokens, hadamard)


def describe_exact_tail(spec: KVCacheSpec, num_rows: int) -> str:
    """Return the start-up line's suffix: which tokens stay at 16-bit precision, and rotation."""
    parts = []
    if spec.exact_tail_tokens:
        mib = spec.tail_bytes(num_rows) / (1 << 20)
        sinks = f"first {spec.exact_sink_tokens} and " if spec.exact_sink_tokens else ""
        parts.append(
            f"each running request's {sinks}last {spec.exact_tail_tokens} tokens read at 16-bit "
            f"precision ({mib:.1f} MiB of it, for up to {num_rows:,} running requests)"
        )
    if spec.hadamard:
        parts.append("K and V Hadamard-rotated before quantizing")
    return "; " + "; ".join(parts) if parts else ""


def hadamard(n: int, device: torch.device | None = None) -> torch.Tensor:
    """Return the orthonormal Sylvester Hadamard matrix of size n (a power of two), float32."""
    assert n >= 1 and n & (n - 1) == 0, f"{n} is not a power of two"
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(device)  # symmetric and its own inverse


def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Return x @ rotation over the last dim, computed in float32, in x's dtype."""
    return (x.float() @ rotation).to(x.dtype)


def quantize_residual(x: torch.Tensor, x_block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the residual x - x_block as E4M3 values and per-row scales ([..., d], [...])."""
    r = x.float() - x_block.float()
    scale = fp8.dynamic_scale(r, RESIDUAL_DTYPE)
    return fp8.quantize(r, scale[..., None], RESIDUAL_DTYPE), scale


def add_residual(
    x_block: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """Return block value + dequantized residual in x_block's dtype (the tail's value)."""
    return x_block + fp8.dequantize(residual, scale[..., None], x_block.dtype)


def block_value(
    x: torch.Tensor, cache_dtype: torch.dtype, static: torch.Tensor | None
) -> torch.Tensor:
    """Return x as the FP8 cache stores and returns it: quantized (dynamic or static scale),
    dequantized in x's dtype."""
    scale = fp8.dynamic_scale(x, cache_dtype)[..., None] if static is None else static
    return fp8.dequantize(fp8.quantize(x, scale, cache_dtype), scale, x.dtype)


def tail_values(
    kv: torch.Tensor, cache_dtype: torch.dtype, statics: Sequence[torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (residual, its scales, tail value) of a step's K and V ([n, 2, kvh, d]; one
    static scale or None per tensor of dim 1).

    The torch reference of the native pass (cpu/kv_kernels.py: tail_residual), static scales included.
    """
    blocks = [block_value(kv[:, i], cache_dtype, s) for i, s in enumerate(statics)]
    x_block = torch.stack(blocks, dim=1)
    res_q, res_scale = quantize_residual(kv, x_block)
    return res_q, res_scale, add_residual(x_block, res_q, res_scale)


def first_exact(position: int, window: int, exact_start: int = 0) -> int:
    """Return the first position a query at `position` reads at tail precision (sinks aside):
    its window, cut at its segment's start (and at its row's first exact position)."""
    segment = tail_segment(window)
    return max(position - window + 1, position // segment * segment, exact_start)


def first_exact_t(positions: torch.Tensor, window: int, exact_start: int = 0) -> torch.Tensor:
    """first_exact of each query position (an int64 tensor of any shape)."""
    segment = tail_segment(window)
    first = torch.maximum(positions - window + 1, positions // segment * segment)
    return torch.clamp(first, min=exact_start)


@dataclass
class TailMetadata:
    """Where this step's sequences read and write their tail.

    Writes use store slots (`row * stride + offset`); reads use indices into the dequantized
    rows `read_rows` of the store (`i * stride + offset` for the i-th read row), so a step
    dequantizes only the rows it reads, once per layer. A decode sequence's tail enters its
    attention as corrections q.r to the scores and p.r to the output at the tail's positions
    (block value + residual, distributed), not as rewritten keys.
    """

    window: int  # W: a query at position a reads [first_exact(a, W), a] exactly
    ring_size: int  # W - 1 ring positions per row
    exact_starts: list[int]  # per sequence: first position its row holds exactly
    num_sinks: list[int]  # per sequence: first positions read exactly (0: sinks lost)
    read_rows: torch.Tensor  # [r] int64: the store rows this step reads
    ring_read_slots: list[torch.Tensor]  # per sequence: read indices of [lo, first new position)
    sink_read_slots: list[torch.Tensor]  # per sequence: read indices of [0, min(S, lo))
    write_token_ids: torch.Tensor  # [n] int64: flat-batch tokens that enter the ring, ascending
    write_slots: torch.Tensor  # [n] int64: their store slots
    sink_write_token_ids: torch.Tensor  # [m] int64: flat-batch tokens that are sinks, ascending
    sink_write_slots: torch.Tensor  # [m] int64: their store slots
    decode_new: torch.Tensor  # [num_decode] int64: each new token's index in the gathered [B * L]
    # decode: per sequence, the positions of its 2 * stride read residuals (its ring row,
    # then its sink slot's row) and whether each holds one (1.0) or is unused (0.0)
    decode_pos: torch.Tensor  # [num_decode, 2 * stride] int64
    decode_valid: torch.Tensor  # [num_decode, 2 * stride] float32
    # per sequence: its ring row and its sink slot's row (-1: none), for the Triton kernels
    rows: list[int] = field(default_factory=list)
    sink_rows: list[int] = field(default_factory=list)


def build_tail_metadata(
    window: int,
    sink_tokens: int,
    rows: list[int],
    exact_starts: list[int],
    sinks: list[tuple[int, bool]],
    query_lens: list[int],
    num_computed_tokens: list[int],
    decode_seq_ids: list[int],
    decode_ctx_len: int,
    device: torch.device,
) -> TailMetadata:
    """Build the tail's per-step indices from each sequence's row, sink slot and progress.

    decode_ctx_len: L, the padded length each decode sequence's context is gathered to.

    A row's store holds ring positions p at offset `p % ring` and a sink slot's positions
    p < S at offset `ring + p` of row `slot` (each row is ring + S wide). The rows read start
    with two per decode sequence (its ring row, then its sink slot's row), then the rows the
    prefill sequences read.
    """
    assert window >= 1
    ring, stride = window - 1, window - 1 + sink_tokens
    decode = set(decode_seq_ids)
    read_rows: list[int] = []
    for i in decode_seq_ids:
        read_rows += [rows[i], max(sinks[i][0], 0)]
    dec_pos, dec_valid = _decode_positions(
        window, sink_tokens, [num_computed_tokens[i] for i in decode_seq_ids],
        [exact_starts[i] for i in decode_seq_ids], [sinks[i][0] for i in decode_seq_ids],
    )  # fmt: skip
    prefill_rows: dict[int, int] = {}  # store row -> its index among the rows read

    def read(row: int, offset: int) -> int:
        index = prefill_rows.setdefault(row, len(read_rows) + len(prefill_rows))
        return index * stride + offset

    wt: list[int] = []  # ring writes: tokens, slots; sink writes: tokens, slots
    ws: list[int] = []
    st: list[int] = []
    ss: list[int] = []
    ring_reads, sink_reads, num_sinks = [], [], []
    token_start = 0
    for i, (row, start, (slot, writes), q_len, s0) in enumerate(
        zip(rows, exact_starts, sinks, query_lens, num_computed_tokens)
    ):
        num_sinks.append(sink_tokens if slot >= 0 else 0)
        if q_len == 1 and i in decode:  # what the general case below does for one token
            sink_reads.append([])
            ring_reads.append([])
            if ring:
                wt.append(token_start)
                ws.append(row * stride + s0 % ring)
            if writes and s0 < sink_tokens:
                st.append(token_start)
                ss.append(slot * stride + ring + s0)
            token_start += 1
            continue
        lo = first_exact(s0, window, start)
        is_prefill = i not in decode
        sink_reads.append(
            [read(slot, ring + p) for p in range(min(num_sinks[-1], lo))] if is_prefill else []
        )
        ring_reads.append([read(row, p % ring) for p in range(lo, s0)] if is_prefill else [])
        if ring:
            for p in range(max(s0, s0 + q_len - ring), s0 + q_len):
                wt.append(token_start + p - s0)
                ws.append(row * stride + p % ring)
        if writes:
            for p in range(s0, min(s0 + q_len, sink_tokens)):
                st.append(token_start + p - s0)
                ss.append(slot * stride + ring + p)
        token_start += q_len

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64, device=device)

    empty = t([])  # the decode sequences' (read-only) prefill read lists

    return TailMetadata(
        window,
        ring,
        exact_starts,
        num_sinks,
        t(read_rows + list(prefill_rows)),
        [t(x) if x else empty for x in ring_reads],
        [t(x) if x else empty for x in sink_reads],
        t(wt),
        t(ws),
        t(st),
        t(ss),
        t([b * decode_ctx_len + num_computed_tokens[i] for b, i in enumerate(decode_seq_ids)]),
        dec_pos.to(device),
        dec_valid.to(device),
        rows=list(rows),
        sink_rows=[slot for slot, _ in sinks],
    )


def _decode_positions(
    window: int, sink_tokens: int, s0: list[int], starts: list[int], slots: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the decode sequences' read positions and validity ([B, 2 * (ring + S)] int64,
    float32): per sequence its ring row's ring positions and S zeros, then its sink row's
    ring zeros and sink positions 0..S-1; a position is valid when the sequence reads it from
    the store (ring positions from first_exact, sinks below it). Invalid ones read 0.
    """
    b, ring = len(s0), window - 1  # numpy: a dozen ~1 us ops instead of ~8 (a decode's cost)
    s0_np, segment = np.asarray(s0, dtype=np.int64), tail_segment(window)
    first = s0_np - ring  # [B]: the ring's oldest position
    lo = np.maximum(np.asarray(starts, dtype=np.int64), s0_np // segment * segment)
    lo = np.maximum(lo, first)
    # ring offset j holds the position p in [s0 - ring, s0) with p % ring == j
    offsets = np.arange(ring, dtype=np.int64)
    ring_pos = first[:, None] + np.remainder(offsets[None, :] - first[:, None], max(ring, 1))
    has_sinks = np.asarray(slots, dtype=np.int64) >= 0
    num_sinks_read = np.minimum(np.where(has_sinks, sink_tokens, 0), lo)
    sink_pos = np.broadcast_to(np.arange(sink_tokens, dtype=np.int64), (b, sink_tokens))
    zeros = np.zeros((b, sink_tokens + ring), dtype=np.int64)
    pos = np.concatenate([ring_pos, zeros, sink_pos], axis=1)
    valid = np.concatenate(
        [ring_pos >= lo[:, None], zeros.astype(bool), sink_pos < num_sinks_read[:, None]], axis=1
    )
    return torch.from_numpy(pos * valid), torch.from_numpy(valid.astype(np.float32))


def write_store(
    store: tuple[torch.Tensor, torch.Tensor],
    residual: tuple[torch.Tensor, torch.Tensor],
    token_ids: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Store residuals of the step's tokens `token_ids` at `slots`.

    store: ([kvh, rows, stride, d] E4M3, [kvh, rows, stride] scales); residual: ([tokens, kvh, d],
    [tokens, kvh]).
    """
    if slots.numel() == 0:
        return
    values, scales = store
    kvh, d = values.shape[0], values.shape[-1]
    values.view(kvh, -1, d)[:, slots] = residual[0][token_ids].transpose(0, 1)
    scales.view(kvh, -1)[:, slots] = residual[1][token_ids].transpose(0, 1)
