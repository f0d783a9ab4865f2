"""Count the Triton compilations a serving run makes after its start-up, no GPU needed.

Run as a script (tests/gpu/test_triton_compile.py does, in a fresh process without
TRITON_INTERPRET), with compile_kernels.py's stand-in driver: every launch compiles its
specialization (or finds it compiled) and runs nothing. First what start-up runs
(worker/memory_profile.warm_up_runtime's prefill and decode, then a decode step in each CUDA
graph bucket's static shape), then the steps serving produces: decode batches of 1 to
max_num_seqs sequences and mixed steps (a prefill chunk beside decodes) at contexts from 1
token to max_model_len. A kernel compiled after start-up is a multi-second stall of the engine
thread on a GPU. Prints one JSON line: compilations at start-up, and each one after it (the
kernel and the step that caused it).

    python tests/gpu/count_compiles.py [--arch 90] [--cache fp8|bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import torch
from compile_kernels import _install_compile_only_driver

BLOCK_SIZE, KVH, GROUP, HEAD_DIM = 16, 2, 4, 128
MAX_NUM_SEQS, MAX_MODEL_LEN, MAX_BATCHED = 512, 32768, 8192


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--cache", choices=["fp8", "bf16"], default="fp8",
                        help="fp8: the engine's default (E4M3, exact tail, rotated keys)")  # fmt: skip
    args = parser.parse_args()
    assert "TRITON_INTERPRET" not in os.environ, "run without TRITON_INTERPRET"
    compiled = _install_compile_only_driver(args.arch)

    from infer8.attention.exact_tail import build_tail_metadata
    from infer8.attention.kv_cache import KVCacheSpec, allocate_kv_cache
    from infer8.attention.metadata import build_attention_metadata
    from infer8.attention.tail_defaults import DEFAULT_EXACT_SINK_TOKENS, DEFAULT_EXACT_TAIL_TOKENS
    from infer8.attention.triton.backend import TritonAttention
    from infer8.worker.cuda_graphs import batch_buckets

    dev = torch.device("cpu")
    fp8 = args.cache == "fp8"
    window = DEFAULT_EXACT_TAIL_TOKENS if fp8 else 0
    sinks = DEFAULT_EXACT_SINK_TOKENS if fp8 else 0
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    spec = KVCacheSpec(1, KVH, HEAD_DIM, BLOCK_SIZE, dtype, window, sinks, fp8)
    max_blocks = -(-MAX_MODEL_LEN // BLOCK_SIZE)
    # a small cache: the kernels only compile, so block ids need not be distinct
    cache = allocate_kv_cache(spec, 64, dev, MAX_NUM_SEQS if window else 0)[0]
    backend = TritonAttention(dev, num_splits=32)  # an H100's split count for 8 KV heads
    rng = random.Random(0)

    def step(q_lens: list[int], contexts: list[int], width: int | None = None) -> None:
        """Run one layer's attention for sequences of q_lens new tokens after contexts."""
        tables = [[rng.randrange(64) for _ in range(-(-(c + n) // BLOCK_SIZE))]
                  for n, c in zip(q_lens, contexts)]  # fmt: skip
        meta = build_attention_metadata(q_lens, contexts, tables, BLOCK_SIZE, dev)
        if width is not None:  # a graph bucket's tables: max_model_len wide
            padded = torch.zeros((len(q_lens), width), dtype=meta.decode_block_tables.dtype)
            padded[:, : meta.decode_block_tables.shape[1]] = meta.decode_block_tables
            meta.decode_block_tables = padded
        if window:
            n = len(q_lens)
            meta.tail = build_tail_metadata(
                window, sinks, list(range(n)), [0] * n, [(i, True) for i in range(n)], q_lens,
                contexts, meta.decode_seq_ids, meta.decode_block_tables.shape[1] * BLOCK_SIZE,
                dev,
            )  # fmt: skip
        tokens = meta.num_real_tokens
        q = torch.zeros(tokens, KVH * GROUP, HEAD_DIM, dtype=torch.bfloat16)
        k = torch.zeros(tokens, KVH, HEAD_DIM, dtype=torch.bfloat16)
        backend.write_and_attend(q, k, k, cache, backend.build_metadata(meta), HEAD_DIM**-0.5)

    # start-up: warm_up_runtime's prefill (a long prompt and three short) and decode, then the
    # graph buckets' decode steps (tables max_model_len wide)
    long_len = MAX_BATCHED - 3
    step([long_len, 1, 1, 1], [0, 0, 0, 0])
    step([1, 1, 1, 1], [long_len, 1, 1, 1])
    for size in batch_buckets(MAX_NUM_SEQS):
        step([1] * size, [rng.randrange(1, MAX_MODEL_LEN) for _ in range(size)], max_blocks)
    at_start = [name for name, _, _, new in compiled if new]
    compiled.clear()

    # serving: decode batches and mixed steps over contexts from 1 to max_model_len
    after = []
    contexts = [1, 2, 15, 16, 17, 31, 100, 255, 256, 1000, 4095, 4096, 10_000, MAX_MODEL_LEN - 1]
    for batch in (1, 2, 3, 7, 8, 9, 33, 100, 257, MAX_NUM_SEQS):
        for ctx in contexts:
            for kind in ("decode", "mixed"):
                lens = [rng.choice(contexts) for _ in range(batch - 1)] + [ctx]
                if kind == "decode":
                    step([1] * batch, lens)
                else:  # a chunk of the longest sequence beside the others' decodes
                    chunk = min(MAX_BATCHED - batch, max(1, ctx // 2))
                    step([chunk] + [1] * (batch - 1), [max(0, ctx - chunk)] + lens[:-1])
                step_name = f"{kind} batch {batch} context {ctx}"
                after += [{"kernel": name, "step": step_name}
                          for name, _, _, new in compiled if new]  # fmt: skip
                compiled.clear()
    print(json.dumps({"arch": args.arch, "cache": args.cache, "at_start": len(at_start),
                      "kernels_at_start": sorted(set(at_start)), "after_start": after}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
