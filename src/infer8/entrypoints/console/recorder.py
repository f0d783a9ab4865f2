"""StepRecorder: compact engine-step records for the console, fanned out to streaming viewers.

With API keys, a viewer sees its own tenant's requests by id and every other key's as one
anonymous row (and one colour in the block map): request ids and per-request token counts are
what another tenant must not learn. Totals (running, tokens, cache use) stay, as on /metrics.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from infer8.core.sched_output import SchedulerStats
from infer8.entrypoints.console import snapshot
from infer8.entrypoints.console.rates import StepSample, StepWindow, idle_rates

if TYPE_CHECKING:
    from infer8.engine import LLMEngine
    from infer8.metrics import EngineMetrics
    from infer8.request import Request

logger = logging.getLogger(__name__)

# At most one record per engine step or per this interval, whichever is rarer.
MIN_RECORD_INTERVAL_S = 0.1
# FP8 saturation counters are read this often (a device sync on GPU) and /metrics figures sent.
SLOW_FIGURES_INTERVAL_S = 1.0
# A viewer that falls this many records behind loses the oldest ones (bounded memory).
MAX_QUEUED_RECORDS = 64
# The view's TTFT and end-to-end percentiles cover at most this many of the latest finished requests.
MAX_LATENCY_SAMPLES = 1000
# The label of the row that stands for the requests of other API keys.
OTHERS_LABEL = "other keys"


def sse_event(event: str, data: dict[str, Any]) -> str:
    """Return one server-sent event."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


@dataclass
class _Totals:
    """Counters summed over the steps since the last record."""

    num_steps: int = 0
    step_time_s: float = 0.0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preemptions: int = 0
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0


class RequestLatencies:
    """Owns the latencies of the latest finished requests and the times of those in flight.

    Fed on the engine thread while the view is watched. TTFT and end-to-end percentiles are
    taken over the same finished requests, so each request's TTFT is at most its end-to-end
    latency and so is every percentile's (/metrics' histograms cannot give that: TTFT is
    observed at the first token, running requests included, end-to-end latency at the finish,
    into other buckets). Not counted: requests that got their first token before watching
    began, finished without a token (aborts), or finished in the step that first scheduled
    them (their arrival is never seen).
    """

    def __init__(self, max_samples: int = MAX_LATENCY_SAMPLES) -> None:
        # (arrival, first token or None) per request in flight; None: not counted. The whole
        # map is None until the first step watched: the steps before it were not seen.
        self._req_id_to_times: dict[str, tuple[float, float | None] | None] | None = None
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (ttft, e2e)
        self._lock = threading.Lock()  # appended on the engine thread, read on the event loop

    def restart(self) -> None:
        """Forget the requests in flight (watching starts again); the next step sorts them."""
        self._req_id_to_times = None

    def _requests_in_flight(
        self, requests: Mapping[str, Request], stats: SchedulerStats, now_s: float
    ) -> dict[str, tuple[float, float | None] | None]:
        """Return the times of the requests in flight at the first step watched."""
        admitted = set(stats.admitted_req_ids)
        times: dict[str, tuple[float, float | None] | None] = {}
        for req_id, request in list(requests.items()):
            if not request.output_token_ids:
                times[req_id] = (request.arrival_time_s, None)
            elif req_id in admitted and not request.num_preemptions:  # its first token is now
                times[req_id] = (request.arrival_time_s, now_s)
            else:
                times[req_id] = None  # its first token came before watching began
        return times

    def on_step(self, requests: Mapping[str, Request], stats: SchedulerStats, now_s: float) -> None:
        """Note first tokens of the step's requests; record the ones it finished."""
        times = self._req_id_to_times
        if times is None:
            times = self._req_id_to_times = self._requests_in_flight(requests, stats, now_s)
        for req_id in stats.scheduled_req_ids:
            request = requests.get(req_id)
            if request is None:  # finished in this step: below
                continue
            if req_id not in times:  # scheduled for the first time: any token is this step's
                times[req_id] = (
                    request.arrival_time_s,
                    now_s if request.output_token_ids else None,
                )
                continue
            entry = times[req_id]
            if entry is not None and entry[1] is None and request.output_token_ids:
                times[req_id] = (entry[0], now_s)
        scheduled = set(stats.scheduled_req_ids) if stats.finished_req_ids else set()
        for req_id in stats.finished_req_ids:
            entry = times.pop(req_id, None)
            if entry is None:
                continue
            arrival_s, first_token_s = entry
            if first_token_s is None:
                if req_id not in scheduled:
                    continue  # finished without a token
                first_token_s = now_s  # its first token was its last
            with self._lock:
                self._samples.append((first_token_s - arrival_s, now_s - arrival_s))
        if not stats.num_running and not stats.num_waiting:
            times.clear()  # nothing is in flight: forget requests that left unseen (aborts)
        elif len(times) > 2 * len(requests) + 64:  # bounded under aborts without an idle step
            self._req_id_to_times = {r: e for r, e in times.items() if r in requests}

    def figures(self) -> dict[str, Any]:
        """Return TTFT and end-to-end percentiles over the same finished requests, and their count."""
        with self._lock:
            samples = list(self._samples)
        return {
            "ttft_s": snapshot.sample_quantiles([ttft_s for ttft_s, _ in samples]),
            "e2e_s": snapshot.sample_quantiles([e2e_s for _, e2e_s in samples]),
            "latency_requests": len(samples),
        }


