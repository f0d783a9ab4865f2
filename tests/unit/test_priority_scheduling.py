"""--scheduling-policy priority as vLLM schedules it: admission by (priority, arrival), the
lowest-priority running request preempted first, a higher-priority arrival preempting a
lower-priority running request for blocks; FCFS as before; the flag, the field, the gauge."""

from __future__ import annotations

import shlex

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from infer8.bench.throughput import bench_engine_args
from infer8.config import CacheConfig, EngineArgs, SchedulerConfig
from infer8.core.kv_cache_manager import KVCacheManager
from infer8.core.request_queue import PriorityRequestQueue, priority_key
from infer8.core.sched_output import ModelRunnerOutput, SchedulerOutput
from infer8.core.scheduler import Scheduler
from infer8.core.static_scheduler import StaticScheduler
from infer8.entrypoints.openai import api_server
from infer8.entrypoints.openai.cli_args import make_serve_parser, serve_args_from
from infer8.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from infer8.entrypoints.openai.vllm_compat import apply_vllm_compat
from infer8.metrics import EngineMetrics
from infer8.request import Request, RequestStatus
from infer8.sampling_params import SamplingParams

EOS = 0
BLOCK_SIZE = 4


def make_request(
    req_id: str, prompt_len: int, max_tokens: int, priority: int, arrival_time_s: float
) -> Request:
    """A request with its own prompt (no prefix hits between requests)."""
    first = 10 + 1000 * (sum(map(ord, req_id)) % 50)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    prompt = list(range(first, first + prompt_len))
    return Request(req_id, prompt, params, [EOS], arrival_time_s, priority=priority)


def step(sched: Scheduler) -> SchedulerOutput:
    """Schedule one step and sample a non-EOS token for every request due one."""
    out = sched.schedule()
    runner_out = ModelRunnerOutput(
        sampled_token_ids={s.req_id: 7 for s in out.scheduled if s.sample}
    )
    sched.update_from_output(out, runner_out)
    return out


def admission_order(policy: str, specs: list[tuple[str, int, float]]) -> list[str]:
    """Queue (id, priority, arrival) requests, run them one at a time (one seat) and return
    the order they were admitted in."""
    sched = Scheduler(KVCacheManager(64, BLOCK_SIZE), 1, 64, policy=policy)
    for req_id, priority, arrival_time_s in specs:
        sched.add_request(make_request(req_id, 4, 2, priority, arrival_time_s))
    order: list[str] = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        order += sched._stats.admitted_req_ids
        sched.update_from_output(
            out, ModelRunnerOutput(sampled_token_ids={s.req_id: EOS for s in out.scheduled})
        )
    return order


# -- the waiting queue -----------------------------------------------------------------------
def test_waiting_order_is_priority_then_arrival() -> None:
    specs = [
        ("late-low", 10, 1.0),
        ("mid-high", 0, 2.0),
        ("early-low", 10, 0.5),
        ("neg", -3, 3.0),
        ("late-high", 0, 4.0),
    ]
    assert admission_order("priority", specs) == [
        "neg", "mid-high", "late-high", "early-low", "late-low",
    ]  # fmt: skip
    # FCFS ignores the field: the order requests were queued in, as before.
    assert admission_order("fcfs", specs) == [req_id for req_id, _, _ in specs]


def test_priority_queue_removal_keeps_order_and_preempted_requests_keep_their_place() -> None:
    queue = PriorityRequestQueue()
    requests = [make_request(f"r{i}", 4, 2, priority=i % 3, arrival_time_s=i) for i in range(9)]
    for request in requests:
        queue.add_request(request)
    queue.remove_request(requests[3])  # priority 0
    queue.remove_request(requests[8])  # priority 2
    expected = sorted(
        (r for r in requests if r not in (requests[3], requests[8])), key=priority_key
    )
    assert list(queue) == expected and len(queue) == 7
    assert queue.num_requests_by_priority() == {0: 2, 1: 3, 2: 2}
    first = queue.pop_request()
    queue.prepend_request(first)  # back under its own key: still first
    assert [queue.pop_request() for _ in range(len(queue))] == expected


def test_aborting_a_waiting_request_under_the_priority_policy() -> None:
    sched = Scheduler(KVCacheManager(8, BLOCK_SIZE), 1, 64, policy="priority")
    for i, priority in enumerate([2, 1, 2]):
        sched.add_request(make_request(f"r{i}", 4, 2, priority, arrival_time_s=i))
    step(sched)  # r1 runs
    assert sched.num_waiting_by_priority() == {2: 2}
    (aborted,) = sched.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)
    assert aborted.request_id == "r0" and [r.request_id for r in sched.waiting] == ["r2"]
    assert sched.num_waiting_by_priority() == {2: 1} and "r0" not in sched.requests


