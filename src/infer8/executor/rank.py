"""Ranks 1..N-1: build this rank's Worker, then run each step rank 0 sends.

Rank 0 sends each step's SchedulerOutput over a socket connection and None to stop. Workers
never sample: the tokens rank 0 sampled in the previous step travel inside the next
SchedulerOutput, so every rank's runner holds the same token history. A worker only ever writes
to the connection once, a WorkerFailure, just before it exits.

A rank that rank 0 starts on this machine is its own process of this package
(`python -m infer8.executor.rank`, its arguments pickled on standard input), so it never
re-imports the user's main module: scripts need no `__main__` guard and may come from stdin.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Client, Connection

import torch
import torch.distributed as dist

from infer8.config import EngineConfig
from infer8.core.sched_output import SchedulerOutput
from infer8.distributed.parallel_state import STARTUP_TIMEOUT_S, new_group
from infer8.worker.worker import Worker

logger = logging.getLogger(__name__)

# Store keys where rank 0 publishes its step connection.
ADDRESS_KEY = "driver_address"
AUTHKEY_KEY = "driver_authkey"


@dataclass
class WorkerFailure:
    """A worker's last word: why it is exiting."""

    rank: int
    message: str


@dataclass(frozen=True)
class SpawnedRank:
    """What rank 0 hands a rank it starts here (pickled on the rank's standard input)."""

    config: EngineConfig  # rank 0's, resolved once
    rank: int
    world_size: int
    store_port: int
    num_threads: int


def connect_to_driver(store: dist.Store, rank: int) -> Connection:
    """Connect to rank 0's step listener (its address is in the store) and say who we are."""
    host, port = store.get(ADDRESS_KEY).decode().rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(store.get(AUTHKEY_KEY).decode()))
    conn.send(rank)
    return conn


def run_spawned_worker(spec: SpawnedRank) -> int:
    """Run a rank that rank 0 started on this machine; return an exit code."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops us
    torch.set_num_threads(spec.num_threads)
    if spec.config.model_config.device.type == "cuda":
        torch.cuda.set_device(spec.rank)
    store = dist.TCPStore(
        "127.0.0.1",
        spec.store_port,
        spec.world_size,
        is_master=False,
        timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
    )
    conn = connect_to_driver(store, spec.rank)
    return run_worker(spec.config, store, spec.rank, spec.world_size, conn)


def run_worker(
    config: EngineConfig, store: dist.Store, rank: int, world_size: int, conn: Connection
) -> int:
    """Build this rank's Worker and run steps until rank 0 stops; return an exit code."""
    try:
        device = config.model_config.device
        group = new_group(store, rank, world_size, device, lambda: _check_rank0(conn))
        worker = Worker(config, group)
        while True:
            try:
                message: SchedulerOutput | None = conn.recv()
            except EOFError:
                logger.error("tensor-parallel rank %d: rank 0 went away; exiting", rank)
                return 1
            if message is None:
                return 0
            worker.execute_model(message)
    except Exception as e:
        logger.exception("tensor-parallel worker rank %d failed", rank)
        with contextlib.suppress(OSError):
            conn.send(WorkerFailure(rank, f"{type(e).__name__}: {e}"))
        return 1


def _check_rank0(conn: Connection) -> None:
    """Raise if rank 0 has gone (it sends nothing while the ranks start up)."""
    if conn.poll():
        raise RuntimeError("rank 0 stopped while the tensor-parallel group was starting")


def main() -> int:
    """Process entry: read this rank's SpawnedRank from standard input and run it."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    spec = pickle.load(sys.stdin.buffer)
    sys.stdin.close()
    return run_spawned_worker(spec)


if __name__ == "__main__":
    sys.exit(main())
