"""Supervision of the engine loop: a step time limit (the watchdog's) and a budget of in-process
restarts. Plain bookkeeping; the AsyncLLMEngine acts on what it says."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class SupervisionConfig:
    """How the engine loop is watched: a step time limit and in-process restarts."""

    # A step running longer than this marks the engine wedged (/health 503, requests failed,
    # the process exits non-zero). None: no watchdog.
    step_timeout_s: float | None = None
    # More than this many in-process restarts within restart_window_s: exit non-zero instead.
    max_restarts: int = 3
    restart_window_s: float = 300.0


class StepSupervisor:
    """Times the running step against the limit and counts restarts (thread-safe)."""

    def __init__(self, config: SupervisionConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._step_started_s: float | None = None  # set while a step runs
        self._restart_times_s: list[float] = []

    @property
    def watch_period_s(self) -> float | None:
        """Return how often a watchdog should look, or None when there is no step limit."""
        limit = self.config.step_timeout_s
        return None if limit is None else min(1.0, limit / 10)

    @property
    def num_restarts(self) -> int:
        return len(self._restart_times_s)

    def step_started(self, now_s: float) -> None:
        with self._lock:
            self._step_started_s = now_s

    def step_ended(self) -> None:
        with self._lock:
            self._step_started_s = None

    def wedged_for_s(self) -> float | None:
        """Return how long the running step has run if over the limit, else None."""
        with self._lock:
            limit, started = self.config.step_timeout_s, self._step_started_s
        if limit is None or started is None:
            return None
        elapsed = time.monotonic() - started
        return elapsed if elapsed > limit else None

    def wedged_reason(self) -> str | None:
        """Return why the engine counts as wedged, or None."""
        wedged_s = self.wedged_for_s()
        if wedged_s is None:
            return None
        return (
            f"an engine step has run for {wedged_s:.0f} s, over the "
            f"{self.config.step_timeout_s:.0f} s limit: the engine is wedged"
        )

    def refuse_restart(self, error: BaseException, now_s: float) -> str | None:
        """Return why a restart after `error` would exceed the budget, or None to go ahead."""
        window = self.config.restart_window_s
        recent = [t for t in self._restart_times_s if now_s - t < window]
        if len(recent) < self.config.max_restarts:
            return None
        return (
            f"the engine failed {len(recent) + 1} times within {window:.0f} s "
            f"(last: {type(error).__name__}); exiting so the orchestrator restarts the process"
        )

    def record_restart(self, now_s: float) -> None:
        self._restart_times_s.append(now_s)
