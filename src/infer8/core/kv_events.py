"""What the prefix cache did, as plain records: blocks stored, blocks removed, all cleared.

The block pool appends these as it caches and evicts blocks; the engine takes them once per
step and hands them to a publisher (infer8/kv_events.py), which encodes vLLM's wire schema.
Nothing here knows about sockets or encodings (pure Python).
"""

from __future__ import annotations

from dataclasses import dataclass

# A block's sha256 chain digest (infer8/core/block_pool.py's BlockHash).
BlockHash = bytes

# Where a block's K/V are held, in vLLM's words: the device KV cache ("GPU", whatever the
# device) or the host-memory tier (infer8/core/host_tier.py).
MEDIUM_DEVICE = "GPU"
MEDIUM_HOST = "CPU"


@dataclass(frozen=True)
class BlockStored:
    """Consecutive blocks of one hash chain became reusable (they follow `parent_block_hash`)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None  # None: the run starts at the chain's first block
    token_ids: list[int]  # len(block_hashes) * block_size tokens, the blocks' in order
    block_size: int
    # Per block, the extra keys its hash covers besides its tokens (a cache_salt), or None.
    extra_keys: list[tuple[object, ...] | None]
    medium: str = MEDIUM_DEVICE
    # the LoRA adapter that computed them (vLLM's lora_id / lora_name), None: the base model
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks are no longer reusable (evicted, or dropped by a prefix-cache reset)."""

    block_hashes: list[BlockHash]
    medium: str = MEDIUM_DEVICE


@dataclass(frozen=True)
class AllBlocksCleared:
    """No block is reusable any more, in any medium (every cached prefix was dropped)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
