"""The KV cache budget: where each byte of device memory goes, and why (one estimate, reported)."""

from __future__ import annotations

from dataclasses import dataclass

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

    def report(self, is_cpu: bool) -> str:
        """Return the start-up lines that say where every figure came from."""
        if self.source == "explicit":
            return f"Memory: KV cache budget {_gib(self.kv_bytes)} from --kv-cache-memory-bytes"
        usable = int(self.utilization * self.device_bytes)
        left = usable - self.weight_bytes - self.activation_bytes
        device = "RAM" if is_cpu else "device memory"
        why = {
            "left": "what is left",
            "cpu cap": f"the CPU cap of {_gib(CPU_DEFAULT_KV_BYTES)} (set --kv-cache-memory-bytes "
            "to change it)",
            "need": "what --max-num-seqs x max-model-len can fill",
        }[self.source]
        return (
            f"Memory: {device} {_gib(self.device_bytes)} x --gpu-memory-utilization "
            f"{self.utilization} = {_gib(usable)}; weights {_gib(self.weight_bytes)}; "
            f"activations {_gib(self.activation_bytes)} (estimated); left {_gib(left)}; "
            f"KV cache {_gib(self.kv_bytes)}: {why}"
        )


def plan_kv_memory(
    device_bytes: int,
    utilization: float,
    weight_bytes: int,
    activation_bytes: int,
    need_bytes: int,
    is_cpu: bool,
    explicit_bytes: int | None = None,
) -> MemoryPlan:
    """Return the KV budget: explicit, else what is left, capped on CPU and by the need."""
    if explicit_bytes is not None:
        return MemoryPlan(
            device_bytes, utilization, weight_bytes, activation_bytes, need_bytes,
            explicit_bytes, "explicit",
        )  # fmt: skip
    left = int(utilization * device_bytes) - weight_bytes - activation_bytes
    if left <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {_gib(device_bytes)} x {utilization} minus "
            f"weights {_gib(weight_bytes)} and activations {_gib(activation_bytes)}"
        )
    candidates = [(left, "left"), (need_bytes, "need")]
    if is_cpu:  # RAM is shared with everything else on the host
        candidates.append((CPU_DEFAULT_KV_BYTES, "cpu cap"))
    kv_bytes, source = min(candidates)
    return MemoryPlan(
        device_bytes, utilization, weight_bytes, activation_bytes, need_bytes, kv_bytes, source
    )


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f} GiB"
