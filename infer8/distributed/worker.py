"""Ranks 1..N-1: build this rank's shard of the engine, then run each step rank 0 sends.

Rank 0 sends a StepMessage per step over a connection (a pipe for workers it spawned, a socket
for launched ones) and None to stop. Workers never sample: rank 0's tokens of the previous step
arrive with the next step, so every rank's runner holds the same token history. A worker only
ever writes to the connection once, a WorkerFailure, just before it exits.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from infer8.config import EngineArgs, resolve_device
from infer8.core.sched_output import SchedulerOutput
from infer8.distributed.parallel_state import STARTUP_TIMEOUT_S, new_group

logger = logging.getLogger(__name__)


@dataclass
class StepMessage:
    """One step for the workers: the scheduler's output and rank 0's previous samples."""

    scheduler_output: SchedulerOutput
    sampled_token_ids: dict[str, int]  # req_id -> the token rank 0 sampled last step


@dataclass
class WorkerFailure:
    """A worker's last word: why it is exiting."""

    rank: int
    message: str


def run_spawned_worker(
    args: EngineArgs,
    rank: int,
    world_size: int,
    store_port: int,
    conn: Connection,
    num_threads: int,
) -> None:
    """Process entry of a worker that rank 0 spawned on this machine."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops us
    torch.set_num_threads(num_threads)
    if resolve_device(args.device).type == "cuda":
        torch.cuda.set_device(rank)
    store = dist.TCPStore(
        "127.0.0.1",
        store_port,
        world_size,
        is_master=False,
        timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
    )
    sys.exit(run_worker(args, store, rank, world_size, conn))


def run_worker(
    args: EngineArgs, store: dist.Store, rank: int, world_size: int, conn: Connection
) -> int:
    """Build this rank's engine shard and run steps until rank 0 stops; return an exit code."""
    from infer8.engine import LLMEngine  # the engine imports the executor, which imports us

    try:
        device = resolve_device(args.device)
        group = new_group(store, rank, world_size, device, lambda: _check_rank0(conn))
        runner = LLMEngine(args, tp_group=group).runner
        while True:
            try:
                message: StepMessage | None = conn.recv()
            except EOFError:
                logger.error("tensor-parallel rank %d: rank 0 went away; exiting", rank)
                return 1
            if message is None:
                return 0
            for req_id, token_id in message.sampled_token_ids.items():
                runner.states[req_id].output_token_ids.append(token_id)
            runner.execute(message.scheduler_output)
    except Exception as e:
        logger.exception("tensor-parallel worker rank %d failed", rank)
        with contextlib.suppress(OSError):
            conn.send(WorkerFailure(rank, f"{type(e).__name__}: {e}"))
        return 1


def _check_rank0(conn: Connection) -> None:
    """Raise if rank 0 has gone (it sends nothing while the ranks start up)."""
    if conn.poll():
        raise RuntimeError("rank 0 stopped while the tensor-parallel group was starting")
