"""Rank 0's side of tensor parallelism: start or join the workers, send each step, watch them.

The scheduler runs only here. Each step its plain-data output (with the tokens rank 0 sampled
last step) goes to every worker, then rank 0's own Worker runs its shard; the ranks meet in the
all-reduces of the forward pass and only rank 0 samples. A worker that dies fails the step with an error naming it, within moments: its closed
connections fail the collective waiting on it, and its exit is checked before every step.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from infer8.config import EngineConfig
from infer8.core.sched_output import ModelRunnerOutput, SchedulerOutput
from infer8.distributed.parallel_state import STARTUP_TIMEOUT_S, TensorParallelGroup, new_group
from infer8.distributed.sharding import check_tensor_parallel_size
from infer8.executor import launch
from infer8.executor.rank import ADDRESS_KEY, AUTHKEY_KEY, SpawnedRank, WorkerFailure
from infer8.models.llama import LlamaArchConfig
from infer8.models.loader import read_hf_config
from infer8.worker.worker import Worker

if TYPE_CHECKING:
    from infer8.models.gguf_loader import GGUFModel
    from infer8.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# After a failed step, how long to wait for a dying worker's exit to become visible.
_DEATH_GRACE_S = 2.0
# On shutdown, how long a worker may take to exit before it is killed.
_SHUTDOWN_S = 5.0


class RankProcess:
    """A rank started here as `python -m infer8.executor.rank` (its own process).

    `sentinel` is the read end of a pipe whose write end only the child holds: it becomes
    readable (EOF) the moment the child exits, so `multiprocessing.connection.wait` can watch
    it beside the connections.
    """

    def __init__(self, spec: SpawnedRank) -> None:
        read_fd, write_fd = os.pipe()
        env = dict(os.environ)
        # the package as this process imports it, installed or not
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        self._popen = subprocess.Popen(
            [sys.executable, "-m", "infer8.executor.rank"],
            stdin=subprocess.PIPE,
            pass_fds=(write_fd,),
            env=env,
        )
        os.close(write_fd)
        self.sentinel = read_fd
        assert self._popen.stdin is not None
        with self._popen.stdin:
            pickle.dump(spec, self._popen.stdin)

    @property
    def pid(self) -> int:
        """Return the process id."""
        return self._popen.pid

    @property
    def exitcode(self) -> int | None:
        """Return the exit code (negative: killed by that signal), None while running."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        """Return whether the process is still running."""
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` seconds for the process to exit."""
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        """Kill the process (SIGKILL)."""
        self._popen.kill()

    def close(self) -> None:
        """Release the sentinel (after the process has been reaped)."""
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


@dataclass
class WorkerHandle:
    """Rank 0's link to one worker: its connection, and its process if rank 0 started it."""

    rank: int
    conn: Connection
    process: RankProcess | None = None  # None for a worker a launcher started
    failure: str | None = None

    def find_failure(self) -> str | None:
        """Return why this worker is gone (failed, died, disconnected), or None if it is up."""
        if self.failure is None:
            self.failure = self._probe()
        return self.failure

    def _probe(self) -> str | None:
        try:
            has_news = self.conn.poll()  # workers only write when failing; EOF when dead
        except OSError:
            has_news = True
        if has_news:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                message = None
            if isinstance(message, WorkerFailure):
                return f"failed: {message.message}"
            if self.process is None:
                return "disconnected (it died, or the network to it failed)"
        if self.process is not None:
            if has_news:
                self.process.join(_DEATH_GRACE_S)  # the pipe closed: the exit is moments away
            if not self.process.is_alive():
                return f"died ({_describe_exit(self.process.exitcode)})"
        return None


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"exit code {exitcode}, killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


