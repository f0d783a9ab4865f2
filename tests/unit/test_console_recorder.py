"""The console's step-record stream: record format, rate limiting, no work and no leak without viewers."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from infer8.attention.kv_cache import KVCacheSpec
from infer8.config import CacheConfig
from infer8.core.kv_cache_manager import KVCacheManager
from infer8.core.sched_output import SchedulerStats
from infer8.core.scheduler import Scheduler
from infer8.entrypoints.console import StepRecorder, add_console_routes
from infer8.entrypoints.console.recorder import MAX_QUEUED_RECORDS, RequestLatencies
from infer8.entrypoints.console.snapshot import (
    CELL_CACHED,
    CELL_FIRST_OWNER,
    CELL_FREE,
    CELL_SHARED,
    MAX_MAP_CELLS,
    aggregate_cells,
    histogram_quantile,
    metric_figures,
    sample_quantiles,
    served_defaults,
)
from infer8.metrics import EngineMetrics
from infer8.request import Request
from infer8.sampling_params import SamplingParams
from infer8.spec_decode.speculator import SpecDecodeStats

BLOCK_SIZE = 4
NUM_BLOCKS = 16


class FakeEngine:
    """The parts of LLMEngine the recorder reads: block tables, scheduler queues, cache spec."""

    def __init__(
        self, kv_dtype: torch.dtype = torch.bfloat16, num_blocks: int = NUM_BLOCKS
    ) -> None:
        self.kv_cache_manager = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=True)
        self.scheduler = SimpleNamespace(requests={}, running=[], waiting=[])
        self.kv_spec = KVCacheSpec(2, 1, 8, BLOCK_SIZE, kv_dtype)
        self.cache_config = CacheConfig(block_size=BLOCK_SIZE)
        self.num_blocks = num_blocks
        self.kv_scale_source = "none"
        self.model_config = SimpleNamespace(served_model_name="fake", model="fake")
        self.served_model_name = "fake"
        self.default_sampling: dict[str, Any] = {}
        self.scheduler_config = SimpleNamespace(
            max_num_seqs=4, max_num_batched_tokens=64, policy="fcfs"
        )
        self.max_model_len = 64
        self.last_stats = SchedulerStats()

    def add(self, req_id: str, token_ids: list[int], num_computed: int) -> Request:
        request = Request(req_id, token_ids, SamplingParams(max_tokens=8), [0])
        self.scheduler.requests[req_id] = request
        self.scheduler.running.append(request)
        assert self.kv_cache_manager.allocate_slots(request, num_computed) is not None
        request.num_computed_tokens = num_computed
        return request

    def kv_saturation_counts(self) -> list[int]:
        return [3, 0]


class UntouchableEngine:
    """An engine that fails the test if the recorder reads anything from it."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the recorder read engine.{name} with no viewer connected")


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _stats(
    num_running: int = 1,
    num_tokens: int = 1,
    req_ids: tuple[str, ...] = (),
    step_time_s: float = 0.02,
) -> SchedulerStats:
    return SchedulerStats(
        num_running=num_running,
        num_scheduled_tokens=num_tokens,
        step_time_s=step_time_s,
        scheduled_req_ids=list(req_ids),
    )


def _parse(text: str) -> tuple[str, dict[str, Any]]:
    lines = text.strip().split("\n")
    assert lines[0].startswith("event: ") and lines[1].startswith("data: ")
    return lines[0][7:], json.loads(lines[1][6:])


async def _open(recorder: StepRecorder) -> tuple[AsyncIterator[str], dict[str, Any]]:
    """Connect one viewer; return its stream after the info and first step events."""
    stream = recorder.stream(heartbeat_s=60)
    name, info = _parse(await stream.__anext__())
    assert name == "info"
    name, _ = _parse(await stream.__anext__())
    assert name == "step"
    return stream, info