# -- preemption ------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, victim", [("priority", "low"), ("fcfs", "high")])
def test_preemption_picks_the_lowest_priority_running_request(policy: str, victim: str) -> None:
    """`low` (priority 5) is admitted before `high` (priority 0); both grow until the four
    blocks run out. FCFS preempts the most recently admitted (high), priority the lowest (low).
    """
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, policy=policy)
    low = make_request("low", 4, 20, priority=5, arrival_time_s=0.0)
    high = make_request("high", 4, 20, priority=0, arrival_time_s=1.0)
    sched.add_request(low)
    step(sched)
    sched.add_request(high)
    for _ in range(10):
        out = step(sched)
        if out.preempted_req_ids:
            break
    assert out.preempted_req_ids == [victim]
    survivor = "high" if victim == "low" else "low"
    assert [r.request_id for r in sched.running] == [survivor]
    assert [s.req_id for s in out.scheduled] == [survivor]
    assert [r.request_id for r in sched.waiting] == [victim]


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_high_priority_arrival_preempts_low_priority_running_when_cache_is_full(
    policy: str,
) -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, policy=policy)
    low_priority = 10 if policy == "priority" else 0
    low1 = make_request("low1", 6, 6, priority=low_priority, arrival_time_s=0.0)
    low2 = make_request("low2", 6, 6, priority=low_priority, arrival_time_s=1.0)
    sched.add_request(low1)
    sched.add_request(low2)
    step(sched)
    assert kv.num_free_blocks == 0  # two blocks each; both fit their next token
    high = make_request("high", 4, 3, priority=0, arrival_time_s=2.0)
    sched.add_request(high)
    out = step(sched)
    scheduled = {s.req_id for s in out.scheduled}
    if policy == "fcfs":
        assert out.preempted_req_ids == [] and scheduled == {"low1", "low2"}
        assert list(sched.waiting) == [high]
        return
    # the later of the two lowest-priority requests makes room; high joins in the same step
    assert out.preempted_req_ids == ["low2"]
    assert scheduled == {"low1", "high"} and list(sched.waiting) == [low2]
    finish_order = []
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        before = set(sched.requests)
        step(sched)
        finish_order += sorted(before - set(sched.requests))
    assert finish_order[0] == "high" and set(finish_order) == {"high", "low1", "low2"}
    assert kv.num_free_blocks == 4


def test_a_request_preempted_for_an_arrival_does_not_rejoin_in_the_same_step() -> None:
    # Without prefix caching and with a 12-token budget, `low` (3 of the 4 blocks, its next
    # token needs the 4th) is preempted for `high` (2 blocks); the 2 blocks left would take a
    # 4-token chunk of its recomputation, but it waits for the next step.
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, enable_caching=False)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=12, policy="priority")
    sched.add_request(make_request("low", 12, 4, priority=10, arrival_time_s=0.0))
    step(sched)
    sched.add_request(make_request("high", 8, 2, priority=0, arrival_time_s=1.0))
    out = step(sched)
    assert out.preempted_req_ids == ["low"]
    assert [(s.req_id, s.num_new_tokens) for s in out.scheduled] == [("high", 8)]
    assert kv.num_free_blocks == 2 and [r.request_id for r in sched.waiting] == ["low"]


def test_equal_or_higher_priority_running_requests_are_not_preempted_for_arrivals() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, policy="priority")
    sched.add_request(make_request("a", 6, 12, priority=1, arrival_time_s=0.0))
    sched.add_request(make_request("b", 6, 12, priority=1, arrival_time_s=1.0))
    step(sched)
    sched.add_request(make_request("c", 4, 3, priority=1, arrival_time_s=2.0))
    out = step(sched)
    assert out.preempted_req_ids == [] and [r.request_id for r in sched.waiting] == ["c"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.integers(1, 14),  # prompt tokens
            st.integers(1, 10),  # output tokens
            st.integers(-2, 3),  # priority
            st.integers(0, 12),  # arrival step
        ),
        min_size=1,
        max_size=12,
    ),
    st.integers(6, 12),  # blocks: room for the longest request (24 tokens) at least
    st.integers(1, 4),  # seats
    st.integers(4, 32),  # token budget
)
def test_priority_policy_finishes_everything_and_preempts_only_lower_priority(
    specs: list[tuple[int, int, int, int]],
    num_blocks: int,
    max_num_seqs: int,
    token_budget: int,
) -> None:
    kv = KVCacheManager(num_blocks, BLOCK_SIZE)
    sched = Scheduler(kv, max_num_seqs, token_budget, policy="priority")
    arrivals: dict[int, list[Request]] = {}
    requests = []
    for i, (prompt_len, num_out, priority, at_step) in enumerate(specs):
        requests.append(make_request(f"r{i}", prompt_len, num_out, priority, arrival_time_s=i))
        arrivals.setdefault(at_step, []).append(requests[-1])
    for step_index in range(2000):
        for request in arrivals.pop(step_index, []):
            sched.add_request(request)
        if not arrivals and not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        assert [priority_key(r) for r in sched.running] == sorted(map(priority_key, sched.running))
        running_keys = [priority_key(r) for r in sched.running]
        for req_id in out.preempted_req_ids:
            victim = next(r for r in sched.waiting if r.request_id == req_id)
            # every request still running outranks every request preempted this step
            assert all(key < priority_key(victim) for key in running_keys)
            assert req_id not in {s.req_id for s in out.scheduled}
        holders = [b for ids in kv.req_to_block_ids.values() for b in ids]
        assert len(set(holders)) == kv.block_pool.num_used_blocks <= num_blocks
        sampled = {s.req_id: 7 for s in out.scheduled if s.sample}
        sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
    assert not sched.has_unfinished_requests() and not arrivals
    assert [len(r.output_token_ids) for r in requests] == [num_out for _, num_out, _, _ in specs]
    assert kv.num_free_blocks == num_blocks


