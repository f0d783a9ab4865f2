"""vLLM's KV event schema as a subscriber declares it (vllm/distributed/kv_events.py), and an index.

Declared here, not imported from infer8, so the tests check infer8's bytes against vLLM's
structs: a positional batch, events tagged by class name.
"""

from __future__ import annotations

from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def apply(index: set[Any], events: list[Any], medium: str = "GPU") -> None:
    """Replay events (records or decoded wire events) of one medium ("GPU": the device cache,
    "CPU": the host tier) into a set of cached hashes; AllBlocksCleared clears every medium."""
    for event in events:
        if getattr(event, "medium", medium) != medium:
            continue
        if type(event).__name__ == "BlockStored":
            index.update(event.block_hashes)
        elif type(event).__name__ == "BlockRemoved":
            index.difference_update(event.block_hashes)
        else:
            index.clear()


def low64(block_hash: bytes) -> int:
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)
