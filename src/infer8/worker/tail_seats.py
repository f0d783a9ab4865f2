"""Seats of the FP8 cache's exact tail: which store row and sink slot each running request uses.

The model runner's bookkeeping for attention/exact_tail.py: a ring row per running request
(TailRows) and sink slots keyed by first blocks so prefix-cache hits share sinks (SinkSlots).
"""

from __future__ import annotations

from collections import OrderedDict


class TailRows:
    """Gives each running request a ring row and remembers where its exact values start."""

    def __init__(self, num_rows: int) -> None:
        self._free = list(range(num_rows - 1, -1, -1))
        self._req_to_row: dict[str, tuple[int, int]] = {}

    def release(self, req_ids: list[str]) -> None:
        """Return the rows of finished or preempted requests."""
        for req_id in req_ids:
            entry = self._req_to_row.pop(req_id, None)
            if entry is not None:
                self._free.append(entry[0])

    def release_all(self) -> None:
        """Return every row (the engine was reset)."""
        self.release(list(self._req_to_row))

    def row_for(self, req_id: str, num_computed_tokens: int) -> tuple[int, int]:
        """Return (row, exact_start), giving the request a row first if it has none."""
        entry = self._req_to_row.get(req_id)
        if entry is None:
            assert self._free, "more running requests than exact-tail rows (max_num_seqs)"
            entry = self._req_to_row[req_id] = (self._free.pop(), num_computed_tokens)
        return entry


class SinkSlots:
    """Sink slots keyed by a request's first block, so prefix-cache hits share them.

    A request that computes its first block takes a slot (that block's old one, a free one, or
    the least recently used one no running request reads) and writes its sinks there; a request
    that hits the block reads the slot it finds, or none (its sinks are read quantized). As
    many slots as rows: each running request pins at most one, so a new one always finds one.
    """

    def __init__(self, num_slots: int) -> None:
        self._free = list(range(num_slots - 1, -1, -1))
        self._by_block: OrderedDict[int, int] = OrderedDict()  # first block -> slot, LRU first
        self._pins: dict[int, int] = {}
        self._req: dict[str, tuple[int, bool]] = {}

    def slot_for(self, req_id: str, first_block: int, exact_start: int) -> tuple[int, bool]:
        """Return (slot or -1, whether this request writes it), assigning on first sight."""
        entry = self._req.get(req_id)
        if entry is not None:
            return entry
        if exact_start == 0:  # it computes its first block (a fresh one): it writes the sinks
            slot = self._by_block.pop(first_block, None)
            slot = self._take() if slot is None else slot
            self._by_block[first_block] = slot
            entry = (slot, True)
        else:
            slot = self._by_block.get(first_block, -1)
            if slot >= 0:
                self._by_block.move_to_end(first_block)
            entry = (slot, False)
        if entry[0] >= 0:
            self._pins[entry[0]] = self._pins.get(entry[0], 0) + 1
        self._req[req_id] = entry
        return entry

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        for block, slot in self._by_block.items():
            if not self._pins.get(slot):
                del self._by_block[block]
                return slot
        raise AssertionError("every sink slot is read by a running request")

    def forget(self, block_ids: list[int]) -> None:
        """Drop the sinks keyed by these blocks: they now hold other K/V (copied in from the
        host tier), so a hit on them reads its sinks quantized."""
        for block_id in block_ids:
            slot = self._by_block.pop(block_id, None)
            if slot is not None:
                assert not self._pins.get(slot), "a block some request reads was overwritten"
                self._free.append(slot)

    def release(self, req_ids: list[str]) -> None:
        """Unpin the slots of finished or preempted requests (their sinks stay for hits)."""
        for req_id in req_ids:
            slot, _ = self._req.pop(req_id, (-1, False))
            if slot >= 0:
                self._pins[slot] -= 1

    def release_all(self) -> None:
        """Forget every request and every block's sinks (the engine was reset)."""
        self._free.extend(self._by_block.values())
        self._by_block.clear()
        self._pins.clear()
        self._req.clear()