async def _queued(recorder: StepRecorder) -> list[dict[str, Any]]:
    """Return the step records the viewers were handed so far (after the loop ran its callbacks)."""
    await asyncio.sleep(0)
    (viewer,) = recorder._viewers
    records = [_parse(text)[1] for text in viewer.events]
    viewer.events.clear()
    return records


def test_step_record_has_counts_and_a_block_map_of_owners_cached_and_shared() -> None:
    async def run() -> None:
        engine = FakeEngine()
        recorder = StepRecorder(engine, clock=Clock())
        stream, info = await _open(recorder)
        assert info["num_blocks"] == NUM_BLOCKS and info["capacity_tokens"] == 64
        kv = engine.kv_cache_manager
        # Request a: 8 prompt tokens (2 full blocks, cached), now decoding its 9th token.
        a = engine.add("a", list(range(1, 9)), 8)
        a.append_output_token(50)
        a.num_computed_tokens = 9
        kv.allocate_slots(a, 9)
        # Request b shares a's first block (a cached prefix hit) and is prefilling.
        b = Request("b", [1, 2, 3, 4, 7, 7], SamplingParams(max_tokens=8), [0])
        hits, _ = kv.get_computed_blocks(b)
        assert len(hits) == 1
        engine.scheduler.requests["b"] = b
        kv.allocate_slots(b, 6, hits)
        b.num_computed_tokens = 6
        # Request c came and went: its full block stays cached but free.
        c = engine.add("c", [9, 9, 9, 9, 9], 5)
        kv.free("c")
        del engine.scheduler.requests["c"]
        engine.scheduler.running.remove(c)

        recorder.on_step(_stats(num_running=2, num_tokens=1 + 2, req_ids=("a", "b")))
        (record,) = await _queued(recorder)
        assert record["running"] == 2 and record["waiting"] == 0
        assert record["decode_tokens"] == 1 and record["prefill_tokens"] == 2
        assert record["steps"] == 1 and record["step_ms"] == 20.0
        cells = list(base64.b64decode(record["kv"]))
        assert len(cells) == NUM_BLOCKS
        a_blocks, b_blocks = kv.get_block_ids("a"), kv.get_block_ids("b")
        assert cells[a_blocks[0]] == CELL_SHARED  # held by a and b
        slots = {req_id: slot for slot, req_id, *_ in record["reqs"]}
        assert {cells[i] for i in a_blocks[1:]} == {CELL_FIRST_OWNER + slots["a"]}
        assert {cells[i] for i in b_blocks[1:]} == {CELL_FIRST_OWNER + slots["b"]}
        assert slots["a"] != slots["b"]
        assert cells.count(CELL_CACHED) == 1  # c's full block
        assert record["kv_used"] == NUM_BLOCKS - kv.num_free_blocks
        assert cells.count(CELL_FREE) == NUM_BLOCKS - record["kv_used"] - 1
        assert ["a", 8, 1, len(a_blocks)] == next(r[1:] for r in record["reqs"] if r[1] == "a")
        assert "saturated" not in record  # a bf16 cache clips nothing
        await stream.aclose()

    asyncio.run(run())


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_step_record_has_the_waiting_queue_by_priority_under_the_priority_policy(
    policy: str,
) -> None:
    async def run() -> None:
        engine = FakeEngine()
        engine.scheduler_config.policy = policy
        engine.scheduler = Scheduler(engine.kv_cache_manager, 4, 64, policy=policy)
        for i, priority in enumerate([3, 0, 3]):
            params = SamplingParams(max_tokens=2)
            request = Request(f"r{i}", [1, 2], params, [0], priority=priority)
            engine.scheduler.add_request(request)
        recorder = StepRecorder(engine, clock=Clock())
        await _open(recorder)
        recorder.on_step(_stats(num_running=0))
        (record,) = await _queued(recorder)
        if policy == "priority":
            assert record["waiting_by_priority"] == [[0, 1], [3, 2]]
        else:
            assert "waiting_by_priority" not in record

    asyncio.run(run())


