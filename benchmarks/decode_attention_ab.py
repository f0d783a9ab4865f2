"""Decode step time with the per-KV-head attention loop (before) and the batched one (now).

    python benchmarks/decode_attention_ab.py [--rounds 4] [--steps 8]

One process, one engine (default model, 32 requests of 128 prompt tokens in decode): the two
`TorchRefAttention._decode` versions alternate, `--steps` engine steps each per round, so both
see the same machine. Prints each round and the median step time of each, and their ratio.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from infer8 import LLM, SamplingParams
from infer8.attention import torch_ref
from infer8.attention.kv_cache import LayerKVCache
from infer8.attention.metadata import AttentionMetadata


def decode_per_kv_head(
    self: torch_ref.TorchRefAttention,
    q: torch.Tensor,
    cache: LayerKVCache,
    meta: AttentionMetadata,
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The decode attention before the change: one bmm pair per KV head (no exact tail)."""
    assert new_kv is None, "run with a 16/32-bit cache"
    table = meta.decode_block_tables
    k = self._read(cache.k, cache.k_scale, cache.k_static_scale, table, q.dtype, "k")
    v = self._read(cache.v, cache.v_scale, cache.v_static_scale, table, q.dtype, "v")
    b, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    group = num_heads // num_kv_heads
    qg = q.view(b, num_kv_heads, group, head_dim)
    pad = torch.arange(k.shape[2], device=q.device) >= meta.decode_seq_lens[:, None]
    pad = pad.view(b, 1, -1)
    out = torch.empty((b, num_kv_heads, group, head_dim), dtype=q.dtype, device=q.device)
    for h in range(num_kv_heads):
        scores = torch.bmm(qg[:, h], k[h].transpose(1, 2)).float() * scale
        scores.masked_fill_(pad, -float("inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out[:, h] = torch.bmm(probs, v[h])
    return out.view(b, num_heads, head_dim)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    engine = LLM(kv_cache_memory_bytes=1 << 30, max_num_seqs=32).engine
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    for _ in range(32):
        engine.add_request([rng.randrange(1000, 20000) for _ in range(128)], params)
    while any(r.num_tokens == r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()  # prefill
    versions = {"per KV head": decode_per_kv_head, "batched": torch_ref.TorchRefAttention._decode}
    times_ms: dict[str, list[float]] = {name: [] for name in versions}
    for _ in range(args.rounds):
        for name, fn in versions.items():
            torch_ref.TorchRefAttention._decode = fn  # type: ignore[method-assign]
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            times_ms[name].append(1e3 * (time.perf_counter() - start) / args.steps)
    for name, values in times_ms.items():
        print(
            f"{name}: {[round(v, 1) for v in values]} ms/step, median {statistics.median(values):.1f}"
        )
    before, after = (statistics.median(v) for v in times_ms.values())
    print(f"batched / per KV head step time: {after / before:.3f} ({before / after:.2f}x faster)")


if __name__ == "__main__":
    main()