@dataclass
class StepRecord:
    """One step record and, per row of its `reqs`, the tenant that sent the request (or None)."""

    data: dict[str, Any]
    owners: list[str | None]


def owner_of(request: Request | None) -> str | None:
    """Return the tenant whose API key sent a request: the first part of its cache salt."""
    if request is None or request.cache_salt is None:
        return None
    return request.cache_salt.split(":", 1)[0]


def redacted(record: StepRecord, tenant: str | None) -> dict[str, Any]:
    """Return the record as one tenant's viewer sees it: other tenants' requests as one row.

    That row (`[slot, "other keys (N)", null, null, num_blocks]`) takes one colour slot that none
    of the tenant's own requests has, and the block map shows their blocks in it.
    """
    data = record.data
    own, others = [], []
    for row, owner in zip(data["reqs"], record.owners):
        (own if tenant is not None and owner == tenant else others).append(row)
    if not others:
        return data
    own_slots = {row[0] for row in own}
    others_slot = next(s for s in range(snapshot.NUM_OWNER_SLOTS - 1, -1, -1) if s not in own_slots)
    recolour = np.arange(256, dtype=np.uint8)
    for slot in {row[0] for row in others} - own_slots:
        recolour[snapshot.CELL_FIRST_OWNER + slot] = snapshot.CELL_FIRST_OWNER + others_slot
    cells = recolour[np.frombuffer(base64.b64decode(data["kv"]), dtype=np.uint8)]
    row = [others_slot, f"{OTHERS_LABEL} ({len(others)})", None, None, sum(r[4] for r in others)]
    return {**data, "kv": base64.b64encode(cells.tobytes()).decode("ascii"), "reqs": [*own, row]}


class _Viewer:
    """One connected viewer's queue of encoded events, and whose requests it may see by id.

    `is_redacted`: only `tenant`'s requests are shown by id (with API keys); else all are.
    """

    def __init__(self, tenant: str | None = None, is_redacted: bool = False) -> None:
        self.events: deque[str] = deque(maxlen=MAX_QUEUED_RECORDS)
        self.wakeup = asyncio.Event()
        self.tenant = tenant
        self.is_redacted = is_redacted

    def encode(self, record: StepRecord) -> str:
        """Return the record's step event as this viewer may see it."""
        data = redacted(record, self.tenant) if self.is_redacted else record.data
        return sse_event("step", data)

    def push(self, text: str) -> None:
        self.events.append(text)
        self.wakeup.set()


