"""Executors: run each step on one Worker in this process, or on tensor-parallel ranks.

An executor knows the Worker, never the engine: the engine hands it a SchedulerOutput (plain
data, the previous step's sampled tokens inside) and gets a ModelRunnerOutput back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from infer8.config import EngineConfig
from infer8.core.sched_output import ModelRunnerOutput, SchedulerOutput
from infer8.worker.worker import Worker

if TYPE_CHECKING:
    from infer8.models.gguf_loader import GGUFModel
    from infer8.structured_output.manager import StructuredOutputManager


class Executor(Protocol):
    """What the engine needs from the device side."""

    driver_worker: Worker  # rank 0's worker, in this process
    can_reset: bool  # whether a failed step can be recovered in-process

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def is_healthy(self) -> bool: ...

    def shutdown(self) -> None: ...


class UniProcExecutor:
    """One Worker in this process (no tensor parallelism)."""

    can_reset = True

    def __init__(self, worker: Worker) -> None:
        self.driver_worker = worker

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step on the worker."""
        return self.driver_worker.execute_model(scheduler_output)

    def is_healthy(self) -> bool:
        """Return True: a worker in this process cannot die on its own."""
        return True

    def shutdown(self) -> None:
        """Nothing to stop."""


def create_executor(
    config: EngineConfig,
    gguf: GGUFModel | None = None,
    structured_output: StructuredOutputManager | None = None,
) -> Executor:
    """Build the workers for this config: one here, or one per tensor-parallel rank (rank 0's
    with the engine's grammars)."""
    if config.parallel_config.tensor_parallel_size > 1:
        from infer8.executor.tensor_parallel import TensorParallelExecutor

        return TensorParallelExecutor.start(config, gguf, structured_output)
    return UniProcExecutor(Worker(config, None, gguf, structured_output=structured_output))
