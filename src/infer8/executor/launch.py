"""Launched groups: one process per rank started by torchrun (or any launcher setting its env).

Every rank runs the same command (`infer8 serve MODEL --tensor-parallel-size N`) with RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK) set. Rank 0 builds the engine and serves;
the others connect to it and run the worker loop. The ranks meet in the launcher's store, where
rank 0 leaves the address of its step connection.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from infer8.config import EngineArgs, resolve_device
from infer8.distributed.parallel_state import STARTUP_TIMEOUT_S
from infer8.executor.rank import ADDRESS_KEY, AUTHKEY_KEY, connect_to_driver, run_worker
from infer8.models.loader import read_model_config, resolve_model_path

logger = logging.getLogger(__name__)

__all__ = ["ADDRESS_KEY", "AUTHKEY_KEY", "LaunchEnv", "launched_env", "run_launched_worker"]


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in a launched group (torchrun's environment variables)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> LaunchEnv | None:
        """Return the launcher's values; None unless WORLD_SIZE says there are several ranks."""
        if int(environ.get("WORLD_SIZE", "1")) <= 1:
            return None
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in environ]
        if missing:
            raise ValueError(
                f"WORLD_SIZE={environ['WORLD_SIZE']} is set but {', '.join(missing)} is not: "
                "launch every rank with torchrun or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"
            )
        env = cls(
            rank=int(environ["RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            local_rank=int(environ.get("LOCAL_RANK", "0")),
            master_addr=environ["MASTER_ADDR"],
            master_port=int(environ["MASTER_PORT"]),
        )
        if not 0 <= env.rank < env.world_size:
            raise ValueError(f"RANK={env.rank} is outside WORLD_SIZE={env.world_size}")
        return env


def launched_env(
    tensor_parallel_size: int, environ: Mapping[str, str] | None = None
) -> LaunchEnv | None:
    """Return this process's launch env if started as one rank of a group, else None."""
    env = LaunchEnv.from_environ(os.environ if environ is None else environ)
    if env is not None and env.world_size != tensor_parallel_size:
        raise ValueError(
            f"this process was launched as rank {env.rank} of WORLD_SIZE={env.world_size}, "
            f"but --tensor-parallel-size is {tensor_parallel_size}: launch one process per rank"
        )
    return env


def rendezvous_store(env: LaunchEnv) -> dist.Store:
    """Connect to the group's store at MASTER_ADDR:MASTER_PORT (torchrun's, or rank 0's)."""
    store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=STARTUP_TIMEOUT_S)))
    return dist.PrefixStore("infer8", store)


def run_launched_worker(args: EngineArgs, env: LaunchEnv) -> int:
    """Run rank `env.rank` (> 0): connect to rank 0, then serve its steps; return an exit code."""
    assert env.rank > 0
    # Rank 0 drains in-flight requests on SIGTERM and needs the workers until it closes the
    # connection, which ends this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if resolve_device(args.device).type == "cuda":
        torch.cuda.set_device(env.local_rank)
    store = rendezvous_store(env)
    conn = connect_to_driver(store, env.rank)
    logger.info("tensor-parallel rank %d connected to rank 0", env.rank)
    model_path = resolve_model_path(args.model)
    config = args.create_engine_config(model_path, read_model_config(model_path))
    return run_worker(config, store, env.rank, env.world_size, conn)