class StepRecorder:
    """Owns the console's viewers and what they are sent; `on_step` is an engine stat logger.

    With no viewer connected, `on_step` and `on_idle` return at once and read nothing. With
    viewers, the engine thread sums each step's counters and, at most once per
    `min_interval_s`, builds a record (counts, the KV block map) and hands it to the event
    loop with `call_soon_threadsafe`; encoding and fan-out happen there.
    """

    def __init__(
        self,
        engine: LLMEngine,
        metrics: EngineMetrics | None = None,
        min_interval_s: float = MIN_RECORD_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.min_interval_s = min_interval_s
        self.clock = clock
        self.num_viewers = 0  # written on the event loop, read by the engine thread
        self._viewers: set[_Viewer] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._epoch = 0  # bumped when the first viewer joins: the engine thread starts afresh
        self._seen_epoch = 0
        self._totals = _Totals()
        self._window = StepWindow()  # the steps the rates are averaged over
        self._last_record_s = float("-inf")
        self._last_saturation_s = float("-inf")
        self._last_was_idle = True
        self._num_records = 0
        self._slots = snapshot.OwnerSlots()
        self._latencies = RequestLatencies()
        self._build_lock = threading.Lock()  # the engine thread and a joining viewer build records
        self._info: dict[str, Any] | None = None
        self._figures: tuple[float, str] | None = None  # (time, encoded event), shared by viewers
        self._is_closed = False

    # -- the engine thread -------------------------------------------------------------------
    def on_step(self, stats: SchedulerStats) -> None:
        """Sum one step's counters; publish a record if the interval has passed."""
        if not self.num_viewers:
            return
        self._sync_epoch()
        totals = self._totals
        num_decode = snapshot.decode_token_count(self.engine, stats.scheduled_req_ids)
        totals.num_steps += 1
        totals.step_time_s += stats.step_time_s
        totals.num_decode_tokens += num_decode
        totals.num_prefill_tokens += stats.num_scheduled_tokens - num_decode
        totals.num_preemptions += stats.num_preemptions
        totals.num_prefix_cache_queries += stats.num_prefix_cache_queries
        totals.num_prefix_cache_hits += stats.num_prefix_cache_hits
        now_s = self.clock()
        sample = StepSample(
            now_s, stats.step_time_s, stats.num_scheduled_tokens - num_decode, num_decode
        )
        with self._build_lock:  # a joining viewer's first record reads the window
            self._window.add(sample)
        self._latencies.on_step(self.engine.scheduler.requests, stats, now_s)
        is_idle = not stats.num_running and not stats.num_waiting
        if not is_idle:
            self._last_was_idle = False  # until a record shows the idle state
        # The step that drains the batch is always shown, so the view never ends stale.
        if now_s - self._last_record_s >= self.min_interval_s or is_idle:
            self._emit(now_s, stats.num_running, stats.num_waiting)

    def on_idle(self) -> None:
        """Publish the idle state once after requests left between steps (aborts)."""
        if not self.num_viewers:
            return
        self._sync_epoch()
        if not self._last_was_idle:
            self._emit(self.clock(), 0, 0)

    def _sync_epoch(self) -> None:
        """Start afresh when viewers came back after none: old sums and states are stale."""
        if self._seen_epoch != self._epoch:
            self._seen_epoch = self._epoch
            self._totals = _Totals()
            self._latencies.restart()
            with self._build_lock:
                self._window.clear()
            self._last_was_idle = False

    def _emit(self, now_s: float, num_running: int, num_waiting: int) -> None:
        record = self.build_record(now_s, num_running, num_waiting, self._totals)
        self._totals = _Totals()
        self._last_record_s = now_s
        self._last_was_idle = not num_running and not num_waiting
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._publish, record)
        except RuntimeError:  # the event loop has closed: nobody is watching
            pass

    def build_record(
        self, now_s: float, num_running: int, num_waiting: int, totals: _Totals
    ) -> StepRecord:
        """Return one step record (see docs/console.md for the fields) and its requests' owners."""
        engine = self.engine
        with self._build_lock:
            self._num_records += 1
            record: dict[str, Any] = {
                "seq": self._num_records,
                "t": round(time.time(), 3),
                "running": num_running,
                "waiting": num_waiting,
                "preempted": snapshot.num_preempted(engine),
                "steps": totals.num_steps,
                "step_ms": round(1e3 * totals.step_time_s / max(1, totals.num_steps), 2),
                "prefill_tokens": totals.num_prefill_tokens,
                "decode_tokens": totals.num_decode_tokens,
                "preemptions": totals.num_preemptions,
                "prefix_queries": totals.num_prefix_cache_queries,
                "prefix_hits": totals.num_prefix_cache_hits,
            }
            # Averaged over the recent steps (one record may hold a single slow step); an idle
            # engine's rates are 0 at once.
            is_busy = num_running or num_waiting
            record.update(self._window.rates(now_s) if is_busy else idle_rates())
            record.update(snapshot.kv_state(engine, self._slots))
            if engine.scheduler_config.policy == "priority":
                record["waiting_by_priority"] = sorted(
                    engine.scheduler.num_waiting_by_priority().items()
                )
            if engine.kv_spec.is_fp8 and now_s - self._last_saturation_s >= SLOW_FIGURES_INTERVAL_S:
                self._last_saturation_s = now_s
                record["saturated"] = engine.kv_saturation_counts()
        requests = engine.scheduler.requests
        owners = [owner_of(requests.get(row[1])) for row in record["reqs"]]
        return StepRecord(record, owners)

    def close(self) -> None:
        """End every viewer's stream (server shutdown: they would never end on their own)."""
        self._is_closed = True
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._wake_all)
            except RuntimeError:  # the event loop has closed already
                pass

    # -- the event loop ------------------------------------------------------------------------
    def _wake_all(self) -> None:
        for viewer in self._viewers:
            viewer.wakeup.set()

    def _publish(self, record: StepRecord) -> None:
        if not self._viewers:
            return
        # Encoded once per distinct view (every viewer alike without API keys).
        view_to_text: dict[tuple[str | None, bool], str] = {}
        for viewer in self._viewers:
            view = (viewer.tenant, viewer.is_redacted)
            if view not in view_to_text:
                view_to_text[view] = viewer.encode(record)
            viewer.push(view_to_text[view])

    def _figures_event(self) -> str | None:
        """Return the /metrics figures event, computed at most once a second for all viewers."""
        if self.metrics is None:
            return None
        now_s = time.monotonic()
        if self._figures is None or now_s - self._figures[0] >= SLOW_FIGURES_INTERVAL_S:
            figures = snapshot.metric_figures(self.metrics.registry)
            figures.update(self._latencies.figures())
            self._figures = (now_s, sse_event("metrics", figures))
        return self._figures[1]

    async def stream(
        self,
        heartbeat_s: float = SLOW_FIGURES_INTERVAL_S,
        tenant: str | None = None,
        is_redacted: bool = False,
    ) -> AsyncIterator[str]:
        """Yield server-sent events for one viewer until it is closed: info, step, metrics.

        With `is_redacted`, requests other than `tenant`'s are shown as one anonymous row.
        """
        viewer = _Viewer(tenant, is_redacted)
        self._loop = asyncio.get_running_loop()
        self._viewers.add(viewer)
        self.num_viewers = len(self._viewers)
        if self.num_viewers == 1:
            self._epoch += 1
        try:
            if self._info is None:
                self._info = snapshot.engine_info(self.engine)
            yield sse_event("info", self._info)
            # What the cache holds now, even if the engine is idle (read from this thread).
            scheduler = self.engine.scheduler
            num_running, num_waiting = len(scheduler.running), len(scheduler.waiting)
            first = self.build_record(self.clock(), num_running, num_waiting, _Totals())
            yield viewer.encode(first)
            last_figures_s = float("-inf")
            while not self._is_closed:
                if time.monotonic() - last_figures_s >= heartbeat_s:
                    last_figures_s = time.monotonic()
                    figures = self._figures_event()
                    yield figures if figures is not None else ": keep-alive\n\n"
                while viewer.events:
                    yield viewer.events.popleft()
                viewer.wakeup.clear()
                if self._is_closed:
                    break
                try:
                    await asyncio.wait_for(viewer.wakeup.wait(), heartbeat_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            self._viewers.discard(viewer)
            self.num_viewers = len(self._viewers)
