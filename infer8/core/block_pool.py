"""The pool of KV-cache blocks: free queue, reference counts and prefix hashes (pure Python)."""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Sequence

# sha256 digest of (parent block hash, this block's token ids, extra keys).
BlockHash = bytes


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
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.cached_block_hash_to_block: dict[BlockHash, int] = {}
        # Insertion-ordered set: O(1) pop at the head, append at the tail, removal anywhere.
        self._free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

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
        for _ in range(num_blocks):
            block_id, _ = self._free_block_ids.popitem(last=False)
            assert self.ref_cnts[block_id] == 0
            self._evict(block_id)
            self.ref_cnts[block_id] = 1
            block_ids.append(block_id)
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
        self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]
    ) -> None:
        """Register full blocks under their prefix hashes so later requests can reuse them.

        A block already cached (a reused prefix) keeps its hash. A block whose hash another
        block already holds (the same prefix computed twice) stays private: one copy is enough.
        """
        for block_id, block_hash in zip(block_ids, block_hashes, strict=True):
            assert self.ref_cnts[block_id] > 0, "only held blocks are cached"
            current = self.block_hashes[block_id]
            if current is not None:
                assert current == block_hash, f"block {block_id} cached under another prefix"
                continue
            if block_hash in self.cached_block_hash_to_block:
                continue
            self.block_hashes[block_id] = block_hash
            self.cached_block_hash_to_block[block_hash] = block_id

    def reset_prefix_cache(self) -> int:
        """Forget the prefixes of every block nobody holds; return how many were dropped.

        Blocks held by running requests keep their hashes: their K/V are still being read.
        """
        dropped = [b for b in self._free_block_ids if self.block_hashes[b] is not None]
        for block_id in dropped:
            self._evict(block_id)
        return len(dropped)

    def _evict(self, block_id: int) -> None:
        """Drop a block's prefix hash, if it has one."""
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            del self.cached_block_hash_to_block[block_hash]
            self.block_hashes[block_id] = None
