"""The exact tail's auto defaults, apart from the tail's torch code: flags and the planner read
them without importing torch."""

from __future__ import annotations

# Measured on the default model (docs/accuracy.md, "Exact tail"), used when the flags are left on
# auto for an FP8 cache whose kernels read the tail: the window and the sinks (together they
# keep bench capacity's FP8/bf16 ratio >= 1.9x at 1,024 tokens) and the rotation.
DEFAULT_EXACT_TAIL_TOKENS = 24
DEFAULT_EXACT_SINK_TOKENS = 4
DEFAULT_HADAMARD = True
