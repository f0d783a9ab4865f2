"""The pool of KV-cache blocks: a free list and reference counts (pure Python)."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Owns which of `num_blocks` KV blocks are free and how many holders each has."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnts = [0] * num_blocks
        self._free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Return how many blocks can be allocated now."""
        return len(self._free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        """Return how many blocks are held."""
        return self.num_blocks - len(self._free_block_ids)

    @property
    def usage(self) -> float:
        """Return the fraction of blocks in use (0..1)."""
        return self.num_used_blocks / self.num_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks; the caller checked there are enough."""
        assert num_blocks <= len(self._free_block_ids), "allocating more blocks than are free"
        block_ids = [self._free_block_ids.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            assert self.ref_cnts[block_id] == 0
            self.ref_cnts[block_id] = 1
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks nobody holds return to the free list."""
        for block_id in block_ids:
            assert self.ref_cnts[block_id] > 0, f"block {block_id} freed twice"
            self.ref_cnts[block_id] -= 1
            if self.ref_cnts[block_id] == 0:
                self._free_block_ids.append(block_id)
