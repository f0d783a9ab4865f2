"""Host time to build one step's attention metadata (slots, block tables) at serving sizes.

    python benchmarks/step_inputs.py [--batch 256] [--context 4096]

Times build_attention_metadata from block lists, and the model runner's path: persistent
BlockTables rows updated per step and metadata_from_table. CPU tensors only: this is the
host-side cost that precedes every step (and every CUDA-graph replay).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from infer8.attention.metadata import build_attention_metadata, metadata_from_table
from infer8.worker.block_tables import BlockTables


def _ms(fn: Callable[[], object], iters: int = 20) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    b, ctx, bs, cpu = args.batch, args.context, args.block_size, torch.device("cpu")
    per_seq = -(-(ctx + 1) // bs)
    blocks = [list(range(i * per_seq + 1, (i + 1) * per_seq + 1)) for i in range(b)]
    tables, req_ids = BlockTables(), [f"r{i}" for i in range(b)]
    ones, computed = np.ones(b, np.int64), np.full(b, ctx, np.int64)

    def persistent() -> object:
        rows = np.fromiter((tables.update(r, bl) for r, bl in zip(req_ids, blocks)), np.int64)
        return metadata_from_table(
            ones, computed, tables.table, rows, tables.num_blocks[rows], bs, cpu
        )

    lists = _ms(lambda: build_attention_metadata([1] * b, [ctx] * b, blocks, bs, cpu))
    prefill = _ms(lambda: build_attention_metadata([ctx, ctx], [0, 0], blocks[:2], bs, cpu))
    print(f"decode {b} x {ctx}: from block lists {lists:.2f} ms, persistent rows "
          f"{_ms(persistent):.2f} ms; prefill 2 x {ctx}: {prefill:.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
