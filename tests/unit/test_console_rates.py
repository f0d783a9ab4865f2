"""The engine view's rates: tokens/s, steps/s and step time averaged over recent steps."""

from __future__ import annotations

import pytest

from infer8.entrypoints.console.rates import StepSample, StepWindow


def _steady(window: StepWindow, start_s: float, num_steps: int, step_s: float) -> float:
    """Add back-to-back steps of 16 decode and 4 prefill tokens; return the last one's end."""
    end_s = start_s
    for _ in range(num_steps):
        end_s += step_s
        window.add(StepSample(end_s, step_s, 4, 16))
    return end_s


def test_rates_average_the_steps_of_the_window_not_the_last_one() -> None:
    window = StepWindow(window_s=2.0)
    end_s = _steady(window, 100.0, 50, 0.25)  # 4 steps a second for 12.5 s
    window.add(StepSample(end_s + 0.01, 0.01, 0, 1))  # one tiny last step
    rates = window.rates(end_s + 0.01)
    # The steps ending in the last 2 s: 8 steady ones and the tiny one, over 2.01 s of wall time.
    assert rates["decode_tokens_per_s"] == pytest.approx((8 * 16 + 1) / 2.01, abs=0.1)
    assert rates["prefill_tokens_per_s"] == pytest.approx(8 * 4 / 2.01, abs=0.1)
    assert rates["steps_per_s"] == pytest.approx(9 / 2.01, abs=0.01)
    assert rates["mean_step_ms"] == pytest.approx(1e3 * (8 * 0.25 + 0.01) / 9, abs=0.01)


def test_a_window_not_yet_full_and_a_step_longer_than_the_window_give_true_rates() -> None:
    window = StepWindow(window_s=2.0)
    end_s = _steady(window, 100.0, 2, 0.1)  # a burst that began 0.2 s ago
    assert window.rates(end_s)["decode_tokens_per_s"] == pytest.approx(32 / 0.2)
    long = StepWindow(window_s=2.0)
    long.add(StepSample(110.0, 8.0, 4000, 0))  # one 8 s prefill step
    rates = long.rates(110.0)
    assert rates["prefill_tokens_per_s"] == pytest.approx(500.0)
    assert rates["mean_step_ms"] == 8000.0 and rates["steps_per_s"] == pytest.approx(0.12, abs=0.01)


def test_idle_time_lowers_the_rates_and_an_empty_window_reads_zero() -> None:
    window = StepWindow(window_s=2.0)
    end_s = _steady(window, 100.0, 10, 0.1)  # 1 s of work, then 0.5 s without a step
    assert window.rates(end_s + 0.5)["decode_tokens_per_s"] == pytest.approx(160 / 1.5, abs=0.1)
    rates = window.rates(end_s + 5.0)
    assert rates["decode_tokens_per_s"] == 0.0 and rates["prefill_tokens_per_s"] == 0.0
    assert rates["steps_per_s"] == 0.0 and rates["mean_step_ms"] is None
    assert not window.samples  # old steps are dropped, not kept forever
