"""The command line's log format: level, time and module on every line, to stderr."""

from __future__ import annotations

import logging
import sys

LOG_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


def configure_logging(level: int = logging.INFO) -> None:
    """Send infer8's loggers to stderr as `INFO 12-07 10:00:00 [infer8.x] message` lines.

    Only the `infer8` logger is configured (a library user's root logger is left alone), once.
    """
    logger = logging.getLogger("infer8")
    if any(getattr(h, "infer8_cli", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
    handler.infer8_cli = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
