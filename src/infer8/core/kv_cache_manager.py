"""Per-request block tables over the block pool: prefix hits, allocate_slots, free (pure Python)."""

from __future__ import annotations

from collections.abc import Sequence

from infer8.core.block_pool import BlockHash, BlockPool, hash_block_tokens
from infer8.core.exact_tail_seats import ExactTailSeats, TailSeat
from infer8.core.host_tier import HostKVTier, HostTransfers
from infer8.core.kv_events import KVCacheEvent
from infer8.request import Request
from infer8.utils import cdiv


class KVCacheManager:
    """Owns each request's block table, grows it as tokens are scheduled, and reuses prefixes.

    With `enable_caching`, every block that a step fills is registered under the hash chain of
    the tokens it holds, as soon as the step is scheduled: the model writes all of a step's
    K/V before any attention reads them (per layer), so a request admitted in the same step
    may already read them. `get_computed_blocks` finds a new request's longest cached prefix.

    With `num_host_blocks` (and caching), evicted cached blocks go to a host-memory tier
    (core/host_tier.py) and `get_host_hits` continues a prefix lookup there.

    With `exact_tail` ((rows, segment, sinks) of an FP8 cache's exact tail), running
    requests hold a tail seat too (core/exact_tail_seats.py), given with `seat` and taken back
    by `free`, and `find_prefix` shortens hits to what the tail can restore.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        num_host_blocks: int = 0,
        exact_tail: tuple[int, int, int] | None = None,
    ) -> None:
        self.block_size = block_size
        self.tail: ExactTailSeats | None = None
        if exact_tail is not None:
            self.tail = ExactTailSeats(*exact_tail, block_size)
        self.enable_caching = enable_caching
        use_host = enable_caching and num_host_blocks > 0
        self.block_pool = BlockPool(
            num_blocks, enable_kv_cache_events and enable_caching, keep_evicted=use_host
        )
        self.host_tier: HostKVTier | None = None
        if use_host:
            record = (
                self.block_pool.record_event if self.block_pool.enable_kv_cache_events else None
            )
            self.host_tier = HostKVTier(num_host_blocks, record)
        self.req_to_block_ids: dict[str, list[int]] = {}
        # How many leading blocks of each request's table are registered in the prefix cache.
        self.req_to_num_cached_blocks: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        """Return the pool size."""
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Return free blocks (cached blocks nobody holds included: they are reclaimable)."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Return the fraction of blocks in use."""
        return self.block_pool.usage

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Return how many new blocks the request needs to hold `num_tokens` tokens."""
        held = len(self.req_to_block_ids.get(request_id, ()))
        return max(0, cdiv(num_tokens, self.block_size) - held)

    def num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_block_ids: Sequence[int] = ()
    ) -> int:
        """Return how many free blocks `allocate_slots` would take: new blocks, and prefix hits
        that nobody holds now (they leave the free queue)."""
        num_held = len(self.req_to_block_ids.get(request_id, ())) + len(new_computed_block_ids)
        num_new = max(0, cdiv(num_tokens, self.block_size) - num_held)
        return num_new + sum(1 for b in new_computed_block_ids if self.block_pool.is_free(b))

    def block_hashes(self, request: Request, num_blocks: int | None = None) -> list[BlockHash]:
        """Return the hash chain of the request's first full blocks, extending it as needed.

        The chain grows with the request's output, so blocks filled while decoding are cached
        too. The first block's hash includes the request's cache_salt, so requests with
        different salts share nothing.
        """
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        num_blocks = num_full if num_blocks is None else min(num_blocks, num_full)
        if len(hashes) < num_blocks:
            token_ids = request.all_token_ids
            bs = self.block_size
            for i in range(len(hashes), num_blocks):
                parent = hashes[-1] if hashes else None
                hashes.append(
                    hash_block_tokens(
                        parent, token_ids[i * bs : (i + 1) * bs], _extra_keys(request, i)
                    )
                )
        return hashes[:num_blocks]

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Return the cached blocks of the request's longest cached prefix and its length.

        At least the last token is always left to compute (its logits are sampled), and only
        whole blocks are reused. When the whole prompt is cached and ends on a block boundary,
        the last block is therefore not reused but recomputed into a fresh block (at most
        block_size tokens, as vLLM does): recomputing only its last token inside the shared
        block would write into a block other requests read, and that write is not even
        bit-identical (a 1-token computation rounds differently from the original chunk).
        """
        if not self.enable_caching:
            return [], 0
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        block_ids = []
        for block_hash in self.block_hashes(request, max_num_blocks):
            block_id = self.block_pool.get_cached_block(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids, len(block_ids) * self.block_size

    def get_host_hits(self, request: Request, num_device_blocks: int) -> list[int]:
        """Return the host slots that continue a prefix after its first `num_device_blocks`
        device hits (empty without a host tier); the same last-token rule applies."""
        if self.host_tier is None:
            return []
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self.block_hashes(request, max_num_blocks)
        return self.host_tier.lookup(hashes[num_device_blocks:])

    def find_prefix(self, request: Request) -> tuple[list[int], list[int]]:
        """Return a new request's usable prefix hits: (device blocks, host slots after them).

        The longest cached prefix (get_computed_blocks, then get_host_hits), shortened to
        what an exact tail can restore (ExactTailSeats.usable_hit).
        """
        block_ids, _ = self.get_computed_blocks(request)
        host_slots = self.get_host_hits(request, len(block_ids))
        if self.tail is None or not (block_ids or host_slots):
            return block_ids, host_slots
        num_tokens = (len(block_ids) + len(host_slots)) * self.block_size
        num_blocks = self.tail.usable_hit(num_tokens, self._sink_key(request)) // self.block_size
        return block_ids[:num_blocks], host_slots[: max(0, num_blocks - len(block_ids))]

    def can_seat(self) -> bool:
        """Return whether one more request can run (an exact tail has a row for it)."""
        return self.tail is None or self.tail.num_free_rows > 0

    def seat(self, request: Request) -> None:
        """Give an admitted request its exact-tail seat (nothing without a tail), computed from
        its num_computed_tokens on."""
        if self.tail is not None:
            self.tail.seat(request.request_id, request.num_computed_tokens, self._sink_key(request))

    def get_seat(self, request_id: str) -> TailSeat | None:
        """Return a running request's exact-tail seat (None without a tail)."""
        return None if self.tail is None else self.tail.get(request_id)

    def _sink_key(self, request: Request) -> BlockHash | None:
        """Return what the request's sinks are keyed by: its first block's hash (None if it
        has no full block yet)."""
        hashes = self.block_hashes(request, 1)
        return hashes[0] if hashes else None

    def allocate_slots(
        self,
        request: Request,
        num_tokens: int,
        new_computed_block_ids: Sequence[int] = (),
        host_hit_slots: Sequence[int] = (),
    ) -> list[int] | None:
        """Grow the request's table to hold `num_tokens` tokens; None (nothing taken) if short.

        `new_computed_block_ids` (a new request's prefix hits) go first in its table, then
        fresh blocks for `host_hit_slots` (its host-tier hits, loaded this step). Blocks that
        the step fills are registered in the prefix cache.
        """
        block_ids = self.req_to_block_ids.get(request.request_id, [])
        assert not (block_ids and new_computed_block_ids), "prefix hits only for a new table"
        assert not (block_ids and host_hit_slots), "host hits only for a new table"
        num_new = max(
            0, cdiv(num_tokens, self.block_size) - len(block_ids) - len(new_computed_block_ids)
        )
        assert len(host_hit_slots) <= num_new
        num_to_allocate = self.num_blocks_to_allocate(
            request.request_id, num_tokens, new_computed_block_ids
        )
        if num_to_allocate > self.block_pool.num_free_blocks:
            return None
        self.block_pool.touch(new_computed_block_ids)
        if self.host_tier is not None:
            self.host_tier.pin(host_hit_slots)  # before this allocation's evictions save
        new_block_ids = self.block_pool.allocate(num_new)
        if self.host_tier is not None:
            for block_id, block_hash, content in self.block_pool.take_evicted():
                self.host_tier.save(block_id, block_hash, content)
            self.host_tier.load(host_hit_slots, new_block_ids[: len(host_hit_slots)])
        block_ids = self.req_to_block_ids.setdefault(request.request_id, [])
        block_ids.extend(new_computed_block_ids)
        block_ids.extend(new_block_ids)
        if self.enable_caching:
            if new_computed_block_ids:
                # host hits are registered below with the blocks this step fills
                self.req_to_num_cached_blocks[request.request_id] = len(new_computed_block_ids)
            self._cache_full_blocks(request, min(num_tokens, request.num_tokens))
        return new_block_ids

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that are full once `num_tokens` tokens are computed."""
        num_full = num_tokens // self.block_size
        num_cached = self.req_to_num_cached_blocks.get(request.request_id, 0)
        if num_full <= num_cached:
            return
        block_ids = self.req_to_block_ids[request.request_id]
        hashes = self.block_hashes(request, num_full)
        token_ids: list[list[int]] | None = None
        extra_keys: list[tuple[object, ...] | None] | None = None
        if self.block_pool.enable_kv_cache_events:
            bs, all_ids = self.block_size, request.all_token_ids
            token_ids = [all_ids[i * bs : (i + 1) * bs] for i in range(num_cached, num_full)]
            extra_keys = [_extra_keys(request, i) for i in range(num_cached, num_full)]
        self.block_pool.cache_full_blocks(
            block_ids[num_cached:num_full],
            hashes[num_cached:num_full],
            parent_block_hash=hashes[num_cached - 1] if num_cached else None,
            block_token_ids=token_ids,
            block_extra_keys=extra_keys,
            lora=None
            if (lora := request.lora_request) is None
            else (lora.lora_int_id, lora.lora_name),
        )
        self.req_to_num_cached_blocks[request.request_id] = num_full

    def get_block_ids(self, request_id: str) -> list[int]:
        """Return the request's block table."""
        return self.req_to_block_ids.get(request_id, [])

    def free(self, request_id: str) -> None:
        """Return all of the request's blocks to the pool (cached ones stay reusable), and its
        exact-tail seat."""
        block_ids = self.req_to_block_ids.pop(request_id, [])
        self.req_to_num_cached_blocks.pop(request_id, None)
        if self.tail is not None:
            self.tail.release(request_id)
        # Free in reverse so the tail blocks, least likely to be shared later, are evicted first.
        self.block_pool.free(block_ids[::-1])

    def take_host_transfers(self) -> HostTransfers:
        """Return this step's copies to and from the host tier (none without one)."""
        if self.host_tier is None:
            return HostTransfers([], [], [], [])
        return self.host_tier.take_transfers()

    def reset_prefix_cache(self) -> int:
        """Drop every cached block that no running request holds, and the host tier's; return
        how many device blocks were dropped."""
        if self.host_tier is not None:
            self.host_tier.clear()  # first: an AllBlocksCleared after it is true of every medium
        return self.block_pool.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        """Return the prefix cache's events since the last call (empty with events off)."""
        return self.block_pool.take_events()


def _extra_keys(request: Request, block_index: int) -> tuple[object, ...] | None:
    """Return what a block's hash covers besides tokens: its LoRA adapter (name and id, in
    every block, as vLLM keys them by name: an adapter loaded again under the same name is a
    new id), then the cache_salt in the first block."""
    lora = request.lora_request
    keys: tuple[object, ...] = () if lora is None else (lora.lora_name, lora.lora_int_id)
    if block_index == 0 and request.cache_salt:
        keys += (request.cache_salt,)
    return keys or None
