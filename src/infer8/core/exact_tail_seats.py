"""Seats of an FP8 cache's exact tail, a KV resource the scheduler allocates beside the blocks.

attention/exact_tail.py describes the tail: per running request a ring row of its latest
positions, and sink slots holding the first S positions' residuals, keyed by the hash of the
first block so prefix-cache hits share them. Here live who holds which (pure Python, no
tensors): a request gets a row and a sink slot when it is admitted and gives them back with
its blocks (finish, abort, preemption); the scheduler hands them down in its output.

A prefix hit is only as long as what the tail can restore: a query's window is cut at the start
of its segment (a few windows long), so a hit is shortened to a multiple of the segment (and of
the block size), where the first recomputed query needs nothing exact from before it; and a hit
on a first block whose sinks are gone (their slot was given to another) is no hit at all. So a
hit changes how much is computed, never the numbers.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class TailSeat:
    """A running request's place in the tail's store (plain data, sent to the worker)."""

    row: int  # its ring row
    exact_start: int  # the first position it computed since admission (its ring's start)
    sink_slot: int  # the row of its sinks, -1 without sinks
    writes_sinks: bool  # it computes its first positions, so it writes them


class ExactTailSeats:
    """Ring rows for running requests, and sink slots keyed by first-block hashes."""

    def __init__(self, num_rows: int, segment: int, sink_tokens: int, block_size: int) -> None:
        assert num_rows >= 1 and segment >= 1
        self.sink_tokens = sink_tokens
        # a hit must end on a segment boundary and on a block boundary
        self.hit_alignment = math.lcm(segment, block_size)
        self._free_rows = list(range(num_rows - 1, -1, -1))
        # As many sink slots as rows: each running request pins at most one, so a request
        # that computes its first block always finds one.
        self._free_slots = list(range(num_rows - 1, -1, -1))
        self._by_key: OrderedDict[object, int] = OrderedDict()  # sinks' key -> slot, LRU first
        self._pins: dict[int, int] = {}
        self._seats: dict[str, TailSeat] = {}

    @property
    def num_free_rows(self) -> int:
        """Return how many more requests can run with a seat."""
        return len(self._free_rows)

    def usable_hit(self, num_tokens: int, sink_key: object | None) -> int:
        """Return how many of a prefix hit's `num_tokens` the tail can restore exactly."""
        num_tokens -= num_tokens % self.hit_alignment
        if num_tokens and self.sink_tokens and sink_key not in self._by_key:
            return 0  # its sinks are gone: computing block 0 again writes them
        return num_tokens

    def seat(self, req_id: str, num_computed: int, sink_key: object | None) -> TailSeat:
        """Give an admitted request a row and its sinks (computed from `num_computed` on).

        sink_key: the hash of its first block (None when it has no full one: nothing can hit
        its sinks later, and it hits nothing).
        """
        assert req_id not in self._seats and self._free_rows, "no free exact-tail row"
        row = self._free_rows.pop()
        slot, writes = -1, False
        if self.sink_tokens:
            key = (req_id,) if sink_key is None else sink_key
            if num_computed == 0:  # it computes its first block: it writes the sinks
                slot = self._by_key.pop(key, None)
                slot = self._take_slot() if slot is None else slot
                self._by_key[key] = slot
                writes = True
            else:  # a hit that usable_hit allowed: its sinks are held
                slot = self._by_key[key]
                self._by_key.move_to_end(key)
            self._pins[slot] = self._pins.get(slot, 0) + 1
        seat = self._seats[req_id] = TailSeat(row, num_computed, slot, writes)
        return seat

    def get(self, req_id: str) -> TailSeat | None:
        """Return a running request's seat (None if it has none)."""
        return self._seats.get(req_id)

    def release(self, req_id: str) -> None:
        """Take back a request's row and unpin its sinks (they stay for later hits)."""
        seat = self._seats.pop(req_id, None)
        if seat is None:
            return
        self._free_rows.append(seat.row)
        if seat.sink_slot >= 0:
            self._pins[seat.sink_slot] -= 1

    def _take_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        for key, slot in self._by_key.items():  # the least recently used one nobody reads
            if not self._pins.get(slot):
                del self._by_key[key]
                return slot
        raise AssertionError("every sink slot is read by a running request")