def test_records_are_at_most_one_per_100_ms_and_sum_the_steps_between() -> None:
    async def run() -> None:
        engine, clock = FakeEngine(), Clock()
        recorder = StepRecorder(engine, clock=clock)
        stream, _ = await _open(recorder)
        engine.add("a", [1, 2, 3], 3)
        published = []
        for i in range(10):  # a step every 30 ms for 300 ms
            clock.now_s = 100.0 + 0.03 * i
            recorder.on_step(_stats(num_tokens=2))
            published.append(len(await _queued(recorder)))
        # t = 0, 0.12, 0.24: one record per 100 ms at most, never more than one per step.
        assert published == [1, 0, 0, 0, 1, 0, 0, 0, 1, 0]
        clock.now_s += 0.2
        recorder.on_step(_stats(num_tokens=2))
        (record,) = await _queued(recorder)
        assert record["steps"] == 2 and record["prefill_tokens"] + record["decode_tokens"] == 4
        await stream.aclose()

    asyncio.run(run())


def test_the_step_that_drains_the_batch_and_an_abort_while_idle_are_always_shown() -> None:
    async def run() -> None:
        engine, clock = FakeEngine(), Clock()
        recorder = StepRecorder(engine, clock=clock)
        stream, _ = await _open(recorder)
        engine.add("a", [1, 2, 3], 3)
        recorder.on_step(_stats(num_running=1))
        assert len(await _queued(recorder)) == 1
        clock.now_s += 0.01
        recorder.on_step(_stats(num_running=0))  # the last request finished: shown at once
        (record,) = await _queued(recorder)
        assert record["running"] == 0
        recorder.on_idle()  # nothing changed since: nothing sent
        assert await _queued(recorder) == []
        clock.now_s += 0.01
        recorder.on_step(_stats(num_running=1))
        assert await _queued(recorder) == []  # within 100 ms of the last record
        kv_before = engine.kv_cache_manager.block_pool.num_used_blocks
        engine.kv_cache_manager.free("a")  # aborted between steps; the engine goes idle
        recorder.on_idle()
        (record,) = await _queued(recorder)
        assert record["running"] == 0 and record["kv_used"] == 0 < kv_before
        await stream.aclose()

    asyncio.run(run())


def test_records_of_one_slow_step_each_carry_rates_over_the_recent_steps() -> None:
    async def run() -> None:
        engine, clock = FakeEngine(), Clock()
        recorder = StepRecorder(engine, clock=clock)
        stream, _ = await _open(recorder)
        for req_id, prompt in (("a", [1, 2, 3]), ("b", [4, 5, 6])):
            engine.add(req_id, prompt, 3).num_computed_tokens = 4  # decoding
        records = []
        for i in range(12):  # 2 requests decoding, a 0.25 s step each: 8 tokens/s
            clock.now_s = 100.0 + 0.25 * (i + 1)
            recorder.on_step(_stats(num_running=2, num_tokens=2, req_ids=("a", "b"),
                                    step_time_s=0.25))  # fmt: skip
            records += await _queued(recorder)
        assert [r["steps"] for r in records] == [1] * 12  # each record holds a single step
        last = records[-1]
        assert last["decode_tokens_per_s"] == pytest.approx(8.0, abs=0.1)
        assert last["prefill_tokens_per_s"] == 0.0
        assert last["steps_per_s"] == pytest.approx(4.0, abs=0.1)
        assert last["mean_step_ms"] == 250.0
        clock.now_s += 0.25
        recorder.on_step(_stats(num_running=0, num_tokens=2, req_ids=("a", "b"), step_time_s=0.25))
        (idle,) = await _queued(recorder)  # the batch drained: the engine does nothing now
        assert idle["decode_tokens_per_s"] == 0.0 and idle["mean_step_ms"] is None
        await stream.aclose()

    asyncio.run(run())


