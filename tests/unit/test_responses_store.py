"""The /v1/responses store: bounded in entries and bytes (oldest evicted first), per owner."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from infer8.entrypoints.openai.guards import APIKeyMiddleware, tenant_of
from infer8.entrypoints.openai.responses_protocol import ResponsesResponse
from infer8.entrypoints.openai.responses_store import ResponsesStore, StoredResponse


def _entry(text: str = "hi", response_id: str | None = None) -> StoredResponse:
    response = ResponsesResponse(model="m", instructions=text)
    if response_id is not None:
        response.id = response_id
    return StoredResponse(response, [{"role": "user", "content": text}])


def test_max_entries_evicts_the_oldest() -> None:
    store = ResponsesStore(max_entries=2)
    first, second, third = _entry(), _entry(), _entry()
    for entry in (first, second, third):
        assert store.put(None, entry)
    assert store.num_entries == 2
    assert store.get(None, first.response_id) is None
    assert store.get(None, second.response_id) is second
    assert store.get(None, third.response_id) is third
    assert store.num_bytes == second.num_bytes + third.num_bytes


def test_max_bytes_evicts_the_oldest_until_the_new_entry_fits() -> None:
    small = _entry("x")
    ResponsesStore().put(None, small)  # sized on put
    size = small.num_bytes
    store = ResponsesStore(max_bytes=3 * size)
    entries = [_entry("x") for _ in range(3)]
    for entry in entries:
        store.put("a", entry)
    assert store.num_bytes <= store.max_bytes
    big = _entry("y" * (size // 2))  # twice a small one's bytes (its text is in it twice)
    assert store.put("a", big)
    assert store.num_bytes <= store.max_bytes
    assert store.get("a", big.response_id) is big
    assert store.get("a", entries[0].response_id) is None  # oldest gone first
    kept = [e for e in entries if store.get("a", e.response_id) is not None]
    assert kept == entries[len(entries) - len(kept) :]  # the newest survive


def test_an_entry_larger_than_the_store_is_not_kept() -> None:
    store = ResponsesStore(max_bytes=200)
    kept = _entry("a", "resp_1")
    store.put(None, _entry("a", "resp_0"))
    assert not store.put(None, _entry("z" * 1000, "resp_2"))
    assert store.get(None, "resp_2") is None
    # Replacing an entry by a version too large drops it (no stale copy).
    store = ResponsesStore(max_bytes=2000)
    store.put(None, kept)
    assert not store.put(None, _entry("z" * 3000, "resp_1"))
    assert store.get(None, "resp_1") is None and store.num_bytes == 0


def test_replacing_keeps_the_place_and_recounts_bytes() -> None:
    store = ResponsesStore(max_entries=2)
    first, second = _entry("a"), _entry("b")
    store.put(None, first)
    store.put(None, second)
    grown = _entry("a" * 100, first.response_id)
    store.put(None, grown)  # the finished version of the first response
    assert store.num_bytes == grown.num_bytes + second.num_bytes
    store.put(None, _entry("c"))  # the first is still the oldest
    assert store.get(None, first.response_id) is None
    assert store.get(None, second.response_id) is second


def test_owners_never_see_each_others_entries() -> None:
    store = ResponsesStore()
    entry = _entry()
    store.put("tenant-a", entry)
    assert store.get("tenant-b", entry.response_id) is None
    assert store.get(None, entry.response_id) is None
    assert not store.delete("tenant-b", entry.response_id)
    assert store.get("tenant-a", entry.response_id) is entry
    assert store.delete("tenant-a", entry.response_id)
    assert store.num_entries == 0 and store.num_bytes == 0
    assert not store.delete("tenant-a", entry.response_id)


def test_bounds_are_validated() -> None:
    with pytest.raises(ValueError):
        ResponsesStore(max_entries=-1)
    assert not ResponsesStore(max_entries=0).put(None, _entry())


@pytest.mark.parametrize("share_prefix_cache", [False, True])
def test_each_api_key_owns_its_responses_even_when_keys_share_the_cache(
    share_prefix_cache: bool,
) -> None:
    """The API key guard names the key (its tenant hash) for the store in every setting."""
    seen: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(dict(scope["state"]))

    guard = APIKeyMiddleware(app, ["k1", "k2"], frozenset(), share_prefix_cache)
    for key in ("k1", "k2"):
        headers = [(b"authorization", f"Bearer {key}".encode())]
        scope = {"type": "http", "path": "/v1/responses", "headers": headers}
        asyncio.run(guard(scope, None, None))  # type: ignore[arg-type]
    assert [s["key_id"] for s in seen] == [tenant_of("k1"), tenant_of("k2")]
    expected_tenants = [None, None] if share_prefix_cache else [tenant_of("k1"), tenant_of("k2")]
    assert [s["tenant"] for s in seen] == expected_tenants
