"""A few steps of a small schedule through two attention backends, each on its own cache copy.

Chunked prefill (a chunk longer than the exact tail's ring), decodes, a sink written by a
decode (a prompt shorter than the sinks), a prefix-cache hit that reads another request's sinks
and its own quantized positions before the hit, a fresh prompt in a step of decodes, and a step
of decodes only: every path a backend takes. Both backends get the step as a model layer passes
it (write_and_attend over their own build_metadata, q / k / v views of one fused projection).
The shared backend suite (tests/unit/test_attention_backends.py) and the Triton tests
(tests/gpu/test_triton_tail.py) run it.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from typing import Any

import torch

from infer8.attention.exact_tail import build_tail_metadata
from infer8.attention.kv_cache import KVCacheSpec, LayerKVCache, allocate_kv_cache
from infer8.attention.metadata import build_attention_metadata
from infer8.core.exact_tail_seats import ExactTailSeats, TailSeat

BLOCK_SIZE = 16
WINDOW, SINKS = 6, 4
KVH, GROUP, HEAD_DIM = 2, 2, 32
NUM_STEPS = 6
# request: (first blocks shared with request A, tokens per step; 0 = idle)
SCHEDULE = {
    "A": (0, [20, 20, 1, 1, 1, 1]),
    "D": (0, [3, 1, 1, 1, 1, 1]),  # decodes at positions 3 < SINKS write a sink
    "E": (0, [0, 10, 30, 1, 1, 1]),  # a 30-token chunk overwrites its whole ring
    "B": (2, [0, 0, 12, 1, 1, 1]),  # hits A's first 32 tokens: A's sinks, quantized [26, 32)
    "F": (0, [0, 0, 0, 9, 1, 1]),  # a fresh prompt beside decodes only
}


def tail_spec(dtype: torch.dtype = torch.float8_e4m3fn, hadamard: bool = False) -> KVCacheSpec:
    """Return the schedule's cache: one layer, an exact tail of WINDOW with SINKS sinks."""
    return KVCacheSpec(1, KVH, HEAD_DIM, BLOCK_SIZE, dtype, WINDOW, SINKS, hadamard)


def clone_cache(cache: LayerKVCache, tail: bool = True) -> LayerKVCache:
    """Return a deep copy of a cache (with tail False: the same format without its store)."""

    def c(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.clone()

    store = cache.tail_store
    return dataclasses.replace(
        cache,
        k=cache.k.clone(),
        v=cache.v.clone(),
        k_scale=c(cache.k_scale),
        v_scale=c(cache.v_scale),
        num_saturated=c(cache.num_saturated),
        tail_store=(store[0].clone(), store[1].clone()) if tail and store is not None else None,
    )


def run_schedule(
    ref: Any,
    other: Any,
    dtype: torch.dtype,
    device: torch.device,
    spec: KVCacheSpec | None = None,
    static_scales: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
    other_tail: bool = True,
    seed: int = 0,
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, LayerKVCache, LayerKVCache]]:
    """Yield (step, other's output, ref's output, other's cache, ref's cache) per step.

    spec: the cache (default: tail_spec()); other_tail False: `other` attends without the
    tail's store (a format with a tail but no seat), which shows that the tail changes the
    outputs by far more than the tolerances.
    """
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    spec = spec or tail_spec()
    num_seats = 6 if spec.exact_tail_tokens else 0
    ref_cache = allocate_kv_cache(spec, 24, device, num_seats, static_scales)[0]
    other_cache = clone_cache(ref_cache, tail=other_tail)
    perm = rng.sample(range(1, 24), 23)
    blocks: dict[str, list[int]] = {}
    kv = {}
    for req, (shared, steps) in SCHEDULE.items():
        total = shared * BLOCK_SIZE + sum(steps)
        n = -(-total // BLOCK_SIZE)
        blocks[req] = blocks.get("A", [])[:shared] + perm[: n - shared]
        perm = perm[n - shared :]
        kv[req] = randn(2, total, KVH, HEAD_DIM) * 2
        kv[req][:, :5] *= 6  # large first tokens: sinks matter
        if shared:
            kv[req][:, : shared * BLOCK_SIZE] = kv["A"][:, : shared * BLOCK_SIZE]
    seats = ExactTailSeats(6, WINDOW, SINKS, BLOCK_SIZE)
    progress = {req: shared * BLOCK_SIZE for req, (shared, _) in SCHEDULE.items()}
    for step in range(NUM_STEPS):
        sched = [(r, s[1][step]) for r, s in SCHEDULE.items() if s[1][step]]
        q_lens = [n for _, n in sched]
        computed = [progress[r] for r, _ in sched]
        meta = build_attention_metadata(
            q_lens, computed, [blocks[r] for r, _ in sched], BLOCK_SIZE, device
        )
        if spec.exact_tail_tokens:
            held = [_seat(seats, r, c, blocks[r][0]) for (r, _), c in zip(sched, computed)]
            meta.tail = build_tail_metadata(
                WINDOW, SINKS, [x.row for x in held], [x.exact_start for x in held],
                [(x.sink_slot, x.writes_sinks) for x in held], q_lens, computed,
                meta.decode_seq_ids, meta.decode_block_tables.shape[1] * BLOCK_SIZE, device,
            )  # fmt: skip
        k = torch.cat([kv[r][0, c : c + n] for (r, n), c in zip(sched, computed)])
        v = torch.cat([kv[r][1, c : c + n] for (r, n), c in zip(sched, computed)])
        q = randn(len(k), KVH * GROUP, HEAD_DIM)
        qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
        views = [
            x.view(len(k), -1, HEAD_DIM)
            for x in qkv.split([KVH * GROUP * HEAD_DIM, KVH * HEAD_DIM, KVH * HEAD_DIM], 1)
        ]
        outs = [
            backend.write_and_attend(*views, cache, backend.build_metadata(meta), HEAD_DIM**-0.5)
            for backend, cache in ((ref, ref_cache), (other, other_cache))
        ]
        for (r, n), c in zip(sched, computed):
            progress[r] = c + n
        yield step, outs[1], outs[0], other_cache, ref_cache


def _seat(seats: ExactTailSeats, req: str, computed: int, first_block: int) -> TailSeat:
    """Return a request's seat, seating it on first sight (its sinks keyed by its first block:
    B, which shares A's, reads A's)."""
    return seats.get(req) or seats.seat(req, computed, first_block)
