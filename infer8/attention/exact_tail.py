"""The exact tail of an FP8 KV cache: each sequence's latest tokens read in the compute dtype.

One rule for prefill, chunked prefill and decode: a query at position `a` reads the keys and
values of positions (a - W, a] exactly and everything older from the FP8 blocks. So a request's
numbers do not depend on how the scheduler chunks it or whether it was preempted and recomputed.
Storage:

- the FP8 blocks hold every token, quantized on write exactly as without a tail (dynamic
  per-token scales make "quantize when it leaves the window" the same values), so a
  prefix-cached block is always the quantized one and hits stay bit-identical;
- per layer, a ring of W - 1 exact tokens per row (`k_tail`, `v_tail` on LayerKVCache) holds
  the positions just before a step's own tokens; a row is a seat: the model runner gives one
  to each running request (TailRows), so the ring costs max_num_seqs x (W - 1) tokens;
- a step's own tokens come straight from the K/V projection; the ring is updated after
  attention (a long chunk would otherwise overwrite the positions it still has to read).

A request's row holds exact values only from the first position it computed since it was given
the row (`exact_start`): after a prefix-cache hit at `h`, queries in [h, h + W - 1) read the
cached positions before `h` quantized (a hit is never recomputed to refill the ring).

Hadamard rotation (`kv_cache_hadamard`): K and q are multiplied by the same orthonormal
(Sylvester) Hadamard matrix per head before K is stored, so q.k is unchanged in exact arithmetic
while an outlier channel of K is spread over all of the head's channels before it meets FP8's
per-token scale; V is rotated alike and the attention output rotated back (H is its own
inverse). The rotation runs inside the backend's write and attend calls, not as a model pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from infer8.worker.kv_cache import KVCacheSpec

# Measured on the default model (docs/accuracy.md, "Exact tail"): the window (the largest that
# keeps bench capacity's FP8/bf16 ratio >= 1.9x at 1,024 tokens) and the rotation, used when the
# flags are left on auto for an FP8 cache on the reference (CPU) backend.
DEFAULT_EXACT_TAIL_TOKENS = 16
DEFAULT_HADAMARD = True


def resolve_exact_tail(
    tail_tokens: int | None,
    hadamard: bool | None,
    is_fp8: bool,
    is_reference_backend: bool,
    has_static_scales: bool,
    head_dim: int,
) -> tuple[int, bool]:
    """Return (exact tail tokens, rotate keys) for a cache; None means auto.

    Auto turns both on only for an FP8 cache on the reference backend (the Triton kernels do
    not read a tail yet) with dynamic scales (static scales are calibrated on unrotated K).
    """
    if not is_fp8:
        return 0, False
    pow2 = head_dim & (head_dim - 1) == 0
    if hadamard and has_static_scales:
        raise ValueError("kv_cache_hadamard needs dynamic scales (--kv-scale dynamic)")
    if hadamard and not pow2:
        raise ValueError(f"kv_cache_hadamard needs a power-of-two head_dim, got {head_dim}")
    if tail_tokens is None:
        tail_tokens = DEFAULT_EXACT_TAIL_TOKENS if is_reference_backend else 0
    if hadamard is None:
        hadamard = DEFAULT_HADAMARD and is_reference_backend and pow2
        hadamard = hadamard and not has_static_scales
    return tail_tokens, hadamard


def describe_exact_tail(spec: KVCacheSpec, num_rows: int) -> str:
    """Return the start-up line's suffix: the tail's window, seats and memory; rotation."""
    parts = []
    if spec.exact_tail_tokens:
        mib = spec.tail_bytes(num_rows) / (1 << 20)
        dtype = str(spec.tail_dtype).removeprefix("torch.")
        parts.append(
            f"exact tail {spec.exact_tail_tokens} tokens ({num_rows} seats x "
            f"{spec.tail_ring_tokens} {dtype} tokens = {mib:.1f} MiB, counted)"
        )
    if spec.hadamard:
        parts.append("Hadamard-rotated keys")
    return "; " + ", ".join(parts) if parts else ""


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


class TailRows:
    """Gives each running request a ring row and remembers where its exact values start."""

    def __init__(self, num_rows: int) -> None:
        self._free = list(range(num_rows - 1, -1, -1))
        self._req_to_row: dict[str, tuple[int, int]] = {}

    def release(self, req_ids: list[str]) -> None:
        """Return the rows of finished or preempted requests."""
        for req_id in req_ids:
            entry = self._req_to_row.pop(req_id, None)
            if entry is not None:
                self._free.append(entry[0])

    def release_all(self) -> None:
        """Return every row (the engine was reset)."""
        self.release(list(self._req_to_row))

    def row_for(self, req_id: str, num_computed_tokens: int) -> tuple[int, int]:
        """Return (row, exact_start), giving the request a row first if it has none."""
        entry = self._req_to_row.get(req_id)
        if entry is None:
            assert self._free, "more running requests than exact-tail rows (max_num_seqs)"
            entry = self._req_to_row[req_id] = (self._free.pop(), num_computed_tokens)
        return entry


@dataclass
class TailMetadata:
    """Where this step's sequences read and write their exact tail."""

    window: int  # W: a query at position a reads (a - W, a] exactly
    ring_size: int  # W - 1 tokens per row
    exact_starts: list[int]  # per sequence: first position its row holds exactly
    ring_read_slots: list[torch.Tensor]  # per sequence: ring slots of [lo, first new position)
    write_token_ids: torch.Tensor  # [n] int64: flat-batch tokens that enter the ring
    write_slots: torch.Tensor  # [n] int64: their ring slots (row * ring_size + pos % ring_size)
    # decode overlay of old positions: (row in the decode batch, position, ring slot)
    decode_overlay: tuple[torch.Tensor, torch.Tensor, torch.Tensor]

    def ring_lo(self, seq_idx: int, first_new_pos: int) -> int:
        """Return the first position a sequence reads exactly from the ring."""
        return max(self.exact_starts[seq_idx], first_new_pos - self.ring_size)