def test_a_large_cache_is_sent_as_cells_of_several_blocks_showing_every_held_block() -> None:
    async def run() -> None:
        num_blocks = 22_487
        engine = FakeEngine(num_blocks=num_blocks)
        recorder = StepRecorder(engine, clock=Clock())
        stream, _ = await _open(recorder)
        kv = engine.kv_cache_manager
        engine.add("a", list(range(1, 9)), 8)  # 2 blocks
        engine.add("b", list(range(20, 23)), 3)  # 1 block
        recorder.on_step(_stats(num_running=2, num_tokens=11, req_ids=("a", "b")))
        (record,) = await _queued(recorder)
        cells = list(base64.b64decode(record["kv"]))
        num_cell_blocks = record["kv_cell_blocks"]
        assert num_cell_blocks == 6 and len(cells) == 3748 <= MAX_MAP_CELLS  # ceil(22,487 / 6)
        assert record["kv_total"] == num_blocks and record["kv_used"] == 3  # exact counts
        slots = {req_id: slot for slot, req_id, *_ in record["reqs"]}
        cell_to_holders: dict[int, set[int]] = {}
        for req_id in ("a", "b"):
            for block_id in kv.get_block_ids(req_id):
                holder = CELL_FIRST_OWNER + slots[req_id]
                cell_to_holders.setdefault(block_id // num_cell_blocks, set()).add(holder)
        # Every held block shows in its cell, in the colour of a request holding blocks there.
        assert all(cells[i] in holders for i, holders in cell_to_holders.items())
        assert all(c == CELL_FREE for i, c in enumerate(cells) if i not in cell_to_holders)
        await stream.aclose()

    asyncio.run(run())


def test_aggregated_cells_show_the_most_frequent_holder_then_cached_then_free() -> None:
    owner_a, owner_b = CELL_FIRST_OWNER, CELL_FIRST_OWNER + 1
    blocks = np.array(
        [CELL_FREE, CELL_FREE, CELL_FREE]  # all free
        + [CELL_CACHED, CELL_FREE, CELL_FREE]  # a cached prefix among free blocks
        + [CELL_FREE, owner_a, CELL_CACHED]  # one held block is never hidden
        + [owner_a, owner_b, owner_b]  # the most frequent holder wins
        + [CELL_SHARED, CELL_SHARED, owner_b]  # shared counts as a holder
        + [owner_a],  # a last, partial cell
        dtype=np.uint8,
    )
    cells = aggregate_cells(blocks, 3)
    assert cells.tolist() == [CELL_FREE, CELL_CACHED, owner_a, owner_b, CELL_SHARED, owner_a]
    assert aggregate_cells(blocks, 1) is blocks  # a small cache: one cell per block


def test_fp8_records_carry_per_layer_saturation_once_a_second() -> None:
    async def run() -> None:
        engine, clock = FakeEngine(torch.float8_e4m3fn), Clock()
        recorder = StepRecorder(engine, clock=clock)
        stream, info = await _open(recorder)
        assert info["is_fp8"] and info["bf16_capacity_tokens"] < info["capacity_tokens"]
        with_saturation = []
        for i in range(12):
            clock.now_s = 100.0 + 0.2 * i
            recorder.on_step(_stats())
            (record,) = await _queued(recorder)
            with_saturation.append("saturated" in record)
            if "saturated" in record:
                assert record["saturated"] == [3, 0]
        assert sum(with_saturation) == 2  # the record sent at connect had them; then once a second
        await stream.aclose()

    asyncio.run(run())


def test_without_viewers_the_recorder_reads_nothing_and_queues_nothing() -> None:
    recorder = StepRecorder(UntouchableEngine())  # type: ignore[arg-type]
    for _ in range(1000):
        recorder.on_step(_stats())
        recorder.on_idle()
    assert recorder.num_viewers == 0


def test_a_closed_viewer_is_forgotten_and_the_engine_is_left_alone_again() -> None:
    async def run() -> None:
        engine = FakeEngine()
        recorder = StepRecorder(engine, clock=Clock())
        first, _ = await _open(recorder)
        second, _ = await _open(recorder)
        assert recorder.num_viewers == 2
        await first.aclose()
        assert recorder.num_viewers == 1
        await second.aclose()
        assert recorder.num_viewers == 0 and not recorder._viewers
        recorder.engine = UntouchableEngine()  # type: ignore[assignment]
        recorder.on_step(_stats())
        recorder.on_idle()

    asyncio.run(run())


def test_a_viewer_that_never_reads_holds_a_bounded_queue() -> None:
    async def run() -> None:
        engine, clock = FakeEngine(), Clock()
        recorder = StepRecorder(engine, clock=clock)
        stream, _ = await _open(recorder)
        for _ in range(500):
            clock.now_s += 0.2
            recorder.on_step(_stats())
        await asyncio.sleep(0)
        (viewer,) = recorder._viewers
        assert len(viewer.events) == MAX_QUEUED_RECORDS
        assert _parse(viewer.events[-1])[1]["seq"] == 501  # the newest are kept
        await stream.aclose()

    asyncio.run(run())


def test_the_http_stream_unregisters_its_viewer_when_the_client_disconnects() -> None:
    async def run() -> None:
        recorder = StepRecorder(FakeEngine(), clock=Clock())  # type: ignore[arg-type]
        app = FastAPI()
        add_console_routes(app, recorder)
        disconnect = asyncio.Event()
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            await disconnect.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": "1.1",
            "method": "GET",
            "scheme": "http",
            "path": "/console/api/events",
            "raw_path": b"/console/api/events",
            "root_path": "",
            "query_string": b"",
            "headers": [],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
        }
        task = asyncio.create_task(app(scope, receive, send))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if recorder.num_viewers == 1 and len(sent) >= 3:
                break
        assert recorder.num_viewers == 1
        assert sent[0]["status"] == 200
        assert dict(sent[0]["headers"])[b"content-type"].startswith(b"text/event-stream")
        assert b"event: info" in sent[1]["body"]
        disconnect.set()
        await asyncio.wait_for(task, 5)
        assert recorder.num_viewers == 0 and not recorder._viewers

    asyncio.run(run())