class TensorParallelExecutor:
    """Owns the workers of ranks 1..N-1 (their processes when spawned here) and rank 0's group."""

    can_reset = False  # after a failure the other ranks' state cannot be trusted

    def __init__(self, workers: list[WorkerHandle]) -> None:
        self.workers = workers
        self._group: TensorParallelGroup | None = None
        self.driver_worker: Worker | None = None  # rank 0's, built once the group is up
        # Stops the workers when the engine is collected or the interpreter exits.
        self._finalizer = weakref.finalize(self, _stop_workers, list(workers))

    @property
    def group(self) -> TensorParallelGroup:
        """Return rank 0's tensor-parallel group."""
        assert self._group is not None, "the executor has not joined its group"
        return self._group

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        gguf: GGUFModel | None = None,
        structured_output: StructuredOutputManager | None = None,
    ) -> TensorParallelExecutor:
        """Start ranks 1..N-1 here, or join those a launcher started; build rank 0's Worker."""
        model_path = config.model_config.model
        world_size = config.parallel_config.tensor_parallel_size
        if Path(model_path).is_dir():  # refuse a bad split before starting any process
            hf_config = read_hf_config(Path(model_path))
            arch_config = LlamaArchConfig.from_hf_config(hf_config)
            check_tensor_parallel_size(arch_config, world_size)
            from infer8.models.fp8_weights import fp8_checkpoint_scheme

            if fp8_checkpoint_scheme(hf_config) is not None:
                raise ValueError(
                    "FP8-weight checkpoints do not support tensor parallelism yet; load the "
                    "16-bit checkpoint with --quantization fp8 (quantized per rank at load)"
                )
        device = config.model_config.device  # every rank loads the same files, on its device
        env = launch.launched_env(world_size)
        if env is None:
            executor = cls._spawn(config, device)
        elif env.rank != 0:
            raise ValueError(
                f"launched as rank {env.rank}: only rank 0 builds the engine; start every rank "
                "with `infer8 serve`, whose other ranks run the worker loop"
            )
        else:
            executor = cls._join_launched(env, device)
        try:
            executor.driver_worker = Worker(
                config, executor.group, gguf, structured_output=structured_output
            )
        except BaseException:
            executor.shutdown()
            raise
        return executor

    @classmethod
    def _spawn(cls, config: EngineConfig, device: torch.device) -> TensorParallelExecutor:
        world_size = config.parallel_config.tensor_parallel_size
        store = dist.TCPStore(
            "127.0.0.1",
            0,
            world_size,
            is_master=True,
            timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
            wait_for_workers=False,
        )
        authkey = os.urandom(32)
        with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
            store.set(AUTHKEY_KEY, authkey.hex())
            store.set(ADDRESS_KEY, f"127.0.0.1:{listener.address[1]}")
            processes = {
                rank: RankProcess(
                    SpawnedRank(config, rank, world_size, store.port, torch.get_num_threads())
                )
                for rank in range(1, world_size)
            }
            try:
                conns = _accept(listener, world_size - 1, processes)
            except BaseException:
                for process in processes.values():
                    process.kill()
                    process.join()
                    process.close()
                raise
        workers = [WorkerHandle(rank, conns[rank], processes[rank]) for rank in sorted(conns)]
        return cls(workers)._join_group(store, world_size, device)

    @classmethod
    def _join_launched(cls, env: launch.LaunchEnv, device: torch.device) -> TensorParallelExecutor:
        if device.type == "cuda":
            torch.cuda.set_device(env.local_rank)
        store = launch.rendezvous_store(env)
        authkey = os.urandom(32)
        with Listener(("0.0.0.0", 0), authkey=authkey) as listener:
            store.set(AUTHKEY_KEY, authkey.hex())
            store.set(ADDRESS_KEY, f"{env.master_addr}:{listener.address[1]}")
            conns = _accept(listener, env.world_size - 1)
        executor = cls([WorkerHandle(rank, conn) for rank, conn in sorted(conns.items())])
        return executor._join_group(store, env.world_size, device)

    def _join_group(
        self, store: dist.Store, world_size: int, device: torch.device
    ) -> TensorParallelExecutor:
        # A weak reference: the group lives in the model's layers and must not keep the
        # executor (whose collection stops the workers) alive.
        check_workers = weakref.WeakMethod(self.check_workers)

        def check_peers() -> None:
            method = check_workers()
            if method is not None:
                method()

        self._group = new_group(store, 0, world_size, device, check_peers)
        return self

    def find_failure(self, wait_s: float = 0.0) -> str | None:
        """Return what happened to the first worker that failed or died (waiting up to wait_s)."""
        ready: list[Connection | int] = [w.conn for w in self.workers]
        ready += [w.process.sentinel for w in self.workers if w.process is not None]
        deadline_s = time.monotonic() + wait_s
        while True:
            left_s = max(0.0, deadline_s - time.monotonic())
            if any(w.failure for w in self.workers) or wait(ready, timeout=left_s):
                for worker in self.workers:
                    failure = worker.find_failure()
                    if failure is not None:
                        return f"tensor-parallel worker rank {worker.rank} {failure}"
            # A dying process closes its files one by one: its socket can fail the collective
            # before its pipe reads EOF or it can be reaped. Look again until wait_s is up.
            if time.monotonic() >= deadline_s:
                return None
            time.sleep(0.02)

    def is_healthy(self) -> bool:
        """Return whether every worker is up (safe from any thread: it reads nothing)."""
        if not self._finalizer.alive or any(w.failure is not None for w in self.workers):
            return False
        watched: list[Connection | int] = [w.conn for w in self.workers]
        watched += [w.process.sentinel for w in self.workers if w.process is not None]
        return not wait(watched, timeout=0)

    def check_workers(self) -> None:
        """Raise RuntimeError if a worker has failed or died."""
        failure = self.find_failure()
        if failure is not None:
            raise RuntimeError(failure)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Send the step to the workers, run rank 0's shard and sample; return the samples."""
        assert self.driver_worker is not None
        self.check_workers()
        try:
            for worker in self.workers:
                worker.conn.send(scheduler_output)
            return self.driver_worker.execute_model(scheduler_output)
        except Exception as e:
            # A dead peer surfaces as a broken pipe or a failed collective: name it.
            failure = self.find_failure(wait_s=_DEATH_GRACE_S)
            if failure is not None:
                raise RuntimeError(failure) from e
            raise

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""
        self._finalizer()


