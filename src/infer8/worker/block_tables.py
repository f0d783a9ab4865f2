"""Each running request's block ids in one persistent table, updated as blocks are appended.

The scheduler sends a request's whole block list when the runner first sees it (or sees it
again after a preemption) and then only the blocks appended since (vLLM's new_block_ids), so a
step's host work grows with new blocks, not with context; the runner appends them to the
request's row and the step's tables are numpy gathers of rows (vLLM's BlockTable). Rows are
zero past their blocks, as the kernels expect of padding.
"""

from __future__ import annotations

import numpy as np


class BlockTables:
    """Rows of block ids by request; the table grows in both dimensions as needed."""

    def __init__(self, num_rows: int = 64, width: int = 64) -> None:
        self.table = np.zeros((num_rows, width), dtype=np.int64)
        self.num_blocks = np.zeros(num_rows, dtype=np.int64)
        self.rows: dict[str, int] = {}
        self._free = list(range(num_rows - 1, -1, -1))

    def append(self, req_id: str, new_block_ids: list[int]) -> int:
        """Return the request's row after appending new_block_ids to it (a new row if none)."""
        row = self.rows.get(req_id)
        if row is None:
            row = self._take_row(req_id)
        known = int(self.num_blocks[row])
        n = known + len(new_block_ids)
        if n > self.table.shape[1]:
            wider = np.zeros((self.table.shape[0], max(n, 2 * self.table.shape[1])), np.int64)
            wider[:, : self.table.shape[1]] = self.table
            self.table = wider
        if new_block_ids:
            self.table[row, known:n] = new_block_ids
            self.num_blocks[row] = n
        return row

    def remove(self, req_id: str) -> None:
        """Free a request's row (finished or preempted); a later update starts it afresh."""
        row = self.rows.pop(req_id, None)
        if row is not None:
            self.table[row, : self.num_blocks[row]] = 0
            self.num_blocks[row] = 0
            self._free.append(row)

    def clear(self) -> None:
        """Free every row."""
        for req_id in list(self.rows):
            self.remove(req_id)

    def _take_row(self, req_id: str) -> int:
        if not self._free:
            num_rows = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
            self._free = list(range(2 * num_rows - 1, num_rows - 1, -1))
        row = self._free.pop()
        self.rows[req_id] = row
        return row