def test_served_defaults_are_what_a_request_without_sampling_fields_gets() -> None:
    engine = FakeEngine()
    engine.default_sampling = {"temperature": 0.2, "top_k": 40}  # the model's generation config
    defaults = served_defaults(engine)  # type: ignore[arg-type]
    assert defaults["model"] == "fake" and defaults["max_model_len"] == 64
    # The model's values, and the API's own where the model sets none.
    assert defaults["sampling"] == {
        "temperature": 0.2,
        "top_p": 1.0,
        "top_k": 40,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }
    assert defaults["generation_config"] == {"temperature": 0.2, "top_k": 40}


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    bounds = [0.1, 0.5, 1.0, float("inf")]
    assert histogram_quantile(0.5, bounds, [0, 0, 0, 0]) is None
    assert histogram_quantile(0.5, bounds, [10, 10, 10, 10]) == pytest.approx(0.05)
    assert histogram_quantile(0.5, bounds, [0, 10, 10, 10]) == pytest.approx(0.3)
    assert histogram_quantile(0.99, bounds, [0, 0, 5, 10]) == 1.0  # in +Inf: the last bound


def test_metric_figures_read_the_server_registry() -> None:
    metrics = EngineMetrics("m", CacheConfig(), 16, CollectorRegistry())
    for itl_s in (0.02, 0.02, 0.3, 0.3):
        metrics.on_next_tokens(itl_s)
    metrics.on_first_token(0.5, 10)
    metrics.prefix_cache_queries.inc(100)
    metrics.prefix_cache_hits.inc(25)
    metrics.on_finished("stop", 1.0)
    figures = metric_figures(metrics.registry)
    bounds = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3]
    expected = histogram_quantile(0.5, bounds, [0, 2, 2, 2, 2, 2, 2, 4])
    assert figures["tpot_s"][0] == pytest.approx(expected)
    assert figures["prefix_cache_hit_rate"] == 0.25
    assert figures["spec_decode_acceptance_rate"] is None  # speculation off: no card figure
    assert figures["finished"]["stop"] == 1.0
    spec = SpecDecodeStats()
    spec.record(5, 3)
    spec.record(4, 0)
    metrics.on_step(SchedulerStats(spec_decode=spec))
    figures = metric_figures(metrics.registry)
    assert figures["spec_decode_acceptance_rate"] == pytest.approx(3 / 9)
    # TTFT and end to end come from the recorder, over the same finished requests.
    assert "ttft_s" not in figures and "e2e_s" not in figures