def test_static_scheduler_takes_no_priority_policy() -> None:
    with pytest.raises(AssertionError, match="arrival order"):
        StaticScheduler(KVCacheManager(8, BLOCK_SIZE), 2, 64, policy="priority")


# -- configuration and flags -------------------------------------------------------------------
def test_scheduling_policy_flag_reaches_the_scheduler_config() -> None:
    ns = make_serve_parser().parse_args(shlex.split("/models/m --scheduling-policy priority"))
    engine_args, _ = serve_args_from(ns)
    assert engine_args.scheduling_policy == "priority"
    assert apply_vllm_compat(ns) == ({}, [])  # no longer a refused vLLM flag
    _, _, scheduler_config = engine_args.create_configs("/models/m")
    assert scheduler_config.policy == "priority"
    default_args, _ = serve_args_from(make_serve_parser().parse_args(["/models/m"]))
    assert default_args.scheduling_policy == "fcfs" == EngineArgs().scheduling_policy
    assert "--scheduling-policy {fcfs,priority}" in make_serve_parser().format_help()


@pytest.mark.parametrize(
    "flags, words",
    [
        ("--scheduling-policy lifo", ["fcfs", "priority"]),
        ("--scheduler static --scheduling-policy priority", ["continuous scheduler", "static"]),
    ],
)
def test_bad_scheduling_policy_stops_before_loading(
    flags: str, words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        api_server.main(["--model=/does/not/matter", *shlex.split(flags)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words) and len(err.strip().splitlines()) == 1, err


def test_bench_groups_of_the_static_baseline_run_fcfs() -> None:
    args = EngineArgs(scheduling_policy="priority")
    assert bench_engine_args(args, scheduler="static").scheduling_policy == "fcfs"
    assert bench_engine_args(args, scheduler="continuous").scheduling_policy == "priority"


def test_scheduler_config_validates_the_policy() -> None:
    assert SchedulerConfig(policy="priority").policy == "priority"
    with pytest.raises(ValueError, match="fcfs or priority"):
        SchedulerConfig(policy="lifo")
    with pytest.raises(ValueError, match="continuous scheduler"):
        SchedulerConfig(scheduler="static", policy="priority")
    assert SchedulerConfig(scheduler="static").policy == "fcfs"


def test_request_priority_field_is_vllms() -> None:
    assert CompletionRequest.model_validate({"prompt": "x"}).priority == 0
    assert CompletionRequest.model_validate({"prompt": "x", "priority": -5}).priority == -5
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "priority": 3}
    )
    assert chat.priority == 3
    for bad in ("1", 1.5, True, 2**63):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"prompt": "x", "priority": bad})


# -- metrics -----------------------------------------------------------------------------------
def _waiting_by_priority(metrics: EngineMetrics) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    return {
        s.labels["priority"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "infer8:num_requests_waiting_by_priority"
    }


def test_waiting_by_priority_gauge_follows_the_queue_and_drops_empty_priorities() -> None:
    metrics = EngineMetrics("m", CacheConfig(), num_blocks=8)
    assert _waiting_by_priority(metrics) == {"0": 0.0}
    metrics.set_waiting_by_priority({0: 2, 5: 3, -1: 1})
    assert _waiting_by_priority(metrics) == {"0": 2.0, "5": 3.0, "-1": 1.0}
    metrics.set_waiting_by_priority({5: 1})
    assert _waiting_by_priority(metrics) == {"0": 0.0, "5": 1.0}
    sched = Scheduler(KVCacheManager(8, BLOCK_SIZE), 1, 64, policy="priority")
    for i, priority in enumerate([3, 3, 0, 7]):
        sched.add_request(make_request(f"r{i}", 4, 2, priority, arrival_time_s=i))
    step(sched)  # r2 (priority 0) runs
    metrics.set_waiting_by_priority(sched.num_waiting_by_priority())
    assert _waiting_by_priority(metrics) == {"0": 0.0, "3": 2.0, "7": 1.0}
