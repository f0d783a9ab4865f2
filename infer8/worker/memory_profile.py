"""The start-up memory profile: a dummy largest step, and the device's memory counters it reads.

The counters are a small protocol so the same profiling code runs with CUDA's allocator
statistics on a GPU and with a stand-in on CPU (tests check the start-up order there).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from infer8.attention.metadata import AttentionMetadata, build_attention_metadata
from infer8.core.kv_cache_manager import cdiv
from infer8.worker.kv_cache import KVCacheSpec, LayerKVCache, allocate_kv_cache

if TYPE_CHECKING:
    from infer8.config import SchedulerConfig
    from infer8.models.llama import LlamaForCausalLM


class MemoryCounters(Protocol):
    """What the profile reads from a device's allocator and driver."""

    def synchronize(self) -> None:
        """Wait for queued work, so the counters are final."""

    def empty_cache(self) -> None:
        """Return cached, unused allocator blocks to the device."""

    def mem_get_info(self) -> tuple[int, int]:
        """Return (free, total) bytes of the device, all processes together."""

    def reserved_bytes(self) -> int:
        """Return the bytes this process's allocator holds (in use or cached)."""

    def allocated_bytes(self) -> int:
        """Return the bytes of live tensors."""

    def reset_peak(self) -> None:
        """Start a new peak of allocated bytes from now."""

    def peak_allocated_bytes(self) -> int:
        """Return the most bytes allocated at once since reset_peak."""


class CudaMemoryCounters:
    """MemoryCounters over torch.cuda's caching allocator and cudaMemGetInfo."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def mem_get_info(self) -> tuple[int, int]:
        free_bytes, total_bytes = torch.cuda.mem_get_info(self.device)
        return int(free_bytes), int(total_bytes)

    def reserved_bytes(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def allocated_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_allocated_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))


@dataclass
class ProfileStep:
    """The inputs of the largest step: a throwaway cache, its metadata, token ids, positions."""

    caches: list[LayerKVCache]
    meta: AttentionMetadata
    input_ids: torch.Tensor  # [max_num_batched_tokens] int64
    positions: torch.Tensor  # [max_num_batched_tokens] int64
    max_num_seqs: int

    @property
    def cache_bytes(self) -> int:
        """Return the bytes of the throwaway cache (not activations)."""
        return sum(
            t.numel() * t.element_size()
            for c in self.caches
            for t in (c.k, c.v, c.k_scale, c.v_scale)
            if t is not None
        )


def build_profile_step(
    kv_spec: KVCacheSpec,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_len: int,
    device: torch.device,
) -> ProfileStep:
    """Build the largest step the scheduler can hand out on a cache of its own.

    max_num_batched_tokens prompt tokens in sequences of at most max_len tokens.
    """
    spec = dataclasses.replace(kv_spec, exact_tail_tokens=0, hadamard=False)
    query_lens = [min(max_len, max_num_batched_tokens - i)
                  for i in range(0, max_num_batched_tokens, max_len)]  # fmt: skip
    block_ids, next_block = [], 0
    for n in query_lens:
        num_blocks = cdiv(n, spec.block_size)
        block_ids.append(list(range(next_block, next_block + num_blocks)))
        next_block += num_blocks
    caches = allocate_kv_cache(spec, next_block, device)
    meta = build_attention_metadata(
        query_lens, [0] * len(query_lens), block_ids, spec.block_size, device
    )
    input_ids = torch.zeros(max_num_batched_tokens, dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in query_lens])
    return ProfileStep(caches, meta, input_ids, positions, max_num_seqs)


def run_profile_step(model: LlamaForCausalLM, step: ProfileStep) -> torch.Tensor:
    """Run the step, then logits and the sampler's float32 copy for max_num_seqs rows."""
    device = step.input_ids.device
    with torch.inference_mode():
        hidden = model(step.input_ids, step.positions, step.meta, step.caches)
        rows = torch.arange(step.max_num_seqs, device=device) % step.input_ids.shape[0]
        logits = model.compute_logits(hidden[rows])  # [max_num_seqs, vocab]
        return torch.softmax(logits.float(), dim=-1)


def profile_step(
    model: LlamaForCausalLM,
    kv_spec: KVCacheSpec,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_len: int,
    device: torch.device,
) -> torch.Tensor:
    """Run the largest step the scheduler can hand out on a throwaway cache; return its probs."""
    step = build_profile_step(kv_spec, max_num_batched_tokens, max_num_seqs, max_len, device)
    return run_profile_step(model, step)


def measure_activation_bytes(
    model: LlamaForCausalLM,
    kv_spec: KVCacheSpec,
    sched: SchedulerConfig,
    device: torch.device,
    counters: MemoryCounters,
) -> int:
    """Return the allocator's peak over the largest step, less what was live before it.

    The throwaway cache and the step's inputs are allocated before the peak is reset, so they
    count as neither activations nor (once freed) anything else.
    """
    max_len = model.config.max_position_embeddings
    step = build_profile_step(
        kv_spec, sched.max_num_batched_tokens, sched.max_num_seqs, max_len, device
    )
    counters.synchronize()
    counters.empty_cache()
    counters.reset_peak()
    before = counters.allocated_bytes()
    run_profile_step(model, step)
    counters.synchronize()
    peak = counters.peak_allocated_bytes() - before
    del step
    counters.empty_cache()
    return max(0, peak)


def measure_other_bytes(counters: MemoryCounters) -> int:
    """Return device memory outside this process's allocator: other processes, and this
    process's CUDA context, library workspaces and loaded kernels.

    Read after the profile (the kernels and workspaces it loaded stay) and after emptying the
    allocator's cache, with free and reserved read back to back.
    """
    counters.synchronize()
    counters.empty_cache()
    free_bytes, total_bytes = counters.mem_get_info()
    return max(0, total_bytes - free_bytes - counters.reserved_bytes())