def _arrive(engine: FakeEngine, req_id: str, arrival_time_s: float) -> Request:
    """Queue a request (no blocks: the latency figures read only its times and tokens)."""
    request = Request(req_id, [1, 2, 3], SamplingParams(max_tokens=8), [0], arrival_time_s)
    engine.scheduler.requests[req_id] = request
    return request


def _run_step(
    requests: dict[str, Request], scheduled: list[str], finished: list[str]
) -> SchedulerStats:
    """Apply one step to `requests`: each scheduled request gets a token, `finished` leave.

    A scheduled request without a token yet is admitted (its prompt fits one step).
    """
    admitted = [r for r in scheduled if not requests[r].output_token_ids]
    for req_id in scheduled:
        requests[req_id].append_output_token(7)
    for req_id in finished:
        del requests[req_id]
    return SchedulerStats(
        num_running=len(requests),
        num_scheduled_tokens=len(scheduled),
        scheduled_req_ids=scheduled,
        admitted_req_ids=admitted,
        finished_req_ids=finished,
    )


def test_ttft_and_end_to_end_percentiles_cover_the_same_finished_requests() -> None:
    """Two requests finished fast, five queued long and still decoding: /metrics' TTFT
    histogram holds all seven (p50 in the 5-7.5 s bucket), its end-to-end one the two (3.75 s),
    which showed a TTFT p50 above the end-to-end p50. Over the same requests it cannot be."""

    async def run() -> None:
        engine, clock = FakeEngine(), Clock()
        metrics = EngineMetrics("m", CacheConfig(), NUM_BLOCKS, CollectorRegistry())
        recorder = StepRecorder(engine, metrics, clock=clock)  # type: ignore[arg-type]
        requests = engine.scheduler.requests
        stream, _ = await _open(recorder)
        ids = ["a", "b", "c", "d", "e", "f", "g"]
        for req_id in ids:
            _arrive(engine, req_id, arrival_time_s=100.0)
        clock.now_s = 100.5  # a and b get their first token; the rest wait
        recorder.on_step(_run_step(requests, ["a", "b"], []))
        for _ in "ab":
            metrics.on_first_token(0.5, 3)  # what the async engine observes
        clock.now_s = 103.7  # a and b finish
        recorder.on_step(_run_step(requests, ["a", "b"], ["a", "b"]))
        for _ in "ab":
            metrics.on_finished("stop", 3.7)
        clock.now_s = 105.7  # the other five get their first token and keep decoding
        recorder.on_step(_run_step(requests, ids[2:], []))
        for _ in ids[2:]:
            metrics.on_first_token(5.7, 3)
        name, figures = _parse(await stream.__anext__())
        assert name == "metrics"
        assert all(t <= e for t, e in zip(figures["ttft_s"], figures["e2e_s"], strict=True))
        assert figures["latency_requests"] == 2
        assert figures["ttft_s"] == pytest.approx([0.5, 0.5, 0.5])
        assert figures["e2e_s"] == pytest.approx([3.7, 3.7, 3.7])
        await stream.aclose()

    asyncio.run(run())


