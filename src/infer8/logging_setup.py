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
