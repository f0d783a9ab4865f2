"""The KV cache budget: where each byte of device memory goes, and why (one estimate, reported)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at import: `infer8 plan` uses this module too
    import torch

GiB = 1 << 30
# With no budget given on CPU, take at most this much RAM for the cache (vLLM's CPU default).
CPU_DEFAULT_KV_BYTES = 4 * GiB


@dataclass(frozen=True)
class MemoryPlan:
    """The KV budget and the figures it came from."""

    device_bytes: int
    utilization: float
    weight_bytes: int
    activation_bytes: int
    need_bytes: int  # what max_num_seqs requests of max_model_len tokens would fill
    kv_bytes: int
    source: str  # "explicit" | "left" | "cpu cap" | "need"
    other_bytes: int = 0  # held by other processes on the device (CUDA: mem_get_info)
    graph_bytes: int = 0  # reserve for CUDA graphs
    is_measured: bool = False  # activations from a profiled step, not the estimate

    def report(self, is_cpu: bool) -> str:
        """Return the start-up lines that say where every figure came from."""
        if self.source == "explicit":
            return f"Memory: KV cache budget {_gib(self.kv_bytes)} from --kv-cache-memory-bytes"
        usable = int(self.utilization * self.device_bytes)
        left = left_for_kv_bytes(
            self.device_bytes,
            self.utilization,
            self.weight_bytes,
            self.activation_bytes + self.other_bytes + self.graph_bytes,
        )
        device = "RAM" if is_cpu else "device memory"
        why = {
            "left": "what is left",
            "cpu cap": f"the CPU cap of {_gib(CPU_DEFAULT_KV_BYTES)} (set --kv-cache-memory-bytes "
            "to change it)",
            "need": "what --max-num-seqs x max-model-len can fill",
        }[self.source]
        others = f"other processes {_gib(self.other_bytes)}; " if self.other_bytes else ""
        graphs = f"CUDA graphs {_gib(self.graph_bytes)}; " if self.graph_bytes else ""
        how = "measured" if self.is_measured else "estimated"
        return (
            f"Memory: {device} {_gib(self.device_bytes)} x --gpu-memory-utilization "
            f"{self.utilization} = {_gib(usable)}; {others}weights {_gib(self.weight_bytes)}; "
            f"activations {_gib(self.activation_bytes)} ({how}); {graphs}left {_gib(left)}; "
            f"KV cache {_gib(self.kv_bytes)}: {why}"
        )


def device_memory_bytes(device: torch.device) -> int:
    """Return the device's total memory (RAM on CPU)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def estimate_activation_bytes(
    hidden_size: int,
    intermediate_size: int,
    vocab_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
) -> int:
    """Return the activation reserve of the largest step on one rank (engine and planner).

    `intermediate_size` is this rank's share under tensor parallelism; the hidden states and
    the gathered logits are not split. Hidden states, fused projections and logits, float32
    (the widest compute dtype), twice over for the buffers a step keeps alive at once.
    """
    hidden_bytes = 4 * max_num_batched_tokens * (4 * hidden_size + 2 * intermediate_size) * 2
    logits_bytes = max_num_seqs * vocab_size * 4 * 2
    return hidden_bytes + logits_bytes


def cuda_graph_bytes(
    max_num_seqs: int,
    hidden_size: int,
    intermediate_size: int,
    num_heads: int,
    head_dim: int,
    num_splits: int,
    num_bucket_rows: int,
    dtype_bytes: int = 2,
) -> int:
    """Return the reserve for the decode graphs' memory pool (captured after the KV cache).

    The largest bucket's step: the split-K decode partials (float32 [B, heads, splits,
    head_dim] and [B, heads, splits]), and its hidden states and projections as
    estimate_activation_bytes counts them; plus each bucket's static output [rows, hidden].
    Heads and intermediate_size are this rank's.
    """
    split_bytes = max_num_seqs * num_heads * num_splits * (head_dim + 1) * 4
    step_bytes = estimate_activation_bytes(hidden_size, intermediate_size, 0, max_num_seqs, 0)
    return split_bytes + step_bytes + num_bucket_rows * hidden_size * dtype_bytes


def left_for_kv_bytes(
    device_bytes: int, utilization: float, weight_bytes: int, activation_bytes: int
) -> int:
    """Return utilization x device memory minus weights and activations (negative: short)."""
    return int(utilization * device_bytes) - weight_bytes - activation_bytes


def plan_kv_memory(
    device_bytes: int,
    utilization: float,
    weight_bytes: int,
    activation_bytes: int,
    need_bytes: int,
    is_cpu: bool,
    explicit_bytes: int | None = None,
    other_bytes: int = 0,
    graph_bytes: int = 0,
    is_measured: bool = False,
) -> MemoryPlan:
    """Return the KV budget: explicit, else what is left, capped on CPU and by the need."""
    figures = dict(other_bytes=other_bytes, graph_bytes=graph_bytes, is_measured=is_measured)
    if explicit_bytes is not None:
        return MemoryPlan(
            device_bytes, utilization, weight_bytes, activation_bytes, need_bytes,
            explicit_bytes, "explicit", **figures,
        )  # fmt: skip
    reserved = activation_bytes + other_bytes + graph_bytes
    left = left_for_kv_bytes(device_bytes, utilization, weight_bytes, reserved)
    if left <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {_gib(device_bytes)} x {utilization} minus "
            f"weights {_gib(weight_bytes)}, activations {_gib(activation_bytes)}"
            + (f", other processes {_gib(other_bytes)}" if other_bytes else "")
            + (f", CUDA graphs {_gib(graph_bytes)}" if graph_bytes else "")
        )
    candidates = [(left, "left"), (need_bytes, "need")]
    if is_cpu:  # RAM is shared with everything else on the host
        candidates.append((CPU_DEFAULT_KV_BYTES, "cpu cap"))
    kv_bytes, source = min(candidates)
    return MemoryPlan(
        device_bytes, utilization, weight_bytes, activation_bytes, need_bytes, kv_bytes, source,
        **figures,
    )  # fmt: skip


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f} GiB"