def _accept(
    listener: Listener, num_workers: int, processes: dict[int, RankProcess] | None = None
) -> dict[int, Connection]:
    """Accept every worker's connection (each first sends its rank), or fail after a timeout.

    With the processes started here, a rank that exits before connecting fails this at once.
    """
    conns: dict[int, Connection] = {}

    def accept_all() -> None:
        while len(conns) < num_workers:
            conn = listener.accept()
            conns[conn.recv()] = conn

    thread = threading.Thread(target=accept_all, name="infer8-tp-accept", daemon=True)
    thread.start()
    deadline_s = STARTUP_TIMEOUT_S
    while thread.is_alive() and deadline_s > 0:
        thread.join(0.1)
        deadline_s -= 0.1
        for rank, process in (processes or {}).items():
            if rank not in conns and not process.is_alive():
                raise RuntimeError(
                    f"tensor-parallel worker rank {rank} exited while starting "
                    f"({_describe_exit(process.exitcode)}); its error is printed above"
                )
    if len(conns) < num_workers:
        raise RuntimeError(
            f"tensor parallelism: {len(conns)} of {num_workers} workers connected to rank 0 "
            f"within {STARTUP_TIMEOUT_S:.0f} s"
        )
    return conns


def _stop_workers(workers: list[WorkerHandle]) -> None:
    """Tell every worker to exit, then make sure the ones started here did."""
    for worker in workers:
        try:
            worker.conn.send(None)
        except OSError:
            pass
    for worker in workers:
        if worker.process is not None:
            worker.process.join(_SHUTDOWN_S)
            if worker.process.is_alive():
                logger.warning(
                    "tensor-parallel worker rank %d did not stop; killing it", worker.rank
                )
                worker.process.kill()
                worker.process.join(_SHUTDOWN_S)
            worker.process.close()
        worker.conn.close()
