"""The `/v1/responses` store: responses kept in memory, per API key, bounded in entries and bytes.

Each entry holds the response object clients read back and the conversation (chat messages,
without the instructions) that `previous_response_id` continues. Entries are keyed by their
owner (the API key's id, None without keys) and id, so one key never reads, cancels, deletes
or continues another key's response. Past `max_entries` or `max_bytes` the oldest entries are
evicted first; an entry larger than `max_bytes` on its own is not kept. Only the event loop
reads and writes the store (no lock).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from infer8.entrypoints.openai.responses_protocol import ResponsesResponse

logger = logging.getLogger(__name__)

DEFAULT_MAX_ENTRIES = 10_000
DEFAULT_MAX_BYTES = 128 << 20


@dataclass
class StoredResponse:
    """One stored response: the object GET returns and the conversation it continues."""

    response: ResponsesResponse
    conversation: list[dict[str, Any]]  # chat messages: the inputs, then (finished) the output
    num_bytes: int = 0  # set by the store

    @property
    def response_id(self) -> str:
        return self.response.id


class ResponsesStore:
    """Owns the stored responses, oldest first, and their byte count."""

    def __init__(
        self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError(f"store bounds must be >= 0, got {max_entries} and {max_bytes}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[tuple[str | None, str], StoredResponse] = OrderedDict()

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def put(self, owner: str | None, entry: StoredResponse) -> bool:
        """Store or replace an entry (keeping its place); return False if it is too large."""
        key = (owner, entry.response_id)
        entry.num_bytes = _size_bytes(entry)
        old = self._entries.get(key)
        if old is not None:
            self.num_bytes -= old.num_bytes
        if entry.num_bytes > self.max_bytes or self.max_entries == 0:
            if old is not None:
                del self._entries[key]
            logger.warning(
                "response %s (%d bytes) is not stored: the store holds at most %d entries, "
                "%d bytes",
                entry.response_id,
                entry.num_bytes,
                self.max_entries,
                self.max_bytes,
            )
            return False
        self._entries[key] = entry
        self.num_bytes += entry.num_bytes
        self._evict(keep=key)
        return True

    def get(self, owner: str | None, response_id: str) -> StoredResponse | None:
        """Return the owner's entry, or None (unknown, evicted, or another owner's)."""
        return self._entries.get((owner, response_id))

    def delete(self, owner: str | None, response_id: str) -> bool:
        """Remove the owner's entry; return whether there was one."""
        entry = self._entries.pop((owner, response_id), None)
        if entry is None:
            return False
        self.num_bytes -= entry.num_bytes
        return True

    def _evict(self, keep: tuple[str | None, str]) -> None:
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            # The entry just put fits alone (checked in put): the oldest other one goes.
            victim = next(key for key in self._entries if key != keep)
            self.num_bytes -= self._entries.pop(victim).num_bytes


def _size_bytes(entry: StoredResponse) -> int:
    """Return the bytes an entry stands for: its response and conversation as JSON."""
    response_bytes = len(entry.response.model_dump_json())
    return response_bytes + len(json.dumps(entry.conversation, ensure_ascii=False))