def test_latency_percentiles_never_put_ttft_above_end_to_end() -> None:
    rng = np.random.default_rng(0)
    engine, latencies = FakeEngine(), RequestLatencies()
    requests = engine.scheduler.requests
    truth: list[tuple[float, float]] = []
    first_token_s: dict[str, float] = {}
    now_s = 0.0
    for i in range(400):  # a step each; requests arrive, get a first token, decode, finish
        now_s += float(rng.uniform(0.01, 0.5))
        for _ in range(int(rng.integers(0, 3))):
            _arrive(engine, f"r{i}-{len(requests)}", now_s - float(rng.uniform(0, 0.01)))
        scheduled = [r for r in requests if rng.random() < 0.7]
        finished = [r for r in scheduled if requests[r].output_token_ids and rng.random() < 0.1]
        for req_id in scheduled:
            first_token_s.setdefault(req_id, now_s)
        for req_id in finished:
            arrival_s = requests[req_id].arrival_time_s
            truth.append((first_token_s[req_id] - arrival_s, now_s - arrival_s))
        latencies.on_step(requests, _run_step(requests, scheduled, finished), now_s)
    figures = latencies.figures()
    assert figures["latency_requests"] == len(truth) > 50
    assert figures["ttft_s"] == pytest.approx(sample_quantiles([t for t, _ in truth]))
    assert figures["e2e_s"] == pytest.approx(sample_quantiles([e for _, e in truth]))
    assert all(t <= e for t, e in zip(figures["ttft_s"], figures["e2e_s"], strict=True))


def test_latencies_count_only_requests_whose_first_token_the_view_saw() -> None:
    engine, latencies = FakeEngine(), RequestLatencies()
    requests = engine.scheduler.requests
    _arrive(engine, "decoding", 0.0).append_output_token(7)  # a token before watching began
    _arrive(engine, "waiting", 1.0)
    _arrive(engine, "aborted", 2.0)
    _arrive(engine, "admitted", 2.5)
    # The first step watched: "admitted" gets its first token in it, "decoding" its second.
    latencies.on_step(requests, _run_step(requests, ["admitted", "decoding"], []), 3.0)
    latencies.on_step(requests, _run_step(requests, ["waiting", "decoding"], ["decoding"]), 4.0)
    latencies.on_step(requests, _run_step(requests, [], ["aborted"]), 5.0)  # without a token
    assert latencies.figures()["latency_requests"] == 0
    latencies.on_step(requests, _run_step(requests, ["waiting"], ["waiting"]), 6.0)
    latencies.on_step(requests, _run_step(requests, ["admitted"], ["admitted"]), 7.0)
    assert latencies.figures() == {
        "ttft_s": pytest.approx([1.75, 2.75, 2.975]),  # of 0.5 and 3.0 s
        "e2e_s": pytest.approx([4.75, 4.95, 4.995]),  # of 4.5 and 5.0 s
        "latency_requests": 2,
    }
    latencies.restart()  # watching again: requests in flight with a token are not counted
    _arrive(engine, "late", 8.0).append_output_token(7)
    latencies.on_step(requests, _run_step(requests, ["late"], ["late"]), 9.0)
    assert latencies.figures()["latency_requests"] == 2
    assert sample_quantiles([]) == [None, None, None]


def test_close_ends_every_open_stream_so_shutdown_need_not_wait() -> None:
    async def run() -> None:
        recorder = StepRecorder(FakeEngine(), clock=Clock())  # type: ignore[arg-type]
        stream, _ = await _open(recorder)
        await stream.__anext__()  # the first metrics event (or keep-alive)
        recorder.close()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(stream.__anext__(), 5)
        assert recorder.num_viewers == 0

    asyncio.run(run())