def build_tail_metadata(
    window: int,
    rows: list[int],
    exact_starts: list[int],
    query_lens: list[int],
    num_computed_tokens: list[int],
    decode_seq_ids: list[int],
    device: torch.device,
) -> TailMetadata:
    """Build the tail's per-step indices from each sequence's row and progress."""
    assert window >= 1
    ring = window - 1
    meta = TailMetadata(window, ring, exact_starts, [], *_empty(2, device), _empty(3, device))
    write_tokens: list[int] = []
    write_slots: list[int] = []
    token_start = 0
    for row, start, q_len, s0 in zip(rows, exact_starts, query_lens, num_computed_tokens):
        lo = max(start, s0 - ring)
        meta.ring_read_slots.append(
            torch.tensor([row * ring + p % ring for p in range(lo, s0)], dtype=torch.int64).to(
                device
            )
        )
        if ring:
            for p in range(max(s0, s0 + q_len - ring), s0 + q_len):
                write_tokens.append(token_start + p - s0)
                write_slots.append(row * ring + p % ring)
        token_start += q_len
    meta.write_token_ids = torch.tensor(write_tokens, dtype=torch.int64, device=device)
    meta.write_slots = torch.tensor(write_slots, dtype=torch.int64, device=device)
    b_idx: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    for b, i in enumerate(decode_seq_ids):
        s0 = num_computed_tokens[i]
        for p in range(meta.ring_lo(i, s0), s0):
            b_idx.append(b)
            pos.append(p)
            slots.append(rows[i] * ring + p % ring)
    meta.decode_overlay = tuple(  # type: ignore[assignment]
        torch.tensor(x, dtype=torch.int64, device=device) for x in (b_idx, pos, slots)
    )
    return meta


def _empty(n: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty(0, dtype=torch.int64, device=device) for _ in range(n))


def write_ring(
    k_ring: torch.Tensor, v_ring: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tail: TailMetadata
) -> None:
    """Store the step's last W - 1 tokens per sequence in the rings (after attention).

    k_ring, v_ring: [num_kv_heads, num_rows, W - 1, head_dim]; k, v: [tokens, kvh, head_dim].
    """
    if tail.write_slots.numel() == 0:
        return
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    for ring, x in ((k_ring, k), (v_ring, v)):
        flat = ring.view(num_kv_heads, -1, head_dim)
        flat[:, tail.write_slots] = x[tail.write_token_ids].transpose(0, 1).to(ring.dtype)


def overlay_decode(
    k: torch.Tensor,
    v: torch.Tensor,
    k_ring: torch.Tensor,
    v_ring: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    seq_lens: torch.Tensor,
    tail: TailMetadata,
) -> None:
    """Replace the dequantized tail of each decode sequence with its exact values, in place.

    k, v: [kvh, B, L, head_dim] gathered blocks; k_new, v_new: [B, kvh, head_dim], the new
    token of each decode sequence (at position seq_lens - 1).
    """
    b_idx, pos, slots = tail.decode_overlay
    rows = torch.arange(k.shape[1], device=k.device)
    for x, ring, new in ((k, k_ring, k_new), (v, v_ring, v_new)):
        if slots.numel():
            x[:, b_idx, pos] = ring.view(ring.shape[0], -1, ring.shape[-1])[:, slots]
        x[:, rows, seq_lens - 1] = new.transpose(0, 1).to(x.dtype)


def prefill_kv_and_mask(
    k: torch.Tensor,
    v: torch.Tensor,
    k_ring: torch.Tensor,
    v_ring: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    ring_slots: torch.Tensor,
    exact_start: int,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Return one sequence's keys, values and mask for SDPA over its quantized + exact K/V.

    k, v: [kvh, seq_len, d] dequantized; k_new, v_new: [q_len, kvh, d], this step's tokens
    (positions seq_len - q_len ...). Keys are the quantized positions some query still reads
    quantized, then the exact positions [lo, seq_len); a None mask means plain causal.
    """
    seq_len, q_len = k.shape[1], k_new.shape[0]
    s0 = seq_len - q_len
    lo = s0 - ring_slots.numel()
    # quantized position j is read by query a iff j <= a - W or j < exact_start
    num_quant = min(seq_len, max(seq_len - window, exact_start, 0))
    exact_k, exact_v = (
        torch.cat(
            [
                ring.view(ring.shape[0], -1, ring.shape[-1])[:, ring_slots],
                new.transpose(0, 1).to(ring.dtype),
            ],
            dim=1,
        ).to(k.dtype)
        for ring, new in ((k_ring, k_new), (v_ring, v_new))
    )
    if num_quant == 0 and lo == 0 and q_len == seq_len:
        return exact_k, exact_v, None  # everything is exact: plain causal attention
    a = torch.arange(s0, seq_len, device=k.device)[:, None]  # query positions
    jq = torch.arange(num_quant, device=k.device)[None, :]
    je = torch.arange(lo, seq_len, device=k.device)[None, :]
    quant_ok = (jq <= a) & ((jq <= a - window) | (jq < exact_start))
    exact_ok = (je <= a) & (je > a - window)
    keys = torch.cat([k[:, :num_quant], exact_k], dim=1)
    values = torch.cat([v[:, :num_quant], exact_v], dim=1)
    return keys, values, torch.cat([quant_ok, exact_ok], dim=1)
