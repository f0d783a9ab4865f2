"""The command line's log format: level, time and module on every line, to stderr."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

LOG_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler that writes to whatever sys.stderr is when a record comes (redirected or not)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def configure_logging(level: int = logging.INFO) -> None:
    """Send infer8's loggers to stderr as `INFO 12-07 10:00:00 [infer8.x] message` lines.

    Only the `infer8` logger gets a handler (a library user's root logger is left alone), once;
    its records still propagate, to a root handler if one is configured (pytest's caplog).
    """
    logger = logging.getLogger("infer8")
    if any(getattr(h, "infer8_cli", False) for h in logger.handlers):
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
    handler.infer8_cli = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(level)


@contextlib.contextmanager
def only_warnings() -> Iterator[None]:
    """Hold infer8's INFO lines back while the block runs (warnings and errors still show)."""
    logger = logging.getLogger("infer8")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


class RateLimitedLog:
    """Log at most `burst` lines of one kind per `window_s`; count the rest, and say how many
    with the first line of a later window. A flood of clients (4,000 sockets timing out at
    once) then writes a few lines, not thousands, and the event loop does not stall on them.

    Not thread-safe: one per event loop.
    """

    def __init__(
        self, logger: logging.Logger, what: str, burst: int = 10, window_s: float = 10.0
    ) -> None:
        self.logger = logger
        self.what = what  # "slow request bodies closed": the kind, for the summary line
        self.burst = burst
        self.window_s = window_s
        self.window_start_s = float("-inf")
        self.num_in_window = 0
        self.num_suppressed = 0

    def info(self, now_s: float, msg: str, *args: object) -> None:
        """Log msg % args at INFO unless this window's burst is spent."""
        if now_s - self.window_start_s >= self.window_s:
            if self.num_suppressed:
                self.logger.info(
                    "%d more %s not logged in the %.0f s before this line",
                    self.num_suppressed, self.what, now_s - self.window_start_s,
                )  # fmt: skip
            self.window_start_s, self.num_in_window, self.num_suppressed = now_s, 0, 0
        self.num_in_window += 1
        if self.num_in_window <= self.burst:
            self.logger.info(msg, *args)
        else:
            self.num_suppressed += 1
