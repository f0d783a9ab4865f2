"""One rank's view of a tensor-parallel group: its collectives and the store the ranks share.

The group is a plain object passed to the model and the engine (no torch.distributed default
group, so several engines can live in one process). Collectives run on NCCL for CUDA tensors
and gloo on CPU; a peer that dies closes its connections, so a collective waiting on it fails
at once rather than at the timeout, which only bounds a peer that is alive but stuck.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol, cast

import torch
import torch.distributed as dist

# A collective waits this long for a live but stuck peer (dead peers fail it at once).
COLLECTIVE_TIMEOUT_S = 60.0
# Start-up waits (process start, loading a shard) poll peer liveness, so this is only a bound.
STARTUP_TIMEOUT_S = 1800.0
_POLL_S = 0.05


class Collectives(Protocol):
    """The collectives of a gloo or NCCL backend that the group uses."""

    def allreduce(self, tensors: list[torch.Tensor]) -> dist.Work: ...

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor]
    ) -> dist.Work: ...


@dataclass
class TensorParallelGroup:
    """Owns this rank's process group and the key-value store shared by the ranks."""

    rank: int
    world_size: int
    process_group: Collectives
    store: dist.Store
    # Raises RuntimeError if a peer has died; called while waiting on the store.
    check_peers: Callable[[], None]
    _num_exchanges: int = field(default=0, repr=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; return it."""
        self.process_group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dim, in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.process_group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def exchange(self, name: str, value: int) -> list[int]:
        """Return every rank's `value` (start-up agreement; waits for peers still loading)."""
        prefix = f"exchange/{self._num_exchanges}/{name}"
        self._num_exchanges += 1
        self.store.set(f"{prefix}/{self.rank}", str(value))
        keys = [f"{prefix}/{rank}" for rank in range(self.world_size)]
        wait_for_keys(self.store, keys, self.check_peers, what=f"every rank's {name}")
        return [int(self.store.get(key)) for key in keys]


def wait_for_keys(
    store: dist.Store,
    keys: list[str],
    check_peers: Callable[[], None],
    what: str,
    timeout_s: float = STARTUP_TIMEOUT_S,
) -> None:
    """Wait until the store holds `keys`, checking peer liveness meanwhile (never hangs on one)."""
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        check_peers()
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor parallelism: gave up waiting {timeout_s:.0f} s for {what}")
        time.sleep(_POLL_S)


def new_group(
    store: dist.Store,
    rank: int,
    world_size: int,
    device: torch.device,
    check_peers: Callable[[], None],
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
) -> TensorParallelGroup:
    """Join the group: wait until every rank has arrived, then connect the process group."""
    store = dist.PrefixStore("infer8/tp", store)
    store.set(f"arrived/{rank}", "1")
    keys = [f"arrived/{r}" for r in range(world_size)]
    wait_for_keys(store, keys, check_peers, what="every rank to start")
    timeout = timedelta(seconds=timeout_s)
    pg_store = dist.PrefixStore("pg", store)
    backend: dist.ProcessGroupNCCL | dist.ProcessGroupGloo
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        backend = dist.ProcessGroupNCCL(pg_store, rank, world_size, options)
    else:
        backend = dist.ProcessGroupGloo(pg_store, rank, world_size, timeout)
    # torch's type stubs leave the collectives off the backend classes.
    return TensorParallelGroup(rank, world_size, cast(Collectives, backend), store, check_peers)
