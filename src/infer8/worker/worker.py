"""Worker: one rank's device side: the model shard, the KV cache, the attention backend, graphs.

Rank 0 and ranks 1..N-1 build the same Worker from the same EngineConfig (resolved once, from
the engine down); the engine (rank 0 only) keeps the tokenizer, the scheduler and output
processing, reaches the device only through `execute_model(SchedulerOutput) ->
ModelRunnerOutput`, and reads what the worker sized as plain data (WorkerInfo).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from infer8.attention import select_backend
from infer8.attention.exact_tail import describe_exact_tail
from infer8.attention.kv_cache import KVCacheSpec, LayerKVCache, allocate_kv_cache
from infer8.config import EngineArgs, EngineConfig, ModelConfig, SchedulerConfig
from infer8.core.exact_tail_seats import TailSeat
from infer8.core.sched_output import ModelRunnerOutput, SchedulerOutput
from infer8.distributed.parallel_state import TensorParallelGroup
from infer8.distributed.sharding import TensorParallelShard
from infer8.host_memory import HostMemory
from infer8.kernels.cpu import NativeKernels
from infer8.lora.slots import LoRAManager, LoRASlots
from infer8.models.llama import LlamaArchConfig, LlamaForCausalLM
from infer8.models.loader import load_model, read_model_config
from infer8.quant import fp8
from infer8.utils import cdiv
from infer8.worker.cpu_linear import (
    bound_kernel_caches,
    pack_linear_layers,
    packing_applies,
    probe_packing,
)
from infer8.worker.kv_offload import HostKVCache, num_host_blocks_for
from infer8.worker.kv_populate import StepGate, populate_in_background
from infer8.worker.kv_scale_source import resolve_kv_scales
from infer8.worker.memory import (
    GiB,
    MemoryPlan,
    cuda_graph_bytes,
    device_memory_bytes,
    estimate_activation_bytes,
    plan_kv_memory,
)
from infer8.worker.memory_profile import (
    CudaMemoryCounters,
    MemoryCounters,
    measure_activation_bytes,
    measure_other_bytes,
    warm_up_runtime,
)
from infer8.worker.model_runner import ModelRunner
from infer8.worker.sampler import Sampler

if TYPE_CHECKING:
    from infer8.models.gguf_loader import GGUFModel
    from infer8.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# compute dtypes of the native element-wise passes (csrc/elementwise.c) on CPU
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker sized at start-up, as the engine reads it (plain data)."""

    kv_spec: KVCacheSpec
    num_blocks: int
    num_tail_rows: int  # exact-tail seats: the most requests that run at once with a tail
    num_host_blocks: int
    max_model_len: int
    vocab_size: int
    kv_scale_source: str  # none, dynamic, dynamic (static scales missing), static (...)


