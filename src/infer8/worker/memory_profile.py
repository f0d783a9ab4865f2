"""The start-up memory profile: a dummy largest step, and the device's memory counters it reads.

The counters are a small protocol so the same profiling code runs with CUDA's allocator
statistics on a GPU and with a stand-in on CPU (tests check the start-up order there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from infer8.attention.kv_cache import KVCacheSpec, LayerKVCache, allocate_kv_cache
from infer8.attention.metadata import AttentionMetadata, build_attention_metadata
from infer8.utils import cdiv

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
    spec = dataclasses.replace(kv_spec, exact_tail_tokens=0, exact_sink_tokens=0, hadamard=False)
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
    """Run the step, then logits and the sampler's float32 copy for max_num_seqs rows, beside
    the penalty tables (worker/penalties.PenaltyRows) a GPU keeps for as many requests."""
    device = step.input_ids.device
    with torch.inference_mode():
        hidden = model(step.input_ids, step.positions, step.meta, step.caches)
        rows = torch.arange(step.max_num_seqs, device=device) % step.input_ids.shape[0]
        logits = model.compute_logits(hidden[rows])  # [max_num_seqs, vocab]
        tables = None
        if device.type == "cuda":  # seen (bool) and counts (int32), every row taken
            tables = torch.empty(logits.shape, dtype=torch.int32, device=device)
            tables = (tables, torch.empty(logits.shape, dtype=torch.bool, device=device))
        probs = torch.softmax(logits.float(), dim=-1)
        del tables
        return probs


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


def warm_up_runtime(
    model: LlamaForCausalLM,
    kv_spec: KVCacheSpec,
    sched: SchedulerConfig,
    max_model_len: int,
    device: torch.device,
    counters: MemoryCounters,
    capture_graphs: Callable[[list[LayerKVCache]], object] | None,
) -> int:
    """Run the serving kernels once on a throwaway cache; return what graph capture took.

    The largest-step profile runs plain prefill only. Serving also loads the decode, exact-tail
    and rotation kernels, every sampler path (top-k / top-p / min-p, penalties, seeds,
    logprobs) and, with CUDA graphs, the graphs themselves: on a GPU each kernel module a
    first call loads and each instantiated graph takes device memory outside the allocator.
    Running them here, before measure_other_bytes, puts that memory in the plan instead of
    past the --gpu-memory-utilization budget. Returns the device bytes (all of them, as the
    driver counts them) that capturing the decode graphs on the throwaway cache took; 0
    without graphs.
    """
    from infer8.core.exact_tail_seats import TailSeat
    from infer8.core.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
    from infer8.sampling_params import SamplingParams
    from infer8.worker.model_runner import ModelRunner

    block_size = kv_spec.block_size
    params = [
        SamplingParams(temperature=0.0, max_tokens=2),
        SamplingParams(
            temperature=0.8, top_p=0.9, top_k=20, repetition_penalty=1.05, seed=1, max_tokens=2
        ),  # fmt: skip
        SamplingParams(min_p=0.05, presence_penalty=0.5, frequency_penalty=0.5, max_tokens=2),
        SamplingParams(logprobs=5, max_tokens=2),
    ][: max(1, min(4, sched.max_num_seqs))]
    # one long prompt up to the step's token budget, the others one token each
    long_len = max(1, min(max_model_len - 1, sched.max_num_batched_tokens - (len(params) - 1)))
    lens = [long_len] + [1] * (len(params) - 1)
    block_ids, next_block = [], 1  # block 0 stays unused, as the scheduler keeps it
    for n in lens:
        num_blocks = cdiv(n + 1, block_size)  # the prompt and one decoded token
        block_ids.append(list(range(next_block, next_block + num_blocks)))
        next_block += num_blocks
    caches = allocate_kv_cache(
        kv_spec, next_block, device, len(params) if kv_spec.exact_tail_tokens else 0
    )
    runner = ModelRunner(model, caches, block_size, device, exact_tail=kv_spec)
    new = [
        NewRequestData(f"warm-up-{i}", [i + 1] * n, p) for i, (n, p) in enumerate(zip(lens, params))
    ]
    # each its own tail row and sink slot, as the scheduler would seat them
    seats = [TailSeat(i, 0, i if kv_spec.exact_sink_tokens else -1, True) for i in range(len(new))]
    prefill = SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled=[
            ScheduledRequest(r.req_id, 0, n, b, tail=seat)
            for r, n, b, seat in zip(new, lens, block_ids, seats)
        ],
    )
    runner.execute(prefill)
    decode = SchedulerOutput(
        scheduled=[  # no new blocks: the prefill step sent them all
            ScheduledRequest(r.req_id, n, 1, [], tail=seat) for r, n, seat in zip(new, lens, seats)
        ],
        new_token_ids={r.req_id: [1] for r in new},
    )
    runner.execute(decode)
    graph_bytes = 0
    if capture_graphs is not None:
        counters.synchronize()
        free_before = counters.mem_get_info()[0]
        graphs = capture_graphs(caches)
        counters.synchronize()
        graph_bytes = max(0, free_before - counters.mem_get_info()[0])
        del graphs
    del runner, caches
    counters.synchronize()
    counters.empty_cache()
    return graph_bytes
