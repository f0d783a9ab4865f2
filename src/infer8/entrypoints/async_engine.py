"""AsyncLLMEngine: one thread drives the LLMEngine; asyncio callers submit requests and stream."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from infer8.cpu_threads import release_openmp_workers
from infer8.engine import LLMEngine
from infer8.entrypoints.request_group import (
    EngineDeadError,
    EngineDrainingError,
    EngineOverloadedError,
    RequestGroup,
    TrackedRequest,
)
from infer8.entrypoints.supervision import StepSupervisor, SupervisionConfig
from infer8.host_memory import HostMemory
from infer8.lora.config import LoRARequest
from infer8.metrics import EngineMetrics
from infer8.outputs import RequestOutput
from infer8.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How often the engine thread reads the FP8 saturation counters (a device sync on GPU).
_SATURATION_REFRESH_S = 1.0
# How often the engine thread hands freed heap pages back to the OS (see host_memory.py).
_TRIM_INTERVAL_S = 10.0


@dataclass
class _AddCommand:
    group: RequestGroup


@dataclass
class _AbortCommand:
    request_ids: list[str]


@dataclass
class _ResetPrefixCacheCommand:
    result: concurrent.futures.Future[int]


@dataclass
class _AbortAllCommand:
    pass


@dataclass
class _StopCommand:
    pass


_Command = _AddCommand | _AbortCommand | _AbortAllCommand | _ResetPrefixCacheCommand | _StopCommand


class AsyncLLMEngine:
    """Owns the engine thread: the only caller of the LLMEngine's add_request / abort / step.

    Callers on an event loop submit with `add_requests` (which applies admission control) and
    read `RequestGroup.stream()`; commands reach the thread through a thread-safe queue and
    outputs come back with `loop.call_soon_threadsafe`. The thread blocks when idle.
    """

    def __init__(
        self,
        engine: LLMEngine,
        metrics: EngineMetrics | None = None,
        max_waiting_requests: int | None = None,
        supervision: SupervisionConfig | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self.supervisor = StepSupervisor(supervision or SupervisionConfig())
        # Called (from any thread) when the engine cannot go on: the server exits non-zero.
        self.on_fatal: Callable[[str], None] | None = None
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards the fields below up to _groups
        self._num_waiting = 0  # submitted, not yet admitted to a batch the first time
        self._dead_reason: str | None = None
        self._draining = False
        self._groups: dict[int, RequestGroup] = {}  # every group not yet finished
        self._host_memory = HostMemory()
        self._last_trim_s = time.monotonic()
        self._thread: threading.Thread | None = None
        self._tracked: dict[str, TrackedRequest] = {}  # engine thread only
        self._last_saturation_read_s = 0.0
        # Called on the engine thread when it has handled commands and holds no request.
        self.idle_loggers: list[Callable[[], None]] = []

    # -- the caller's side (event loop thread) ---------------------------------------------
    def start(self) -> None:
        """Start the engine thread (and its watchdog when a step time limit is set)."""
        assert self._thread is None, "already started"
        self._host_memory.limit_arenas()  # before the engine, watchdog and worker threads start
        # The loading thread's OpenMP pool would make libgomp park the engine's workers after
        # every parallel region (more OpenMP threads than cores): 1.5-1.8x slower steps on CPU.
        release_openmp_workers()
        self._thread = threading.Thread(target=self._run, name="infer8-engine", daemon=True)
        self._thread.start()
        if self.supervisor.watch_period_s is not None:
            watchdog = threading.Thread(target=self._watch, name="infer8-watchdog", daemon=True)
            watchdog.start()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort what is left, stop the engine thread and wait for it (not if it is wedged)."""
        with self._lock:
            if self._dead_reason is None:
                self._dead_reason = "the server is shutting down"
            self._commands.put(_StopCommand())
        is_wedged = self.supervisor.wedged_for_s() is not None
        if self._thread is not None and not is_wedged:
            self._thread.join(timeout_s)

    def health(self) -> str | None:
        """Return why the engine cannot serve (dead, wedged, a failed worker), or None."""
        with self._lock:
            dead_reason = self._dead_reason
        if dead_reason is not None:
            return dead_reason
        if self._thread is None or not self._thread.is_alive():
            return "the engine thread is not running"
        wedged = self.supervisor.wedged_reason()
        if wedged is not None:
            return wedged
        if not self.engine.is_healthy():
            return "a tensor-parallel worker failed"
        return None

    @property
    def is_healthy(self) -> bool:
        """Return whether the engine thread is running, not wedged, and accepting requests."""
        return self.health() is None

    @property
    def is_draining(self) -> bool:
        """Return whether the server is shutting down (new requests are refused)."""
        return self._draining

    @property
    def is_overloaded(self) -> bool:
        """Return whether the waiting queue is full (a cheap check before any parsing)."""
        limit = self.max_waiting_requests
        return limit is not None and self._num_waiting >= limit

    @property
    def is_idle(self) -> bool:
        """Return whether no API request is in flight."""
        with self._lock:
            return not self._groups

    @property
    def num_restarts(self) -> int:
        """Return how many times the engine was rebuilt in-process."""
        return self.supervisor.num_restarts

    def start_drain(self, abort_after_s: float) -> None:
        """Refuse new requests now; abort those still running after abort_after_s.

        Aborted requests end with a final output (finish_reason "abort"), so every open stream
        gets its last event before the HTTP server closes the connections.
        """
        with self._lock:
            if self._draining:
                return
            self._draining = True
        timer = threading.Timer(max(0.0, abort_after_s), self._commands.put, [_AbortAllCommand()])
        timer.daemon = True
        timer.start()

    def add_requests(
        self,
        request_id: str,
        prompts: Sequence[list[int]],
        params: Sequence[SamplingParams],
        cache_salt: str | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestGroup:
        """Submit one API request's engine requests; raise if overloaded, draining or stopped.

        `loop` is the event loop that reads the outputs (default: the running one), so a worker
        thread that tokenized the request can submit it. `priority` orders all of them under
        --scheduling-policy priority (lower first).
        """
        loop = loop or asyncio.get_running_loop()
        group = RequestGroup(
            request_id, prompts, params, loop, self, cache_salt, priority, lora_request
        )
        with self._lock:
            if self._dead_reason is not None:
                raise EngineDeadError(self._dead_reason)
            if self._draining:
                raise EngineDrainingError("the server is shutting down; retry on another replica")
            limit = self.max_waiting_requests
            if limit is not None and self._num_waiting >= limit:
                raise EngineOverloadedError(
                    f"the server is overloaded ({self._num_waiting} requests waiting, "
                    f"--max-waiting-requests {limit}); retry later"
                )
            self._num_waiting += len(prompts)
            self._groups[id(group)] = group
            self._commands.put(_AddCommand(group))
        return group

    def forget(self, group: RequestGroup) -> None:
        """Drop a finished or abandoned group from the registry the watchdog fails."""
        with self._lock:
            self._groups.pop(id(group), None)

    def abort(self, request_ids: list[str]) -> None:
        """Ask the engine thread to abort requests (their blocks are freed before its next step)."""
        self._commands.put(_AbortCommand(list(request_ids)))

    async def reset_prefix_cache(self) -> int:
        """Drop the prefix-cached blocks no running request holds, between two engine steps.

        Returns how many blocks were dropped; raises EngineDeadError if the engine stopped.
        """
        result: concurrent.futures.Future[int] = concurrent.futures.Future()
        with self._lock:
            if self._dead_reason is not None:
                raise EngineDeadError(self._dead_reason)
            self._commands.put(_ResetPrefixCacheCommand(result))
        return await asyncio.wrap_future(result)

    # -- supervision --------------------------------------------------------------------------
    def _watch(self) -> None:
        """Watchdog thread: fail everything and ask for an exit once a step overruns its limit."""
        period_s = self.supervisor.watch_period_s
        assert period_s is not None
        while True:
            time.sleep(period_s)
            with self._lock:
                if self._dead_reason is not None:
                    return
            if self.supervisor.wedged_for_s() is not None:
                reason = self.health() or "the engine is wedged"
                logger.error("watchdog: %s; failing in-flight requests and exiting", reason)
                self._die(EngineDeadError(reason))
                self._fatal(reason)
                return

    def _fatal(self, reason: str) -> None:
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def _restart_or_die(self, error: BaseException) -> bool:
        """After a failed step: fail the requests in flight, rebuild the engine; False if fatal."""
        now_s = time.monotonic()
        reason: str | None = None
        if not self.engine.can_reset:
            reason = f"the engine failed: {error}"
        else:
            reason = self.supervisor.refuse_restart(error, now_s)
        if reason is None:
            self._fail_tracked(
                EngineDeadError(
                    "the engine failed while running this request and is being restarted; retry it"
                )
            )
            try:
                self.engine.reset()
            except Exception as e:  # noqa: BLE001 - cannot rebuild: the process must go
                reason = f"the engine failed and could not be rebuilt in-process: {e}"
            else:
                self.supervisor.record_restart(now_s)
                if self.metrics is not None:
                    self.metrics.on_engine_restart()
                logger.error("the engine was rebuilt in-process (restart %d)", self.num_restarts)
                return True
        logger.error("%s", reason)
        self._die(EngineDeadError(reason))
        self._fatal(reason)
        return False

    def _fail_tracked(self, error: BaseException) -> None:
        """Fail every request the engine holds; their groups get the error once."""
        groups: dict[int, RequestGroup] = {}
        for tracked in self._tracked.values():
            groups[id(tracked.group)] = tracked.group
            if not tracked.is_admitted:
                tracked.is_admitted = True
                self._release_waiting(1)
            if self.metrics is not None:
                self.metrics.on_finished("error", time.monotonic() - tracked.group.arrival_time_s)
                self.metrics.request_errors.inc()
        self._tracked.clear()
        for group in groups.values():
            group.put(error)

    # -- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                self._loop_until_stopped()
                self.engine.shutdown()
                return
            except BaseException as e:  # noqa: BLE001 - the thread must report every failure
                logger.exception("the engine loop failed")
                self.supervisor.step_ended()
                if not self._restart_or_die(e):
                    return

    def _loop_until_stopped(self) -> None:
        engine = self.engine
        while True:
            commands = self._next_commands(block=not engine.has_unfinished_requests())
            for command in commands:
                if isinstance(command, _AddCommand):
                    self._add(command.group)
                elif isinstance(command, _AbortCommand):
                    self._abort(command.request_ids)
                elif isinstance(command, _AbortAllCommand):
                    self._abort(list(self._tracked))
                elif isinstance(command, _ResetPrefixCacheCommand):
                    self._reset_prefix_cache(command.result)
            if any(isinstance(c, _StopCommand) for c in commands):
                self._abort(list(self._tracked))
                self._publish_gauges(force_saturation=True)
                return
            if engine.has_unfinished_requests():
                self._step()
            is_idle = not engine.has_unfinished_requests()
            self._publish_gauges(force_saturation=is_idle)
            if is_idle:
                for log in self.idle_loggers:
                    log()
            now_s = time.monotonic()
            if is_idle or now_s - self._last_trim_s > _TRIM_INTERVAL_S:
                self._last_trim_s = now_s
                self._host_memory.trim()

    def _next_commands(self, block: bool) -> list[_Command]:
        """Return queued commands; when idle, wait for at least one instead of spinning."""
        commands: list[_Command] = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _add(self, group: RequestGroup) -> None:
        """Add a group's requests to the engine, all or none."""
        added: list[str] = []
        try:
            for index, (request_id, prompt, params) in enumerate(
                zip(group.request_ids, group.prompts, group.params)
            ):
                self.engine.add_request(
                    prompt,
                    params,
                    request_id,
                    group.arrival_time_s,
                    group.cache_salt,
                    priority=group.priority,
                    lora_request=group.lora_request,
                )
                added.append(request_id)
                self._tracked[request_id] = TrackedRequest(group, index, len(prompt))
        except ValueError as e:
            self.engine.abort_request(added)
            for request_id in added:
                del self._tracked[request_id]
            self._release_waiting(len(group.request_ids))
            group.put(e)

    def _abort(self, request_ids: list[str]) -> None:
        """Abort tracked requests now; their consumers get a final output with reason abort."""
        request_ids = [rid for rid in request_ids if rid in self._tracked]
        if not request_ids:
            return
        self.engine.abort_request(request_ids)
        for request_id in request_ids:
            tracked = self._tracked.pop(request_id)
            output = tracked.group.aborted_output(tracked.index, tracked.last_output)
            self._on_finished(tracked, output)
            tracked.group.put((tracked.index, output))

    def _reset_prefix_cache(self, result: concurrent.futures.Future[int]) -> None:
        try:
            result.set_result(self.engine.reset_prefix_cache())
        except BaseException as e:
            result.set_exception(e)
            raise

    def _step(self) -> None:
        step_start_s = time.monotonic()
        self.supervisor.step_started(step_start_s)
        outputs = self.engine.step()
        now_s = time.monotonic()
        self.supervisor.step_ended()
        stats = self.engine.last_stats
        if self.metrics is not None:
            self.metrics.on_step(stats)
        for request_id in stats.admitted_req_ids:
            tracked = self._tracked.get(request_id)
            if tracked is not None and not tracked.is_admitted:
                tracked.is_admitted = True
                self._release_waiting(1)
                if self.metrics is not None:
                    self.metrics.on_admitted(step_start_s - tracked.group.arrival_time_s)
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            tracked.record_tokens(output, now_s, self.metrics)
            if output.finished:
                del self._tracked[output.request_id]
                self._on_finished(tracked, output)
            tracked.group.put((tracked.index, output))

    def _on_finished(self, tracked: TrackedRequest, output: RequestOutput) -> None:
        if not tracked.is_admitted:
            tracked.is_admitted = True  # never will be: it leaves the waiting count now
            self._release_waiting(1)
        if self.metrics is not None:
            reason = output.outputs[0].finish_reason or "abort"
            self.metrics.on_finished(reason, time.monotonic() - tracked.group.arrival_time_s)
            if reason == "error":
                self.metrics.request_errors.inc()

    def _release_waiting(self, num: int) -> None:
        with self._lock:
            self._num_waiting -= num
            assert self._num_waiting >= 0

    def _publish_gauges(self, force_saturation: bool) -> None:
        if self.metrics is None:
            return
        scheduler = self.engine.scheduler
        self.metrics.set_load(
            len(scheduler.running), len(scheduler.waiting), self.engine.kv_cache_manager.usage
        )
        self.metrics.set_waiting_by_priority(scheduler.num_waiting_by_priority())
        now_s = time.monotonic()
        if force_saturation or now_s - self._last_saturation_read_s >= _SATURATION_REFRESH_S:
            self._last_saturation_read_s = now_s
            self.metrics.set_fp8_saturated(sum(self.engine.kv_saturation_counts()))

    def _die(self, error: EngineDeadError) -> None:
        """Fail every request in flight or queued, and refuse new ones."""
        with self._lock:
            self._dead_reason = str(error)
            pending = self._next_commands(block=False)
            groups = dict(self._groups)  # every unfinished group, whoever holds it now
        groups.update({id(c.group): c.group for c in pending if isinstance(c, _AddCommand)})
        for command in pending:
            if isinstance(command, _ResetPrefixCacheCommand) and not command.result.done():
                command.result.set_exception(error)
        self._tracked.clear()
        for group in groups.values():
            group.put(error)
