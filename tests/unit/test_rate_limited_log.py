"""A flood of one kind of event writes a few lines and a count, not a line per event."""

from __future__ import annotations

import logging

import pytest

from infer8.logging_setup import RateLimitedLog


def test_a_burst_per_window_then_a_count_of_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    log = RateLimitedLog(logging.getLogger("infer8.test"), "slow bodies closed", 3, 10.0)
    with caplog.at_level(logging.INFO, logger="infer8.test"):
        for i in range(4_000):  # 4,000 sockets timing out in the same second
            log.info(100.0 + i * 1e-4, "closed socket %d", i)
        assert [r.getMessage() for r in caplog.records] == [f"closed socket {i}" for i in range(3)]
        caplog.clear()
        log.info(111.0, "closed socket %d", 4_000)  # the next window
    assert [r.getMessage() for r in caplog.records] == [
        "3997 more slow bodies closed not logged in the 11 s before this line",
        "closed socket 4000",
    ]


def test_events_slower_than_the_burst_are_all_logged(caplog: pytest.LogCaptureFixture) -> None:
    log = RateLimitedLog(logging.getLogger("infer8.test"), "x", 2, 1.0)
    with caplog.at_level(logging.INFO, logger="infer8.test"):
        for i in range(5):
            log.info(float(i), "event %d", i)
    assert [r.getMessage() for r in caplog.records] == [f"event {i}" for i in range(5)]
