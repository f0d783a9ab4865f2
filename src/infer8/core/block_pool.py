"""The pool of KV-cache blocks: free queue, reference counts and prefix hashes (pure Python)."""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Sequence

from infer8.core.host_tier import BlockContent
from infer8.core.kv_events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)

# BlockHash (bytes): the sha256 digest of (parent block hash, this block's token ids, extra keys).


def hash_block_tokens(
    parent_block_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[object, ...] | None = None,
) -> BlockHash:
    """Return the hash of one full block: it names the block's tokens and everything before.

    sha256, not Python's hash(): a collision would silently hand one request another's K/V,
    and hash() of ints is trivially collided (and salted per process).
    """
    key = (parent_block_hash, tuple(token_ids), extra_keys)
    return hashlib.sha256(pickle.dumps(key, protocol=pickle.HIGHEST_PROTOCOL)).digest()


class BlockPool:
    """Owns which of `num_blocks` KV blocks are free, their holders, and which are cached.

    A block nobody holds sits in the free queue. If it also has a hash (its K/V are a cached
    prefix) it can still be reused by a later request (`touch`) until `allocate` pops it from
    the head of the queue and evicts it: blocks are freed to the tail, so eviction is
    least-recently-used. Cached-but-free blocks count as free: they are reclaimable at once.

    With `enable_kv_cache_events`, every change to the set of cached hashes is recorded as a
    plain event (BlockStored / BlockRemoved / AllBlocksCleared) until `take_events`; replaying
    them in order rebuilds exactly `cached_block_hash_to_block`'s keys.

    With `keep_evicted` (a host tier behind it), the cached blocks that `allocate` evicts are
    kept as (block id, hash, content) until `take_evicted`: their K/V are still intact until
    the step that reuses them runs, so they can be copied out first.
    """

    def __init__(
        self, num_blocks: int, enable_kv_cache_events: bool = False, keep_evicted: bool = False
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.cached_block_hash_to_block: dict[BlockHash, int] = {}
        # Insertion-ordered set: O(1) pop at the head, append at the tail, removal anywhere.
        self._free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list[KVCacheEvent] = []
        self.keep_evicted = keep_evicted
        self.evicted: list[tuple[int, BlockHash, BlockContent | None]] = []
        # With events and a host tier: what each cached block holds, for the host's events.
        self._block_contents: dict[int, BlockContent] = {}

    @property
    def num_free_blocks(self) -> int:
        """Return how many blocks can be allocated now (cached ones nobody holds included)."""
        return len(self._free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        """Return how many blocks are held."""
        return self.num_blocks - len(self._free_block_ids)

    @property
    def num_cached_blocks(self) -> int:
        """Return how many blocks hold a reusable prefix (held or not)."""
        return len(self.cached_block_hash_to_block)

    @property
    def usage(self) -> float:
        """Return the fraction of blocks in use (0..1)."""
        return self.num_used_blocks / self.num_blocks

    def is_free(self, block_id: int) -> bool:
        """Return whether nobody holds the block."""
        return block_id in self._free_block_ids

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """Return the block holding this prefix hash, if any."""
        return self.cached_block_hash_to_block.get(block_hash)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks from the head of the free queue, evicting cached ones."""
        assert num_blocks <= len(self._free_block_ids), "allocating more blocks than are free"
        block_ids = []
        evicted = []
        for _ in range(num_blocks):
            block_id, _ = self._free_block_ids.popitem(last=False)
            assert self.ref_cnts[block_id] == 0
            if self.block_hashes[block_id] is not None:
                content = self._block_contents.get(block_id)
                evicted.append(self._evict(block_id))
                if self.keep_evicted:
                    self.evicted.append((block_id, evicted[-1], content))
            self.ref_cnts[block_id] = 1
            block_ids.append(block_id)
        if self.enable_kv_cache_events and evicted:
            self.kv_event_queue.append(BlockRemoved(block_hashes=evicted))
        return block_ids

    def touch(self, block_ids: Sequence[int]) -> None:
        """Add a holder to each cached block; a block nobody held leaves the free queue."""
        for block_id in block_ids:
            assert self.block_hashes[block_id] is not None, f"block {block_id} is not cached"
            if self.ref_cnts[block_id] == 0:
                del self._free_block_ids[block_id]
            self.ref_cnts[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one holder from each block; blocks nobody holds join the tail of the queue.

        Callers pass a request's blocks last-first, so its tail (the least shared part) is
        evicted before its prefix.
        """
        for block_id in block_ids:
            assert self.ref_cnts[block_id] > 0, f"block {block_id} freed twice"
            self.ref_cnts[block_id] -= 1
            if self.ref_cnts[block_id] == 0:
                self._free_block_ids[block_id] = None

    def cache_full_blocks(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[BlockHash],
        parent_block_hash: BlockHash | None = None,
        block_token_ids: Sequence[Sequence[int]] | None = None,
        block_extra_keys: Sequence[tuple[object, ...] | None] | None = None,
        lora: tuple[int, str] | None = None,
    ) -> None:
        """Register full blocks under their prefix hashes so later requests can reuse them.

        A block already cached (a reused prefix) keeps its hash. A block whose hash another
        block already holds (the same prefix computed twice) stays private: one copy is enough.
        The blocks are consecutive in one hash chain after `parent_block_hash`; with events on,
        `block_token_ids` (and `block_extra_keys`) say what each block holds, `lora` the
        (id, name) of the LoRA adapter that computed them.
        """
        newly_cached = []
        for i, (block_id, block_hash) in enumerate(zip(block_ids, block_hashes, strict=True)):
            assert self.ref_cnts[block_id] > 0, "only held blocks are cached"
            current = self.block_hashes[block_id]
            if current is not None:
                assert current == block_hash, f"block {block_id} cached under another prefix"
                continue
            if block_hash in self.cached_block_hash_to_block:
                continue
            self.block_hashes[block_id] = block_hash
            self.cached_block_hash_to_block[block_hash] = block_id
            newly_cached.append(i)
        if self.enable_kv_cache_events and newly_cached:
            assert block_token_ids is not None, "events need the blocks' tokens"
            if self.keep_evicted:
                for i in newly_cached:
                    self._block_contents[block_ids[i]] = BlockContent(
                        block_hashes[i - 1] if i else parent_block_hash,
                        list(block_token_ids[i]),
                        block_extra_keys[i] if block_extra_keys else None,
                        lora,
                    )
            self._record_stored(
                newly_cached, block_hashes, parent_block_hash, block_token_ids, block_extra_keys,
                lora,
            )  # fmt: skip

    def _record_stored(
        self,
        indices: list[int],
        block_hashes: Sequence[BlockHash],
        parent_block_hash: BlockHash | None,
        block_token_ids: Sequence[Sequence[int]],
        block_extra_keys: Sequence[tuple[object, ...] | None] | None,
        lora: tuple[int, str] | None = None,
    ) -> None:
        """Record one BlockStored per run of consecutive newly cached blocks."""
        runs: list[list[int]] = []
        for i in indices:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first = run[0]
            self.kv_event_queue.append(
                BlockStored(
                    block_hashes=[block_hashes[i] for i in run],
                    parent_block_hash=block_hashes[first - 1] if first else parent_block_hash,
                    token_ids=[t for i in run for t in block_token_ids[i]],
                    block_size=len(block_token_ids[first]),
                    extra_keys=[block_extra_keys[i] if block_extra_keys else None for i in run],
                    lora_id=None if lora is None else lora[0],
                    lora_name=None if lora is None else lora[1],
                )
            )

    def reset_prefix_cache(self) -> int:
        """Forget the prefixes of every block nobody holds; return how many were dropped.

        Blocks held by running requests keep their hashes: their K/V are still being read.
        """
        dropped = [b for b in self._free_block_ids if self.block_hashes[b] is not None]
        removed = [self._evict(block_id) for block_id in dropped]
        if self.enable_kv_cache_events and removed:
            if self.cached_block_hash_to_block:
                self.kv_event_queue.append(BlockRemoved(block_hashes=removed))
            else:
                self.kv_event_queue.append(AllBlocksCleared())
        return len(dropped)

    def record_event(self, event: KVCacheEvent) -> None:
        """Append another tier's event to the queue, in order with this pool's own."""
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(event)

    def take_evicted(self) -> list[tuple[int, BlockHash, BlockContent | None]]:
        """Return the cached blocks evicted since the last call (id, hash, content), in order."""
        evicted, self.evicted = self.evicted, []
        return evicted

    def take_events(self) -> list[KVCacheEvent]:
        """Return the events recorded since the last call, oldest first, and forget them."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def _evict(self, block_id: int) -> BlockHash:
        """Drop a cached block's prefix hash; return it."""
        block_hash = self.block_hashes[block_id]
        assert block_hash is not None, f"block {block_id} is not cached"
        del self.cached_block_hash_to_block[block_hash]
        self.block_hashes[block_id] = None
        self._block_contents.pop(block_id, None)
        return block_hash
