"""Scheduler properties with a fake model runner: nothing lost, invariants at every step."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer8.core.kv_cache_manager import KVCacheManager, cdiv
from infer8.core.sched_output import ModelRunnerOutput, SchedulerOutput, SchedulerStats
from infer8.core.scheduler import Scheduler, SchedulerBase
from infer8.core.static_scheduler import StaticScheduler
from infer8.request import Request, RequestStatus
from infer8.sampling_params import SamplingParams

EOS = 0


class FakeRunner:
    """Emits token 1000 + position, and EOS once a request has produced its target length."""

    def __init__(self, targets: dict[str, int]) -> None:
        self.targets = targets
        self.num_outputs: dict[str, int] = {}

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        for s in sched.scheduled:
            if not s.sample:
                continue
            n = self.num_outputs.get(s.req_id, 0) + 1
            self.num_outputs[s.req_id] = n
            out.sampled_token_ids[s.req_id] = EOS if n == self.targets[s.req_id] else 1000 + n
        return out


def make_request(req_id: str, prompt_len: int, max_tokens: int, max_model_len: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    req = Request(req_id, list(range(1, prompt_len + 1)), params, [EOS])
    req.max_num_tokens = min(max_model_len, prompt_len + max_tokens)
    return req


def check_step_invariants(
    sched: SchedulerBase, out: SchedulerOutput, block_size: int, static: bool
) -> None:
    kv = sched.kv_cache_manager
    assert len(out.scheduled) <= sched.max_num_seqs
    if not static:
        assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
    # Each block's ref count is the number of block tables holding it (prefix caching shares).
    holders = Counter(b for block_ids in kv.req_to_block_ids.values() for b in block_ids)
    assert len(holders) == kv.block_pool.num_used_blocks <= kv.num_blocks
    assert kv.block_pool.ref_cnts == [holders[b] for b in range(kv.num_blocks)]
    for s in out.scheduled:
        num_blocks = len(kv.get_block_ids(s.req_id))
        assert num_blocks >= cdiv(s.num_computed_tokens + s.num_new_tokens, block_size)
        assert s.num_new_tokens >= 1


def run_to_completion(
    sched: SchedulerBase,
    runner: FakeRunner,
    arrivals: dict[int, list[Request]],
    block_size: int,
    static: bool = False,
    max_steps: int = 5000,
) -> tuple[dict[str, Request], list[SchedulerStats]]:
    finished: dict[str, Request] = {}
    stats_log: list[SchedulerStats] = []
    step = 0
    pending = dict(arrivals)
    while pending or sched.has_unfinished_requests():
        for req in pending.pop(step, []):
            sched.add_request(req)
        out = sched.schedule()
        check_step_invariants(sched, out, block_size, static)
        progressed = sched.update_from_output(out, runner.execute(out))
        for req, _ in progressed:
            if req.is_finished:
                finished[req.request_id] = req
        stats_log.append(sched.make_stats())
        step += 1
        assert step < max_steps, "scheduler made no progress"
    return finished, stats_log


@st.composite
def workloads(draw: st.DrawFn) -> dict:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_model_len = draw(st.integers(8, 96))
    num_blocks = draw(
        st.integers(cdiv(max_model_len, block_size), cdiv(max_model_len, block_size) * 4)
    )
    n = draw(st.integers(1, 12))
    reqs = []
    for i in range(n):
        prompt = draw(st.integers(1, max_model_len - 1))
        max_tokens = draw(st.integers(1, 40))
        eos_at = draw(st.integers(1, 50))
        arrival = draw(st.integers(0, 30))
        reqs.append((f"r{i}", prompt, max_tokens, eos_at, arrival))
    return dict(
        block_size=block_size,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=draw(st.integers(1, 64)),
        reqs=reqs,
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_continuous_scheduler_finishes_everything_exactly(w: dict) -> None:
    kv = KVCacheManager(w["num_blocks"], w["block_size"])
    sched = Scheduler(kv, w["max_num_seqs"], w["max_num_batched_tokens"])
    arrivals: dict[int, list[Request]] = {}
    expected_len: dict[str, int] = {}
    targets = {}
    for req_id, prompt, max_tokens, eos_at, arrival in w["reqs"]:
        req = make_request(req_id, prompt, max_tokens, w["max_model_len"])
        arrivals.setdefault(arrival, []).append(req)
        targets[req_id] = eos_at
        expected_len[req_id] = min(eos_at, req.max_num_tokens - prompt)
    finished, stats = run_to_completion(sched, FakeRunner(targets), arrivals, w["block_size"])
    assert set(finished) == set(expected_len)
    for req_id, req in finished.items():
        n = expected_len[req_id]
        assert len(req.output_token_ids) == n
        assert req.output_token_ids == [1000 + k for k in range(1, n)] + (
            [EOS] if n == targets[req_id] else [1000 + n]
        )
        want = (
            RequestStatus.FINISHED_STOPPED
            if n == targets[req_id]
            else RequestStatus.FINISHED_LENGTH_CAPPED
        )
        assert req.status == want
    # Every block is back in the pool.
    assert kv.num_free_blocks == w["num_blocks"]
    assert stats[-1].num_kv_blocks_used == 0


@settings(max_examples=80, deadline=None)
@given(workloads())
def test_static_scheduler_finishes_everything_and_pads(w: dict) -> None:
    kv = KVCacheManager(w["num_blocks"], w["block_size"])
    sched = StaticScheduler(kv, w["max_num_seqs"], w["max_num_batched_tokens"])
    arrivals: dict[int, list[Request]] = {}
    targets = {}
    for req_id, prompt, max_tokens, eos_at, arrival in w["reqs"]:
        req = make_request(req_id, prompt, max_tokens, w["max_model_len"])
        arrivals.setdefault(arrival, []).append(req)
        targets[req_id] = eos_at
    finished, stats = run_to_completion(
        sched, FakeRunner(targets), arrivals, w["block_size"], static=True
    )
    assert set(finished) == set(targets)
    assert kv.num_free_blocks == w["num_blocks"]


def test_finished_request_frees_blocks_same_step_and_waiting_joins_next_step() -> None:
    block_size = 4
    kv = KVCacheManager(num_blocks=64, block_size=block_size)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64)
    a = make_request("a", 8, 3, 100)  # finishes after 3 tokens
    b = make_request("b", 8, 20, 100)
    c = make_request("c", 8, 5, 100)  # waits for a seat
    for r in (a, b, c):
        sched.add_request(r)
    runner = FakeRunner({"a": 99, "b": 99, "c": 99})
    stats = []
    step_a_finished = None
    for step in range(10):
        out = sched.schedule()
        progressed = sched.update_from_output(out, runner.execute(out))
        st_ = sched.make_stats()
        stats.append(st_)
        if any(r.request_id == "a" and r.is_finished for r, _ in progressed):
            step_a_finished = step
            # a's blocks are back in the pool in this same step: only b's blocks are held
            assert "a" in st_.finished_req_ids
            assert "a" not in kv.req_to_block_ids
            assert st_.num_kv_blocks_used == len(kv.get_block_ids("b"))
            assert st_.num_waiting == 1
    assert step_a_finished is not None
    # ... and c is running in the very next step
    assert stats[step_a_finished + 1].admitted_req_ids == ["c"]
    assert "c" in stats[step_a_finished + 1].scheduled_req_ids


def test_chunked_prefill_keeps_decodes_running() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=8)
    short = make_request("short", 4, 30, 200)
    sched.add_request(short)
    runner = FakeRunner({"short": 99, "long": 99})
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    sched.add_request(make_request("long", 40, 5, 200))
    chunks = []
    for _ in range(6):
        out = sched.schedule()
        by_id = {s.req_id: s for s in out.scheduled}
        assert by_id["short"].num_new_tokens == 1, "the decode stalled behind a prefill"
        if "long" in by_id:
            chunks.append(by_id["long"].num_new_tokens)
            assert by_id["long"].sample == (
                by_id["long"].num_computed_tokens + by_id["long"].num_new_tokens == 40
            )
        sched.update_from_output(out, runner.execute(out))
    assert chunks[:5] == [7, 7, 7, 7, 7]  # 40-token prompt in 7-token chunks beside one decode


def test_preemption_requeues_most_recent_and_recomputes() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    a = make_request("a", 8, 12, 100)
    b = make_request("b", 8, 12, 100)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner({"a": 99, "b": 99})
    preempted_steps = []
    for step in range(60):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        if out.preempted_req_ids:
            preempted_steps.append((step, out.preempted_req_ids))
        sched.update_from_output(out, runner.execute(out))
    assert not sched.has_unfinished_requests()
    assert preempted_steps and preempted_steps[0][1] == ["b"]  # the most recently admitted
    assert len(a.output_token_ids) == 12 and len(b.output_token_ids) == 12
    assert b.num_preemptions >= 1
    assert kv.num_free_blocks == 6


def test_abort_frees_blocks_immediately() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    sched.add_request(make_request("a", 10, 10, 100))
    out = sched.schedule()
    sched.update_from_output(out, FakeRunner({"a": 99}).execute(out))
    assert kv.num_free_blocks < 16
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 16
    assert not sched.has_unfinished_requests()
    assert sched.schedule().finished_req_ids == ["a"]  # the runner is told to drop its state


def test_static_scheduler_pads_and_holds_blocks_until_batch_ends() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = StaticScheduler(kv, max_num_seqs=2, max_num_batched_tokens=64)
    sched.add_request(make_request("a", 3, 10, 100))
    sched.add_request(make_request("b", 7, 10, 100))
    sched.add_request(make_request("c", 5, 10, 100))
    runner = FakeRunner({"a": 2, "b": 6, "c": 3})
    out = sched.schedule()
    assert [s.req_id for s in out.scheduled] == ["a", "b"]
    assert out.num_padding_tokens == 4  # a's prompt padded from 3 to 7
    # reserved prompt + max_tokens up front: cdiv(13, 4) + cdiv(17, 4) blocks
    assert kv.block_pool.num_used_blocks == 4 + 5
    sched.update_from_output(out, runner.execute(out))
    paddings = []
    while "a" in sched.requests or "b" in sched.requests:
        out = sched.schedule()
        assert all(s.req_id != "c" for s in out.scheduled), "c joined before the batch ended"
        paddings.append(out.num_padding_tokens)
        sched.update_from_output(out, runner.execute(out))
        if "a" not in sched.requests and "b" in sched.requests:
            assert "a" in kv.req_to_block_ids  # a's seat is still reserved
    assert paddings == [0, 1, 1, 1, 1]  # a finished after 2 tokens; b runs to 6
    out = sched.schedule()
    assert [s.req_id for s in out.scheduled] == ["c"]


def test_the_runner_gets_only_new_block_ids_and_the_whole_table_after_a_preemption() -> None:
    from infer8.core.kv_cache_manager import KVCacheManager
    from infer8.core.sched_output import ModelRunnerOutput
    from infer8.core.scheduler import Scheduler
    from infer8.request import Request
    from infer8.sampling_params import SamplingParams

    sched = Scheduler(KVCacheManager(16, 4, enable_caching=False), 4, 64)
    sched.add_request(Request("a", list(range(1, 10)), SamplingParams(max_tokens=20), []))
    sent: list[list[int]] = []
    for _ in range(6):  # the prompt (3 blocks), then decodes filling a 4th block
        out = sched.schedule()
        sent.append(out.scheduled[0].new_block_ids)
        sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"a": 7}))
    assert sent[0] == sched.kv_cache_manager.get_block_ids("a")[:3]
    assert [len(ids) for ids in sent[1:]] == [0, 0, 0, 1, 0]  # 12 tokens fill 3 blocks
    (request,) = sched.running
    held = sched.kv_cache_manager.get_block_ids("a")
    sched._preempt(sched.running.pop(), out)
    assert request.num_preemptions == 1
    out = sched.schedule()  # resumed: the runner dropped its row, so it gets the whole table
    assert out.scheduled[0].new_block_ids == sched.kv_cache_manager.get_block_ids("a")
    assert len(out.scheduled[0].new_block_ids) == len(held)
