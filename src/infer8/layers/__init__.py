"""Model building blocks that know tensor parallelism and FP8 weights (modules only)."""
