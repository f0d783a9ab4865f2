"""The host-memory KV tier's bookkeeping: which prefix hashes live in which host slot (pure Python).

With `--kv-offloading-size`, a cached block that the device pool evicts to reuse is copied to a
slot of a host-memory pool first, and a later prefix lookup that misses on the device continues
its hash chain here: each consecutive hit gets a fresh device block and the block's K/V are
copied back instead of recomputed. This module only decides; the copies are plain lists of ints
in the SchedulerOutput (`host_save_*`, `host_load_*`) that the worker performs at the start of
the step, saves before loads, both before the step writes any block (infer8/worker/kv_offload.py).

Within one step a slot is read or written at most once: slots saved or loaded this step are
pinned until the step's transfers are taken, so a later save cannot overwrite a slot a load
still has to read, and no slot receives two saves.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from infer8.core.kv_events import MEDIUM_HOST, BlockHash, BlockRemoved, BlockStored, KVCacheEvent


@dataclass(frozen=True)
class BlockContent:
    """What an evicted block held, for its BlockStored event: parent, tokens, extra keys, and
    the LoRA adapter (id, name) that computed it."""

    parent_block_hash: BlockHash | None
    token_ids: list[int]
    extra_keys: tuple[object, ...] | None
    lora: tuple[int, str] | None = None


@dataclass
class HostTransfers:
    """One step's copies between the device pool and the host pool (block ids and slots)."""

    save_block_ids: list[int]
    save_slots: list[int]
    load_slots: list[int]
    load_block_ids: list[int]


class HostKVTier:
    """Owns the host pool's slots: an LRU of prefix hash -> slot, and this step's copies.

    `record_event` (the block pool's event queue, with events on) receives BlockStored and
    BlockRemoved events with medium "CPU", in order with the device pool's own.
    """

    def __init__(
        self,
        num_slots: int,
        record_event: Callable[[KVCacheEvent], None] | None = None,
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"the host KV tier needs at least one block, got {num_slots}")
        self.num_slots = num_slots
        self.hash_to_slot: OrderedDict[BlockHash, int] = OrderedDict()  # least recent first
        self._slot_to_hash: dict[int, BlockHash] = {}
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()
        self._cleared_pinned: list[int] = []  # dropped by clear() while pinned: free next step
        self._record_event = record_event
        self._transfers = HostTransfers([], [], [], [])
        self.num_saved_blocks = 0  # cumulative, for stats and tests
        self.num_loaded_blocks = 0

    @property
    def num_cached_blocks(self) -> int:
        """Return how many prefix blocks the host pool holds."""
        return len(self.hash_to_slot)

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Return the slots of the longest run of `block_hashes` held here, from the first."""
        slots = []
        for block_hash in block_hashes:
            slot = self.hash_to_slot.get(block_hash)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def save(self, block_id: int, block_hash: BlockHash, content: BlockContent | None) -> None:
        """Keep an evicted device block: copy it to a slot this step (unless already here).

        When every slot is taken, the least recently used one that this step does not touch
        is dropped; when all of them are touched this step, the block is not kept.
        """
        if block_hash in self.hash_to_slot:
            self.hash_to_slot.move_to_end(block_hash)
            return
        # saves run before loads: a block loaded this step must not be saved in it too
        assert block_id not in self._transfers.load_block_ids, "a block saved after its load"
        slot = self._take_slot()
        if slot is None:
            return
        self.hash_to_slot[block_hash] = slot
        self._slot_to_hash[slot] = block_hash
        self._pinned.add(slot)
        self._transfers.save_block_ids.append(block_id)
        self._transfers.save_slots.append(slot)
        self.num_saved_blocks += 1
        if self._record_event is not None:
            assert content is not None, "events need the block's content"
            self._record_event(
                BlockStored(
                    block_hashes=[block_hash],
                    parent_block_hash=content.parent_block_hash,
                    token_ids=list(content.token_ids),
                    block_size=len(content.token_ids),
                    extra_keys=[content.extra_keys],
                    medium=MEDIUM_HOST,
                    lora_id=None if content.lora is None else content.lora[0],
                    lora_name=None if content.lora is None else content.lora[1],
                )
            )

    def pin(self, slots: Sequence[int]) -> None:
        """Keep slots about to be loaded this step from being reused by this step's saves."""
        self._pinned.update(slots)

    def load(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy host slots into fresh device blocks this step; the slots stay (most recent)."""
        for slot, block_id in zip(slots, block_ids, strict=True):
            assert slot in self._pinned, "a slot is pinned before its load is planned"
            self.hash_to_slot.move_to_end(self._slot_to_hash[slot])
            self._transfers.load_slots.append(slot)
            self._transfers.load_block_ids.append(block_id)
        self.num_loaded_blocks += len(slots)

    def take_transfers(self) -> HostTransfers:
        """Return this step's copies and unpin every slot."""
        transfers, self._transfers = self._transfers, HostTransfers([], [], [], [])
        self._pinned.clear()
        self._free_slots.extend(self._cleared_pinned)
        self._cleared_pinned = []
        return transfers

    def clear(self) -> int:
        """Drop every block the host pool holds (a prefix-cache reset); return how many."""
        dropped = list(self.hash_to_slot)
        self.hash_to_slot.clear()
        self._slot_to_hash.clear()
        # A copy planned this step still uses its slot: that slot is free from the next step.
        self._free_slots = [s for s in range(self.num_slots - 1, -1, -1) if s not in self._pinned]
        self._cleared_pinned = sorted(self._pinned)
        if self._record_event is not None and dropped:
            self._record_event(BlockRemoved(block_hashes=dropped, medium=MEDIUM_HOST))
        return len(dropped)

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for block_hash, slot in self.hash_to_slot.items():
            if slot not in self._pinned:
                del self.hash_to_slot[block_hash]
                del self._slot_to_hash[slot]
                if self._record_event is not None:
                    self._record_event(BlockRemoved(block_hashes=[block_hash], medium=MEDIUM_HOST))
                return slot
        return None
