"""Tensor parallelism: sharding, collectives, rank 0's driver, the worker loop, launchers."""