class Worker:
    """Owns one rank's model shard, KV cache tensors, attention backend, runner and graphs."""

    def __init__(
        self,
        config: EngineConfig,
        tp_group: TensorParallelGroup | None = None,
        gguf: GGUFModel | None = None,
        memory_counters: MemoryCounters | None = None,
        structured_output: StructuredOutputManager | None = None,
    ) -> None:
        """Load the shard, size and allocate the KV cache, choose the backend, capture graphs.

        With no --kv-cache-memory-bytes the cache gets what is left after a profiled largest
        step, read from `memory_counters` (CUDA's allocator on a GPU; on CPU only if given).
        structured_output: rank 0's grammars, applied to logits before sampling.
        """
        model_config, cache_config = config.model_config, config.cache_config
        scheduler_config, model_path = config.scheduler_config, config.model_config.model
        if memory_counters is None and model_config.device.type == "cuda":
            memory_counters = CudaMemoryCounters(model_config.device)
        self.memory_counters = memory_counters
        self.cache_config, self.scheduler_config = cache_config, scheduler_config
        self.tp_group = tp_group
        self.is_driver = tp_group is None or tp_group.rank == 0
        device = model_config.device
        if device.type == "cpu":  # before any oneDNN op: its caches read the cap once
            bound_kernel_caches()
        model, self.hf_config, ckpt_kv_scales = load_model(
            model_path, model_config.dtype, device, tp_group, gguf, config.quantization
        )
        self.tp_shard: TensorParallelShard | None = None
        if tp_group is not None:
            arch_config = LlamaArchConfig.from_hf_config(self.hf_config)
            self.tp_shard = TensorParallelShard(arch_config, tp_group.rank, tp_group.world_size)
        self.packed_linear_layers = self._pack_cpu_weights(model, model_config, scheduler_config)
        if model_config.device.type == "cpu":  # steps' large activations reuse heap blocks
            HostMemory().reuse_large_blocks()
        native = None  # the CPU's compiled kernels: built once per machine, None without a compiler
        if model_config.device.type == "cpu" and model_config.dtype in _NATIVE_DTYPES:
            native = NativeKernels.load()
            if native is not None:
                model.set_elementwise_ops(native.elementwise)
        arch = model.config
        kv_dtype = cache_config.kv_cache_dtype.torch_dtype(model_config.dtype)
        static_scales, self.kv_scale_source = resolve_kv_scales(
            cache_config, kv_dtype, ckpt_kv_scales, self.tp_shard, arch.num_hidden_layers,
            arch.num_key_value_heads, arch.head_dim, self.is_driver,
        )  # fmt: skip
        tail_tokens = cache_config.kv_cache_exact_tail_tokens or 0  # resolved in the config
        self.kv_spec = KVCacheSpec(
            num_layers=arch.num_hidden_layers,
            num_kv_heads=arch.num_key_value_heads,
            head_dim=arch.head_dim,
            block_size=cache_config.block_size,
            dtype=kv_dtype,
            exact_tail_tokens=tail_tokens,
            exact_sink_tokens=cache_config.kv_cache_exact_sink_tokens or 0,
            hadamard=bool(cache_config.kv_cache_hadamard),
            kv_scale="static" if static_scales is not None else "dynamic",
        )
        # decode steps replay CUDA graphs on CUDA unless --enforce-eager (an exact tail too)
        self.uses_cuda_graphs = cuda_graphs_apply(device, model_config.enforce_eager)
        self.attn_backend = select_backend(device, self.kv_spec, native)
        model.set_attention_backend(self.attn_backend)
        if self.kv_spec.is_fp8 and self.kv_spec.kv_scale == "dynamic":
            # keys less their k bias's mean rotation: exact for attention, and the FP8 scale
            # then follows what varies (Qwen2's bias puts offsets of 100-200 in a few channels)
            model.set_key_offsets(model_config.max_model_len)
        # --enable-lora: the adapters' device slots are buffers of the model, so the KV budget
        # counts them with the weights
        self.lora_manager: LoRAManager | None = None
        if config.lora_config is not None:
            lora = config.lora_config
            arch_config = model.config  # the whole model's: LoRA refuses tensor parallelism
            # float32 copies of the slots for the CPU kernel (csrc/lora.c)
            model.lora_slots = LoRASlots(
                arch_config, lora.max_loras, lora.max_lora_rank, model_config.dtype, device,
                with_float32=native is not None,
            )  # fmt: skip
            self.lora_manager = LoRAManager(
                model.lora_slots, arch_config, lora, model_config.dtype, device,
                None if native is None else native.elementwise,
            )  # fmt: skip
        kv_bytes = self._kv_budget_bytes(model, model_config)
        # one exact-tail ring per seat, out of the KV budget; never more seats than the rest
        # holds blocks (a small budget would otherwise go to rings)
        self.num_tail_rows = 0
        if tail_tokens:
            per_seat = self.kv_spec.bytes_per_block + self.kv_spec.tail_bytes(1)
            self.num_tail_rows = min(scheduler_config.max_num_seqs, max(1, kv_bytes // per_seat))
        self.num_blocks = self.kv_spec.num_blocks_for(kv_bytes, self.num_tail_rows)
        if tp_group is not None:  # every rank must hold every block id the scheduler hands out
            self.num_blocks = min(tp_group.exchange("num_blocks", self.num_blocks))
        if self.num_blocks < 1:
            raise ValueError(
                f"the KV cache budget ({kv_bytes} bytes) holds no block of "
                f"{self.kv_spec.bytes_per_block} bytes; raise kv_cache_memory_bytes"
            )
        capacity_tokens = self.num_blocks * cache_config.block_size
        self.max_model_len = resolve_max_model_len(
            model_config.max_model_len, arch.max_position_embeddings, capacity_tokens
        )
        self.model_config = dataclasses.replace(model_config, max_model_len=self.max_model_len)
        self.kv_caches: list[LayerKVCache] = allocate_kv_cache(
            self.kv_spec, self.num_blocks, device, self.num_tail_rows,
            None if static_scales is None else (static_scales.k, static_scales.v),
        )  # fmt: skip
        # CPU: the cache maps lazily; its pages are faulted in ahead of use while no step runs
        self.step_gate = StepGate()
        self.kv_populate = populate_in_background(self.kv_caches, self.step_gate)
        self.host_kv_cache = self._allocate_host_tier(device)
        self.num_host_blocks = 0 if self.host_kv_cache is None else self.host_kv_cache.num_blocks
        if self.is_driver:
            logger.info("%s", self._describe_kv_cache())
        self.model: LlamaForCausalLM = model
        self.runner = ModelRunner(
            model,
            self.kv_caches,
            cache_config.block_size,
            device,
            seed=model_config.seed,
            is_driver=self.is_driver,
            exact_tail=self.kv_spec,
            host_kv_cache=self.host_kv_cache,
            structured_output=structured_output if self.is_driver else None,
            lora_manager=self.lora_manager,
            # CPU logits (float32 from compute_logits): the native argmax and candidates
            sampler=Sampler(
                device, model_config.seed,
                greedy=None if native is None else native.sampling.greedy,
                candidates=None if native is None else native.sampling.nucleus_candidates,
            ),
        )  # fmt: skip
        if self.uses_cuda_graphs:
            self._capture_cuda_graphs()
        if self.memory_plan.is_measured and memory_counters is not None:
            self._check_device_use(memory_counters)

    # -- construction helpers -------------------------------------------------------------
    def _pack_cpu_weights(
        self, model: LlamaForCausalLM, model_config: ModelConfig, sched: SchedulerConfig
    ) -> int:
        """Pack CPU linear weights (float32, or bf16 where oneDNN has it) for oneDNN once (see
        cpu_linear.py); how many."""
        if not packing_applies(model_config.device, model_config.dtype):
            return 0
        batch_hint = min(sched.max_num_seqs, 256)
        reason = probe_packing(batch_hint, model_config.dtype)
        if reason is not None:
            logger.warning("CPU linear layers stay unpacked: %s", reason)
            return 0
        return pack_linear_layers(model, batch_hint, model_config.dtype)

    def _kv_budget_bytes(self, model: LlamaForCausalLM, model_config: ModelConfig) -> int:
        """Return the KV cache budget (see worker/memory.py) and print where it came from.

        On CUDA the activations are measured (the peak of a dummy step at
        max_num_batched_tokens, sampler included) and memory other processes hold is taken
        out; on CPU the activations are estimated and the documented RAM cap applies.
        """
        arch, sched = model.config, self.scheduler_config
        device = model_config.device
        # FP8 weights live in buffers (Fp8Linear), so count those too
        weight_bytes = sum(
            t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())
        )
        act_bytes = estimate_activation_bytes(
            arch.hidden_size,
            arch.intermediate_size,  # this rank's share under TP
            arch.vocab_size,
            sched.max_num_batched_tokens,
            sched.max_num_seqs,
        )
        other_bytes = graph_bytes = 0
        device_bytes = device_memory_bytes(device)
        is_measured = False
        counters = self.memory_counters
        if counters is not None and self.cache_config.kv_cache_memory_bytes is None:
            act_bytes = measure_activation_bytes(model, self.kv_spec, sched, device, counters)
            max_len = min(model_config.max_model_len or arch.max_position_embeddings,
                          arch.max_position_embeddings)  # fmt: skip
            captured_bytes = warm_up_runtime(
                model, self.kv_spec, sched, max_len, device, counters,
                self._graph_capture(model, max_len) if self.uses_cuda_graphs else None,
            )  # fmt: skip
            other_bytes = measure_other_bytes(counters)  # after the warm-up: see there
            device_bytes = counters.mem_get_info()[1]
            is_measured = True
            if self.uses_cuda_graphs:  # what capture took on the device, at least the estimate
                graph_bytes = max(captured_bytes, self._graph_reserve_bytes(model))
        max_len = model_config.max_model_len or arch.max_position_embeddings
        need_blocks = sched.max_num_seqs * cdiv(max_len, self.kv_spec.block_size)
        plan = plan_kv_memory(
            device_bytes,
            self.cache_config.gpu_memory_utilization,
            weight_bytes,
            act_bytes,
            need_blocks * self.kv_spec.bytes_per_block,
            device.type == "cpu",
            self.cache_config.kv_cache_memory_bytes,
            other_bytes=other_bytes,
            graph_bytes=graph_bytes,
            is_measured=is_measured,
        )
        self.memory_plan: MemoryPlan = plan  # where the KV budget came from
        if self.is_driver:
            logger.info("%s", plan.report(device.type == "cpu"))
        return plan.kv_bytes

    def _check_device_use(self, counters: MemoryCounters) -> None:
        """Warn when start-up left the device above --gpu-memory-utilization's share."""
        counters.synchronize()
        free_bytes, total_bytes = counters.mem_get_info()
        used, budget = total_bytes - free_bytes, int(total_bytes * self.memory_plan.utilization)
        if used > budget:
            logger.warning(
                "device memory in use after start-up, %.2f GiB, is above "
                "--gpu-memory-utilization %s x %.2f GiB = %.2f GiB (other processes may have "
                "grown meanwhile); lower --gpu-memory-utilization if steps run out of memory",
                used / GiB, self.memory_plan.utilization, total_bytes / GiB, budget / GiB,
            )  # fmt: skip

    def _allocate_host_tier(self, device: torch.device) -> HostKVCache | None:
        """Allocate the host-memory tier of --kv-offloading-size (None when off)."""
        cfg = self.cache_config
        world_size = 1 if self.tp_group is None else self.tp_group.world_size
        num_blocks = num_host_blocks_for(cfg.kv_offloading_size, self.kv_spec, world_size)
        if self.tp_group is not None:  # every rank must hold every slot the scheduler hands out
            num_blocks = min(self.tp_group.exchange("num_host_blocks", num_blocks))
        if num_blocks == 0 or not cfg.enable_prefix_caching:
            if cfg.kv_offloading_size and self.is_driver:
                reason = "holds no block" if cfg.enable_prefix_caching else "needs prefix caching"
                logger.warning(
                    "--kv-offloading-size %s is off: it %s", cfg.kv_offloading_size, reason
                )
            return None
        return HostKVCache.allocate(self.kv_spec, num_blocks, device)

    def _graph_reserve_bytes(self, model: LlamaForCausalLM) -> int:
        """Return the decode graphs' reserve from this rank's shapes (see memory.py)."""
        from infer8.worker.cuda_graphs import batch_buckets

        arch, max_num_seqs = model.config, self.scheduler_config.max_num_seqs
        num_splits = getattr(self.attn_backend, "num_splits", None)
        return cuda_graph_bytes(
            max_num_seqs,
            arch.hidden_size,
            arch.intermediate_size,
            arch.num_attention_heads,
            arch.head_dim,
            num_splits(arch.num_key_value_heads) if callable(num_splits) else 1,
            sum(batch_buckets(max_num_seqs)),
            model.embed_tokens.weight.element_size(),  # the compute dtype
        )

    def _describe_kv_cache(self) -> str:
        """Return the start-up line: the cache's size and type, the tokens and requests it holds."""
        block_size = self.cache_config.block_size
        tail_bytes = self.kv_spec.tail_bytes(self.num_tail_rows)
        gib = (self.num_blocks * self.kv_spec.bytes_per_block + tail_bytes) / GiB
        capacity_tokens = self.num_blocks * block_size
        per_request_blocks = cdiv(self.max_model_len, block_size)
        return (
            f"KV cache: {gib:.2f} GiB {fp8.kv_dtype_name(self.kv_spec.dtype)}, room for "
            f"{capacity_tokens:,} tokens = {self.num_blocks / per_request_blocks:.2f} requests of "
            f"{self.max_model_len:,} tokens (the longest allowed), in {self.num_blocks:,} blocks "
            f"of {block_size}"
            + describe_exact_tail(self.kv_spec, self.num_tail_rows)
            + (
                f"; host tier (--kv-offloading-size): {self.num_host_blocks:,} blocks, "
                f"{self.num_host_blocks * self.kv_spec.bytes_per_block / GiB:.2f} GiB"
                if self.num_host_blocks
                else ""
            )
        )

    def _graph_capture(
        self, model: LlamaForCausalLM, max_model_len: int
    ) -> Callable[[list[LayerKVCache]], object]:
        """Return a function that captures this worker's decode graphs over given caches."""
        from infer8.worker.cuda_graphs import CUDAGraphDecodeRunner

        def capture(caches: list[LayerKVCache]) -> object:
            runner = CUDAGraphDecodeRunner(
                model, caches, self.attn_backend,  # type: ignore[arg-type]
                self.cache_config.block_size, max_model_len,
                self.scheduler_config.max_num_seqs,
                tail_window=self.kv_spec.exact_tail_tokens,
            )  # fmt: skip
            runner.capture()
            return runner

        return capture

    def _capture_cuda_graphs(self) -> None:
        """Capture decode graphs per batch bucket (vLLM's default; --enforce-eager turns it off).

        Every rank captures the same buckets and replays the same one each step (the step's
        SchedulerOutput decides), so the collectives inside the graphs line up across ranks.
        """
        from infer8.worker.cuda_graphs import CUDAGraphDecodeRunner

        graph_runner = CUDAGraphDecodeRunner(
            self.model,
            self.kv_caches,
            self.attn_backend,  # type: ignore[arg-type]
            self.cache_config.block_size,
            self.max_model_len,
            self.scheduler_config.max_num_seqs,
            tail_window=self.kv_spec.exact_tail_tokens if self.runner.has_tail else 0,
        )
        graph_runner.capture()
        self.runner.graph_runner = graph_runner

    @classmethod
    def from_args(cls, args: EngineArgs, model_path: str, **kwargs: Any) -> Worker:
        """Build a Worker from flat args, resolving them as the engine does (tests, ranks that
        a launcher started)."""
        return cls(args.create_engine_config(model_path, read_model_config(model_path)), **kwargs)

    @property
    def info(self) -> WorkerInfo:
        """Return what this worker sized (the engine's view of the device side)."""
        return WorkerInfo(
            self.kv_spec, self.num_blocks, self.num_tail_rows, self.num_host_blocks,
            self.max_model_len, self.model.config.vocab_size, self.kv_scale_source,
        )  # fmt: skip

    # -- the step API ---------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; only the driver (rank 0) returns samples."""
        with self.step_gate.step():  # the KV populate thread waits meanwhile
            return self.runner.execute(scheduler_output)

    def score_tokens(
        self, token_ids: list[int], block_ids: list[int], seat: TailSeat | None, chunk_tokens: int
    ) -> torch.Tensor:
        """Return each next token's float32 log-probabilities ([n, vocab]) of a sequence
        prefilled in chunks into the given blocks and tail seat (ModelRunner.score)."""
        with self.step_gate.step():
            return self.runner.score(token_ids, block_ids, seat, chunk_tokens)

    def reset(self) -> None:
        """Forget every request's state (after a failed step); weights and KV memory stay."""
        self.runner.reset()  # states, block rows; every seat free, no block keeps its sinks

    @property
    def uses_exact_tail(self) -> bool:
        """Return whether the FP8 cache keeps an exact tail or rotates keys."""
        return self.kv_spec.exact_tail_tokens > 0 or self.kv_spec.hadamard

    def kv_saturation_counts(self) -> list[int]:
        """Return per-layer counts of K/V values clipped at the FP8 max on write."""
        return [int(c.num_saturated) if c.num_saturated is not None else 0 for c in self.kv_caches]


def cuda_graphs_apply(device: torch.device, enforce_eager: bool) -> bool:
    """Return whether decode steps replay CUDA graphs: on CUDA, unless --enforce-eager."""
    return device.type == "cuda" and not enforce_eager


def resolve_max_model_len(
    requested: int | None, max_position_embeddings: int, capacity_tokens: int
) -> int:
    """Resolve max_model_len against the model's positions and the cache's capacity."""
    if requested is None:
        return min(max_position_embeddings, capacity_tokens)
    if requested > max_position_embeddings:
        raise ValueError(
            f"max_model_len {requested} exceeds the model's max_position_embeddings "
            f"{max_position_embeddings}"
        )
    if requested > capacity_tokens:
        raise ValueError(
            f"max_model_len {requested} is larger than the KV cache can hold "
            f"({capacity_tokens} tokens); raise the KV cache memory or lower max_model_len"
        )
    return requested
