"""Per-request block tables over the block pool: allocate_slots / free (pure Python)."""

from __future__ import annotations

from infer8.core.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    """Return ceil(a / b) for non-negative ints."""
    return -(-a // b)


class KVCacheManager:
    """Owns each request's block table and grows it as the request's tokens are scheduled."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_block_ids: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        """Return the pool size."""
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Return free blocks."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Return the fraction of blocks in use."""
        return self.block_pool.usage

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Return how many new blocks the request needs to hold `num_tokens` tokens."""
        held = len(self.req_to_block_ids.get(request_id, ()))
        return max(0, cdiv(num_tokens, self.block_size) - held)

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's blocks to hold `num_tokens` tokens; None (nothing taken) if short."""
        num_new = self.num_blocks_needed(request_id, num_tokens)
        if num_new > self.block_pool.num_free_blocks:
            return None
        new_block_ids = self.block_pool.allocate(num_new)
        self.req_to_block_ids.setdefault(request_id, []).extend(new_block_ids)
        return new_block_ids

    def get_block_ids(self, request_id: str) -> list[int]:
        """Return the request's block table."""
        return self.req_to_block_ids.get(request_id, [])

    def free(self, request_id: str) -> None:
        """Return all of the request's blocks to the pool."""
        block_ids = self.req_to_block_ids.pop(request_id, [])
        # Free in reverse so the tail blocks, least likely to be shared later, are reused first.
        self.block_pool.free(block_ids[::-1])
