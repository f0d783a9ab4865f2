"""The runner's persistent block tables give the same step metadata as the lists they mirror."""

from __future__ import annotations

import random

import numpy as np
import torch

from infer8.attention.metadata import (
    AttentionMetadata,
    build_attention_metadata,
    metadata_from_table,
)
from infer8.worker.block_tables import BlockTables

BLOCK_SIZE = 4
CPU = torch.device("cpu")


def _slots_by_token(query_lens, computed, block_ids):  # type: ignore[no-untyped-def]
    """The per-token definition: slot = block of the position * block size + offset."""
    return [
        blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        for q, c, blocks in zip(query_lens, computed, block_ids)
        for pos in range(c, c + q)
    ]


def _assert_same(a: AttentionMetadata, b: AttentionMetadata) -> None:
    for name in ("num_real_tokens", "query_start_loc", "seq_lens", "decode_seq_ids",
                 "prefill_seq_ids"):  # fmt: skip
        assert getattr(a, name) == getattr(b, name), name
    for name in ("slot_mapping", "block_tables", "decode_token_ids", "decode_block_tables",
                 "decode_seq_lens"):  # fmt: skip
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_rows_follow_growing_lists_and_reused_rows_start_clean() -> None:
    rng = random.Random(0)
    tables = BlockTables(num_rows=2, width=2)  # both dimensions must grow
    running: dict[str, tuple[int, list[int]]] = {}  # req_id -> (tokens computed, blocks)
    sent: dict[str, int] = {}  # req_id -> blocks sent
    next_block, next_id = 1, 0
    for _step in range(60):
        while len(running) < 5 and rng.random() < 0.7:  # admissions
            running[f"r{next_id}"] = (0, [])
            next_id += 1
        scheduled = []
        for req_id, (computed, blocks) in running.items():
            q = rng.choice([1, 1, 1, rng.randint(2, 13)])
            while len(blocks) * BLOCK_SIZE < computed + q:
                blocks.append(next_block)
                next_block += 1
            scheduled.append((req_id, q, computed, list(blocks)))
        if not scheduled:
            continue
        query_lens = [q for _, q, _, _ in scheduled]
        computed = [c for _, _, c, _ in scheduled]
        block_ids = [b for _, _, _, b in scheduled]
        rows = np.array(
            [tables.append(r, b[sent.get(r, 0) :]) for r, _, _, b in scheduled], dtype=np.int64
        )  # only the blocks the runner has not seen, as the scheduler sends them
        sent.update({r: len(b) for r, _, _, b in scheduled})
        got = metadata_from_table(
            np.array(query_lens), np.array(computed), tables.table, rows,
            tables.num_blocks[rows], BLOCK_SIZE, CPU,
        )  # fmt: skip
        want = build_attention_metadata(query_lens, computed, block_ids, BLOCK_SIZE, CPU)
        _assert_same(got, want)
        assert got.slot_mapping.tolist() == _slots_by_token(query_lens, computed, block_ids)
        for req_id, q, c, blocks in scheduled:
            running[req_id] = (c + q, blocks)
        for req_id in list(running):  # departures free their rows for reuse
            if rng.random() < 0.15:
                del running[req_id]
                sent.pop(req_id, None)
                tables.remove(req_id)
    assert tables.table.shape[0] > 2 and tables.table.shape[1] > 2
    # every free row is zero: a request that takes it pads with zeros, as the kernels expect
    free = [r for r in range(tables.table.shape[0]) if r not in tables.rows.values()]
    assert free and not tables.table[free].any()


def test_a_resumed_request_is_written_afresh() -> None:
    tables = BlockTables()
    row = tables.append("a", [5, 6, 7])
    assert tables.append("a", []) == row and tables.append("a", [8]) == row
    assert tables.table[row, :5].tolist() == [5, 6, 7, 8, 0]
    tables.remove("a")  # preempted: its blocks went back to the pool
    assert tables.append("a", [9]) == row
    assert tables.table[row, :4].tolist() == [9, 0, 0, 0] and tables.num_blocks[row] == 1
