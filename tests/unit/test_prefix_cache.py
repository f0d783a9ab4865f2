"""Prefix caching: block pool, KV cache manager and scheduler with a fake runner (no model)."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer8.core.block_pool import BlockPool, hash_block_tokens
from infer8.core.kv_cache_manager import KVCacheManager, cdiv
from infer8.core.sched_output import ModelRunnerOutput, SchedulerOutput
from infer8.core.scheduler import Scheduler
from infer8.entrypoints.openai.cli_args import make_serve_parser, serve_args_from
from infer8.request import Request, RequestStatus
from infer8.sampling_params import SamplingParams

EOS = 0


def make_request(
    req_id: str,
    prompt: list[int],
    max_tokens: int = 8,
    cache_salt: str | None = None,
    max_model_len: int = 1000,
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    req = Request(req_id, prompt, params, [EOS], cache_salt=cache_salt)
    req.max_num_tokens = min(max_model_len, len(prompt) + max_tokens)
    return req


class KVCheckingRunner:
    """A fake model that writes what each slot should hold and checks every read.

    A slot at position p of a request holds (cache_salt, key of tokens[: p + 1]): the K/V of a
    token depend on the whole prefix, and the salt marks the tenant. Every step first writes the
    new tokens of all scheduled requests (as each layer of the real model does), then checks
    that every request's context, cached or not, holds exactly its own prefix. The next token is
    a function of the tokens alone, so outputs do not depend on caching.
    """

    def __init__(self, block_size: int, salts: dict[str, str | None], vocab: int = 7) -> None:
        self.block_size = block_size
        self.salts = salts
        self.vocab = vocab
        self.tokens: dict[str, list[int]] = {}
        self.prefix_keys: dict[str, list[int]] = {}
        self.slots: dict[int, tuple[str | None, int]] = {}
        self.tables: dict[str, list[int]] = {}  # block tables rebuilt from new_block_ids

    def _keys(self, req_id: str) -> list[int]:
        keys, tokens = self.prefix_keys[req_id], self.tokens[req_id]
        for t in tokens[len(keys) :]:
            keys.append(hash((keys[-1] if keys else 0, t)))
        return keys

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in sched.finished_req_ids:
            self.tokens.pop(req_id, None)
            self.prefix_keys.pop(req_id, None)
        for req_id in sched.finished_req_ids + sched.preempted_req_ids:
            self.tables.pop(req_id, None)  # as the model runner's block tables
        for s in sched.scheduled:  # the scheduler sends only the blocks a table lacks
            self.tables.setdefault(s.req_id, []).extend(s.new_block_ids)
        for new in sched.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids)
            self.prefix_keys[new.req_id] = []
        for s in sched.scheduled:  # write
            keys, salt = self._keys(s.req_id), self.salts[s.req_id]
            end = s.num_computed_tokens + s.num_new_tokens
            for pos in range(s.num_computed_tokens, end):
                self.slots[self._slot(self.tables[s.req_id], pos)] = (salt, keys[pos])
        out = ModelRunnerOutput()
        for s in sched.scheduled:  # read
            keys, salt = self._keys(s.req_id), self.salts[s.req_id]
            for pos in range(s.num_computed_tokens + s.num_new_tokens):
                got = self.slots.get(self._slot(self.tables[s.req_id], pos))
                assert got == (salt, keys[pos]), f"{s.req_id} read a wrong slot at {pos}"
            if s.sample:
                tokens = self.tokens[s.req_id]
                token = 1 + (sum(tokens) * 7 + len(tokens)) % self.vocab
                tokens.append(token)
                out.sampled_token_ids[s.req_id] = token
        return out


def check_pool_invariants(kv: KVCacheManager, sched: Scheduler) -> None:
    """Ref counts are holders; held blocks are never free; cached blocks match their owners."""
    pool = kv.block_pool
    holders = Counter(b for block_ids in kv.req_to_block_ids.values() for b in block_ids)
    assert pool.ref_cnts == [holders[b] for b in range(kv.num_blocks)]
    assert all(c >= 0 for c in pool.ref_cnts)
    for b in range(kv.num_blocks):
        assert pool.is_free(b) == (holders[b] == 0)
    assert pool.num_free_blocks == kv.num_blocks - len(holders)
    for block_hash, b in pool.cached_block_hash_to_block.items():
        assert pool.block_hashes[b] == block_hash
    assert sum(h is not None for h in pool.block_hashes) == pool.num_cached_blocks
    for request in sched.running:
        block_ids = kv.get_block_ids(request.request_id)
        assert len(block_ids) >= cdiv(request.num_computed_tokens, kv.block_size)
        hashes = kv.block_hashes(request)
        for i, b in enumerate(block_ids):
            if pool.block_hashes[b] is not None:  # a cached block sits where its prefix says
                assert i < len(hashes) and pool.block_hashes[b] == hashes[i]


# -- block pool -------------------------------------------------------------------------------
def test_block_hash_chains_parent_tokens_and_salt() -> None:
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert len(h0) == 32 and h0 == hash_block_tokens(None, (1, 2, 3, 4))
    assert h0 != hash_block_tokens(None, [1, 2, 3, 5])
    assert h0 != hash_block_tokens(None, [1, 2, 3, 4], ("tenant",))
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    assert h1 != hash_block_tokens(hash_block_tokens(None, [9, 9, 9, 9]), [5, 6, 7, 8])


def test_free_blocks_stay_cached_and_are_evicted_tail_first() -> None:
    pool = BlockPool(6)
    block_ids = pool.allocate(4)
    hashes = [bytes([i]) * 32 for i in range(4)]
    pool.cache_full_blocks(block_ids, hashes)
    pool.free(block_ids[::-1])  # as the manager frees a request: last block first
    assert pool.num_free_blocks == 6 and pool.num_cached_blocks == 4
    # Never-used blocks go first, then the freed request's tail.
    assert pool.allocate(3) == [4, 5, block_ids[3]]
    assert pool.get_cached_block(hashes[3]) is None
    assert [pool.get_cached_block(h) for h in hashes[:3]] == block_ids[:3]
    pool.touch([block_ids[0]])  # a hit leaves the free queue
    assert pool.ref_cnts[block_ids[0]] == 1 and not pool.is_free(block_ids[0])
    assert pool.allocate(2) == [block_ids[2], block_ids[1]]
    assert pool.num_cached_blocks == 1 and pool.num_free_blocks == 0


def test_reset_drops_only_blocks_nobody_holds() -> None:
    pool = BlockPool(4)
    held, freed = pool.allocate(2), pool.allocate(2)
    pool.cache_full_blocks(held + freed, [bytes([i]) * 32 for i in range(4)])
    pool.free(freed)
    assert pool.reset_prefix_cache() == 2
    assert pool.num_cached_blocks == 2
    assert all(pool.block_hashes[b] is not None for b in held)
    pool.free(held)
    assert pool.reset_prefix_cache() == 2 and pool.num_cached_blocks == 0


# -- KV cache manager -------------------------------------------------------------------------
def test_longest_cached_prefix_leaves_the_last_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request("a", list(range(1, 14)))  # 13 tokens: 3 full blocks
    assert kv.get_computed_blocks(a) == ([], 0)
    assert kv.allocate_slots(a, 13) is not None
    assert kv.block_pool.num_cached_blocks == 3
    b = make_request("b", list(range(1, 11)) + [99, 98])  # shares 2 full blocks and 2 tokens
    blocks, num_computed = kv.get_computed_blocks(b)
    assert (blocks, num_computed) == (kv.get_block_ids("a")[:2], 8)
    # The whole prompt cached and block-aligned: its last block is recomputed, not reused.
    c = make_request("c", list(range(1, 13)))
    blocks, num_computed = kv.get_computed_blocks(c)
    assert (blocks, num_computed) == (kv.get_block_ids("a")[:2], 8)
    assert kv.allocate_slots(c, 12, blocks) is not None
    assert kv.get_block_ids("c")[2] != kv.get_block_ids("a")[2]
    assert kv.block_pool.ref_cnts[kv.get_block_ids("a")[0]] == 2
    # One token more and the third block is a hit too.
    d = make_request("d", list(range(1, 14)))
    assert kv.get_computed_blocks(d) == (kv.get_block_ids("a")[:3], 12)


def test_different_salts_never_share() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(1, 20))
    a = make_request("a", prompt, cache_salt="tenant-a")
    kv.allocate_slots(a, len(prompt))
    assert kv.get_computed_blocks(make_request("b", prompt, cache_salt="tenant-b"))[1] == 0
    assert kv.get_computed_blocks(make_request("c", prompt))[1] == 0
    assert kv.get_computed_blocks(make_request("d", prompt, cache_salt="tenant-a"))[1] == 16


def test_hits_nobody_holds_count_against_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(1, 14)))
    kv.allocate_slots(a, 13)
    kv.free("a")  # 3 cached blocks, all 4 free
    b = make_request("b", list(range(1, 13)) + list(range(50, 58)))  # 3 hits + 2 new blocks
    blocks, num_computed = kv.get_computed_blocks(b)
    assert num_computed == 12
    assert kv.allocate_slots(b, 20, blocks) is None  # 3 + 2 > 4: nothing taken
    assert kv.num_free_blocks == 4 and kv.block_pool.num_cached_blocks == 3
    assert kv.allocate_slots(b, 16, blocks) is not None  # 3 + 1 fit
    assert kv.num_free_blocks == 0


def test_disabled_caching_caches_nothing() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    a = make_request("a", list(range(1, 14)))
    kv.allocate_slots(a, 13)
    assert kv.block_pool.num_cached_blocks == 0
    assert kv.get_computed_blocks(make_request("b", list(range(1, 14)))) == ([], 0)


# -- scheduler ---------------------------------------------------------------------------------
def _run(sched: Scheduler, runner: KVCheckingRunner, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
        check_pool_invariants(sched.kv_cache_manager, sched)  # type: ignore[arg-type]
    raise AssertionError("no progress")


def test_second_request_schedules_only_its_suffix() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=16)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=256)
    prefix = [3 + i % 50 for i in range(64)]
    runner = KVCheckingRunner(16, {"a": None, "b": None})
    sched.add_request(make_request("a", prefix + [7, 8, 9]))
    _run(sched, runner)
    sched.add_request(make_request("b", prefix + [1, 2, 3, 4, 5]))
    out = sched.schedule()
    stats = sched.make_stats()
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled] == [(64, 5)]
    assert (stats.num_prefix_cache_queries, stats.num_prefix_cache_hits) == (69, 64)
    assert stats.prefix_cache_hit_rate == 64 / 69
    assert out.scheduled_new_reqs[0].prompt_token_ids == prefix + [1, 2, 3, 4, 5]
    sched.update_from_output(out, runner.execute(out))
    _run(sched, runner)
    assert kv.num_free_blocks == 64


def test_requests_admitted_in_one_step_share_a_prefix_computed_in_it() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=16)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=512)
    prefix = list(range(10, 74))
    salts = {"a": None, "b": None, "c": "other"}
    for req_id, salt in salts.items():
        sched.add_request(make_request(req_id, prefix + [ord(req_id)], cache_salt=salt))
    out = sched.schedule()
    by_id = {s.req_id: (s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled}
    assert by_id == {"a": (0, 65), "b": (64, 1), "c": (0, 65)}
    runner = KVCheckingRunner(16, salts)
    sched.update_from_output(out, runner.execute(out))  # b reads what a writes in this step
    _run(sched, runner)


def test_preempted_request_finds_its_own_blocks_again() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    salts = {"a": None, "b": None}
    sched.add_request(make_request("a", list(range(1, 13)), max_tokens=16))
    sched.add_request(make_request("b", list(range(40, 50)), max_tokens=16))
    runner = KVCheckingRunner(4, salts)
    readmitted = []
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        admitted = sched.make_stats().admitted_req_ids
        readmitted += [
            (s.req_id, s.num_computed_tokens, sched.requests[s.req_id].num_tokens)
            for s in out.scheduled
            if s.req_id in admitted and sched.requests[s.req_id].num_preemptions
        ]
        sched.update_from_output(out, runner.execute(out))
        check_pool_invariants(kv, sched)
    assert not sched.has_unfinished_requests()
    # b was preempted (most recently admitted); its first block outlived it in the cache.
    req_id, num_computed, num_tokens = readmitted[0]
    assert req_id == "b" and 4 <= num_computed < num_tokens
    assert kv.num_free_blocks == 8


def test_reset_while_running_keeps_held_blocks() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    runner = KVCheckingRunner(4, {"a": None, "b": None, "c": None})
    sched.add_request(make_request("a", list(range(1, 13)), max_tokens=2))
    _run(sched, runner)
    sched.add_request(make_request("b", list(range(20, 33)), max_tokens=30))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    num_held_cached = sum(kv.block_pool.block_hashes[b] is not None for b in kv.get_block_ids("b"))
    assert kv.reset_prefix_cache() == 3  # a's blocks; b's stay
    assert kv.block_pool.num_cached_blocks == num_held_cached == 3
    sched.add_request(make_request("c", list(range(1, 13)), max_tokens=2))
    out = sched.schedule()
    assert {s.req_id: s.num_computed_tokens for s in out.scheduled}["c"] == 0
    sched.update_from_output(out, runner.execute(out))
    _run(sched, runner)


@st.composite
def shared_prefix_workloads(draw: st.DrawFn) -> dict:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(8, 64))
    min_blocks = cdiv(max_model_len, block_size)
    stems = draw(st.lists(st.lists(st.integers(1, 6), max_size=40), min_size=1, max_size=3))
    reqs = []
    for i in range(draw(st.integers(1, 12))):
        stem = draw(st.sampled_from(stems))
        suffix = draw(st.lists(st.integers(1, 6), min_size=1, max_size=12))
        prompt = (stem + suffix)[: max_model_len - 1]
        reqs.append(
            dict(
                req_id=f"r{i}",
                prompt=prompt,
                max_tokens=draw(st.integers(1, 24)),
                salt=draw(st.sampled_from([None, None, "t1", "t2"])),
                arrival=draw(st.integers(0, 20)),
            )
        )
    return dict(
        block_size=block_size,
        max_model_len=max_model_len,
        num_blocks=draw(st.integers(min_blocks, min_blocks * 2)),
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 48)),
        reset_steps=draw(st.sets(st.integers(0, 60), max_size=3)),
        reqs=reqs,
    )


def _run_workload(w: dict, enable_caching: bool) -> tuple[dict[str, list[int]], KVCacheManager]:
    kv = KVCacheManager(w["num_blocks"], w["block_size"], enable_caching)
    sched = Scheduler(kv, w["max_num_seqs"], w["max_num_batched_tokens"])
    runner = KVCheckingRunner(w["block_size"], {r["req_id"]: r["salt"] for r in w["reqs"]})
    arrivals: dict[int, list[Request]] = {}
    for r in w["reqs"]:
        req = make_request(r["req_id"], r["prompt"], r["max_tokens"], r["salt"], w["max_model_len"])
        arrivals.setdefault(r["arrival"], []).append(req)
    outputs: dict[str, list[int]] = {}
    step = 0
    # Cached blocks whose K/V are computed (as of the end of the last step) are never written
    # again unless they were evicted and allocated afresh.
    computed: dict[int, bytes] = {}
    allocated: set[int] = set()
    allocate = kv.block_pool.allocate

    def recording_allocate(num_blocks: int) -> list[int]:
        block_ids = allocate(num_blocks)
        allocated.update(block_ids)
        return block_ids

    kv.block_pool.allocate = recording_allocate  # type: ignore[method-assign]
    while arrivals or sched.has_unfinished_requests():
        for req in arrivals.pop(step, []):
            sched.add_request(req)
        if step in w["reset_steps"]:
            kv.reset_prefix_cache()
            check_pool_invariants(kv, sched)
        allocated.clear()
        out = sched.schedule()
        check_pool_invariants(kv, sched)
        for s in out.scheduled:
            assert s.num_new_tokens >= 1
            first, last = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens - 1
            table = kv.get_block_ids(s.req_id)
            for b in table[first // w["block_size"] : last // w["block_size"] + 1]:
                is_fresh = b not in computed or b in allocated
                assert is_fresh, f"{s.req_id} writes into computed cached block {b}"
        for req, _ in sched.update_from_output(out, runner.execute(out)):
            if req.is_finished:
                outputs[req.request_id] = list(req.output_token_ids)
                assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
        check_pool_invariants(kv, sched)
        pool = kv.block_pool
        computed = {b: h for b, h in enumerate(pool.block_hashes) if h is not None}
        step += 1
        assert step < 3000, "no progress"
    return outputs, kv


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared_prefix_workloads())
def test_prefix_caching_is_invisible_in_outputs_and_leaks_nothing(w: dict) -> None:
    cached_outputs, kv = _run_workload(w, enable_caching=True)
    plain_outputs, _ = _run_workload(w, enable_caching=False)
    assert cached_outputs == plain_outputs
    assert set(cached_outputs) == {r["req_id"] for r in w["reqs"]}
    # Every block is reclaimable at the end, and a reset forgets every prefix.
    assert kv.num_free_blocks == w["num_blocks"]
    assert all(c == 0 for c in kv.block_pool.ref_cnts)
    kv.reset_prefix_cache()
    assert kv.block_pool.num_cached_blocks == 0


def test_flags_turn_prefix_caching_off_and_on() -> None:
    parser = make_serve_parser()
    assert serve_args_from(parser.parse_args([]))[0].enable_prefix_caching
    off = serve_args_from(parser.parse_args(["--no-enable-prefix-caching"]))[0]
    assert not off.enable_prefix_caching
    assert serve_args_from(parser.parse_args(["--enable-prefix-caching"]))[0].enable_prefix_caching
