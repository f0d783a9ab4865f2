"""The exact tail's auto defaults, apart from the tail's torch code: flags and the planner read
them without importing torch."""

from __future__ import annotations

# Measured on the default model (docs/accuracy.md, "Exact tail"), used when the flags are left on
# auto for an FP8 cache whose kernels read the tail: the window and the sinks (together they
# keep bench capacity's FP8/bf16 ratio >= 1.9x at 1,024 tokens) and the rotation.
DEFAULT_EXACT_TAIL_TOKENS = 24
DEFAULT_EXACT_SINK_TOKENS = 4
DEFAULT_HADAMARD = True

# Hits are cut to segments of this many windows (docs/accuracy.md, "The same answer"): a query at
# position a reads exactly from max(a - W + 1, a // (K * W) * (K * W)), so the window is whole
# except in a segment's first W - 1 positions, and a hit at a segment start needs nothing exact
# from before it. Larger K: fewer shortened windows, hits cut by more.
EXACT_TAIL_SEGMENT_WINDOWS = 4


def tail_segment(window: int) -> int:
    """Return the segment length of a tail of `window` positions."""
    return EXACT_TAIL_SEGMENT_WINDOWS * window
