"""StepWindow: the engine view's token rates and step time, averaged over recent engine steps."""

from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple

# Rates are averaged over the steps that ended this long before the record.
RATE_WINDOW_S = 2.0
# Bounds the window's memory whatever the step rate (a GPU can run hundreds of steps a second).
MAX_WINDOW_STEPS = 4096


class StepSample(NamedTuple):
    """One engine step as the rates need it (times from the recorder's monotonic clock)."""

    end_s: float
    step_time_s: float
    num_prefill_tokens: int
    num_decode_tokens: int


class StepWindow:
    """Owns the recent steps; answers tokens/s, steps/s and mean step time over them.

    Every time is the server's own clock: a record carries rates, never timestamps for the
    page to compare with the browser's clock (which may be seconds off, or virtual).
    """

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self.samples: deque[StepSample] = deque(maxlen=MAX_WINDOW_STEPS)

    def add(self, sample: StepSample) -> None:
        """Remember one finished step."""
        self.samples.append(sample)

    def clear(self) -> None:
        """Forget every step (a viewer joins after none: old steps are stale)."""
        self.samples.clear()

    def rates(self, now_s: float) -> dict[str, Any]:
        """Return the record's rate fields over the steps that ended within the window.

        Tokens are divided by the wall time from the first such step's start to `now_s`, so a
        window that is not full yet (a burst that just began), a single step longer than the
        window (a long prefill) and idle gaps between steps all give the true rate.
        """
        samples = self.samples
        while samples and samples[0].end_s < now_s - self.window_s:
            samples.popleft()
        if not samples:
            return idle_rates()
        span_s = max(now_s - (samples[0].end_s - samples[0].step_time_s), 1e-6)
        num_steps = len(samples)
        return {
            "decode_tokens_per_s": round(sum(s.num_decode_tokens for s in samples) / span_s, 1),
            "prefill_tokens_per_s": round(sum(s.num_prefill_tokens for s in samples) / span_s, 1),
            "steps_per_s": round(num_steps / span_s, 2),
            "mean_step_ms": round(1e3 * sum(s.step_time_s for s in samples) / num_steps, 2),
        }


def idle_rates() -> dict[str, Any]:
    """Return the rate fields of an engine that runs no step."""
    return {
        "decode_tokens_per_s": 0.0,
        "prefill_tokens_per_s": 0.0,
        "steps_per_s": 0.0,
        "mean_step_ms": None,
    }
