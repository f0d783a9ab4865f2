"""Progress bars: tqdm on a terminal; off one (a log file, a pod's log, CI), one plain line per
update at most every LOG_INTERVAL_S, so the log holds lines instead of carriage returns."""

from __future__ import annotations

import sys
from typing import IO, Any

from tqdm import tqdm

LOG_INTERVAL_S = 10.0


class _Lines:
    """A text stream for tqdm that turns each redraw (`\\r` + bar) into one line."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.last = ""

    def write(self, text: str) -> int:
        line = text.replace("\r", "").strip()
        if line and line != self.last:
            self.stream.write(line + "\n")
            self.last = line
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(iterable: Any = None, **kwargs: Any) -> tqdm:
    """Return a tqdm bar over iterable (or with total=...) that suits where stderr goes."""
    stream = kwargs.pop("file", None) or sys.stderr
    if not stream.isatty():
        kwargs.setdefault("mininterval", LOG_INTERVAL_S)
        kwargs.setdefault("ncols", 100)
        stream = _Lines(stream)
    return tqdm(iterable, file=stream, **kwargs)
