"""A few steps of a small schedule through two attention backends, each on its own cache copy.

Chunked prefill (a chunk longer than the exact tail's ring), decodes, a sink written by a
decode (a prompt shorter than the sinks), a prefix-cache hit that reads another request's sinks
and its own quantized positions before the hit, a fresh prompt in a step of decodes: what the
exact tail's kernels must agree on
(tests/gpu/test_triton_tail.py, tests/unit/test_cpu_native.py).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import torch

from infer8.attention.exact_tail import build_tail_metadata
from infer8.attention.kv_cache import KVCacheSpec, LayerKVCache, allocate_kv_cache
from infer8.attention.metadata import build_attention_metadata
from infer8.worker.tail_seats import SinkSlots, TailRows

BLOCK_SIZE = 16
WINDOW, SINKS = 6, 4
KVH, GROUP, HEAD_DIM = 2, 2, 32
# request: (first blocks shared with request A, tokens per step; 0 = idle)
SCHEDULE = {
    "A": (0, [20, 20, 1, 1, 1]),
    "D": (0, [3, 1, 1, 1, 1]),  # decodes at positions 3 < SINKS write a sink
    "E": (0, [0, 10, 30, 1, 1]),  # a 30-token chunk overwrites its whole ring
    "B": (2, [0, 0, 12, 1, 1]),  # hits A's first 32 tokens: A's sinks, quantized [26, 32)
    "F": (0, [0, 0, 0, 9, 1]),  # a fresh prompt beside decodes only (rotated in its own call)
}


def clone_cache(cache: LayerKVCache, tail: bool = True) -> LayerKVCache:
    """Return a deep copy of a cache (the tail store dropped when tail is False)."""

    def c(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.clone()

    kv_tail = None
    if tail and cache.kv_tail is not None:
        kv_tail = (cache.kv_tail[0].clone(), cache.kv_tail[1].clone())
    return LayerKVCache(
        c(cache.k), c(cache.v), c(cache.k_scale), c(cache.v_scale),  # type: ignore[arg-type]
        num_saturated=c(cache.num_saturated), kv_tail=kv_tail,
        k_rotation=cache.k_rotation, rotate_values=cache.rotate_values,
    )  # fmt: skip


def run_schedule(
    ref: Any, other: Any, dtype: torch.dtype, hadamard: bool, device: torch.device,
    other_tail: bool = True, fused: bool = False,
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, LayerKVCache, LayerKVCache]]:  # fmt: skip
    """Yield (step, other's output, ref's output, other's cache, ref's cache) per step.

    other_tail False: `other` attends without the tail (on a throwaway copy of its cache),
    which a test uses to show that the tail changes the outputs by far more than its tolerance.
    fused: `other` gets the step through write_and_attend, q / k / v as views of one fused
    projection's rows, as a model layer passes them.
    """
    rng = random.Random(0)
    spec = KVCacheSpec(1, KVH, HEAD_DIM, BLOCK_SIZE, torch.float8_e4m3fn, WINDOW, SINKS, hadamard)
    ref_cache = allocate_kv_cache(spec, 24, device, num_tail_rows=6)[0]
    other_cache = clone_cache(ref_cache)
    perm = rng.sample(range(1, 24), 23)
    blocks: dict[str, list[int]] = {}
    kv = {}
    for req, (shared, steps) in SCHEDULE.items():
        total = shared * BLOCK_SIZE + sum(steps)
        n = -(-total // BLOCK_SIZE)
        blocks[req] = blocks.get("A", [])[:shared] + perm[: n - shared]
        perm = perm[n - shared :]
        kv[req] = torch.randn(2, total, KVH, HEAD_DIM, dtype=dtype, device=device) * 2
        kv[req][:, :5] *= 6  # large first tokens: sinks matter
        if shared:
            kv[req][:, : shared * BLOCK_SIZE] = kv["A"][:, : shared * BLOCK_SIZE]
    rows, sinks = TailRows(6), SinkSlots(6)
    progress = {req: shared * BLOCK_SIZE for req, (shared, _) in SCHEDULE.items()}
    for step in range(5):
        sched = [(r, s[1][step]) for r, s in SCHEDULE.items() if s[1][step]]
        q_lens = [n for _, n in sched]
        computed = [progress[r] for r, _ in sched]
        meta = build_attention_metadata(
            q_lens, computed, [blocks[r] for r, _ in sched], BLOCK_SIZE, device
        )
        seats = [rows.row_for(r, c) for (r, _), c in zip(sched, computed)]
        slots = [sinks.slot_for(r, blocks[r][0], start) for (r, _), (_, start) in zip(sched, seats)]
        meta.tail = build_tail_metadata(
            WINDOW, SINKS, [row for row, _ in seats], [s for _, s in seats], slots, q_lens,
            computed, meta.decode_seq_ids, meta.decode_block_tables.shape[1] * BLOCK_SIZE, device,
        )  # fmt: skip
        k = torch.cat([kv[r][0, c : c + n] for (r, n), c in zip(sched, computed)])
        v = torch.cat([kv[r][1, c : c + n] for (r, n), c in zip(sched, computed)])
        q = torch.randn(len(k), KVH * GROUP, HEAD_DIM, dtype=dtype, device=device)
        outs = []
        for backend, cache in ((ref, ref_cache), (other, other_cache)):
            if fused and backend is other:
                qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
                qv, kv_, vv = qkv.split([KVH * GROUP * HEAD_DIM, KVH * HEAD_DIM, KVH * HEAD_DIM], 1)
                views = [x.view(len(k), -1, HEAD_DIM) for x in (qv, kv_, vv)]
                outs.append(other.write_and_attend(*views, cache, meta, HEAD_DIM**-0.5))
                continue
            backend.write_kv(cache, k, v, meta.slot_mapping)
            outs.append(backend.forward(q, cache, meta, HEAD_DIM**-0.5, k_new=k, v_new=v))
        if not other_tail:
            outs[1] = other.forward(q, clone_cache(other_cache, tail=False), meta, HEAD_DIM**-0.5)
        for (r, n), c in zip(sched, computed):
            progress[r] = c + n
        yield step, outs[1], outs[0], other_cache, ref_cache
