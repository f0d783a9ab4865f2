"""Progress bars write lines, not carriage returns, where stderr is not a terminal."""

from __future__ import annotations

import io

from infer8.progress import LOG_INTERVAL_S, progress_bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_each_update_is_one_line() -> None:
    log = io.StringIO()
    for _ in progress_bar(range(4), desc="convert", file=log, mininterval=0):
        pass
    text = log.getvalue()
    lines = text.splitlines()
    assert "\r" not in text and text.endswith("\n")
    assert lines[0].startswith("convert:   0%") and "4/4" in lines[-1]
    assert 2 <= len(lines) <= 6, lines  # one a redraw at most, never one per character
    bar = progress_bar(range(2), file=io.StringIO())
    assert bar.mininterval == LOG_INTERVAL_S  # a long job logs a line every 10 s, not 10 a second
    bar.close()


def test_on_a_terminal_the_bar_redraws_in_place() -> None:
    term = _Terminal()
    for _ in progress_bar(range(3), desc="convert", file=term, mininterval=0):
        pass
    assert "\r" in term.getvalue()
