"""LLMEngine: add_request / step / abort over the scheduler and the model runner."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from infer8.attention.exact_tail import describe_exact_tail, resolve_exact_tail
from infer8.attention.torch_ref import AttentionBackend, TorchRefAttention
from infer8.config import CacheConfig, EngineArgs, ModelConfig, SchedulerConfig
from infer8.core.kv_cache_manager import KVCacheManager, cdiv
from infer8.core.sched_output import ModelRunnerOutput, SchedulerStats
from infer8.core.scheduler import Scheduler, SchedulerBase
from infer8.core.static_scheduler import StaticScheduler
from infer8.distributed.executor import TensorParallelExecutor
from infer8.distributed.parallel_state import TensorParallelGroup
from infer8.distributed.sharding import TensorParallelShard
from infer8.generation_config import sampling_defaults
from infer8.models.default_model import DEFAULT_MODEL_NAME, DEFAULT_MODEL_SAMPLING
from infer8.models.llama import LlamaArchConfig, LlamaForCausalLM
from infer8.models.loader import load_model
from infer8.outputs import RequestOutput, RequestState, error_output
from infer8.quant import fp8, kv_scales
from infer8.request import Request, RequestStatus
from infer8.sampling_params import SamplingParams
from infer8.structured_output.manager import StructuredOutputManager
from infer8.tokenizer import Tokenizer
from infer8.worker.kv_cache import KVCacheSpec, allocate_kv_cache
from infer8.worker.memory import plan_kv_memory
from infer8.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from infer8.models.gguf_loader import GGUFModel

logger = logging.getLogger(__name__)

GiB = 1 << 30


def _device_memory_bytes(device: torch.device) -> int:
    """Return the device's total memory (RAM on CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resolve_model_path(model: str | None) -> str:
    """Return a local model path; None means the default model (fetched once, then cached)."""
    if model is None:
        from infer8.models.default_model import pull_default_model

        return str(pull_default_model())
    if not Path(model).exists():
        raise ValueError(
            f"model {model!r} is not a local path; infer8 loads a Hugging Face model directory "
            "or a .gguf file (no hub downloads). Run `infer8 pull` for the default model."
        )
    return model


class LLMEngine:
    """Owns the tokenizer, scheduler and model runner of one model; driven by step()."""

    def __init__(self, args: EngineArgs, tp_group: TensorParallelGroup | None = None) -> None:
        """Build the engine; tensor-parallel workers pass their group, rank 0 starts one."""
        model_path = resolve_model_path(args.model)
        model_config, cache_config, scheduler_config = args.create_configs(model_path)
        if args.dtype == "auto" and model_config.dtype == torch.float32:
            print(
                "dtype auto: float32 (this CPU has no bf16 units; bf16 would be emulated, ~70x slower)"
            )
        self.tp_executor: TensorParallelExecutor | None = None
        if tp_group is None and args.tensor_parallel_size > 1:
            # Rank 0 starts (or joins) ranks 1..N-1, which run this constructor on their shard.
            self.tp_executor = TensorParallelExecutor.start(args, model_path, model_config.device)
            tp_group = self.tp_executor.group
        # A GGUF file is read once, for both the weights and the tokenizer.
        gguf = _read_gguf(model_path)
        model, hf_config, ckpt_kv_scales = load_model(
            model_path, model_config.dtype, model_config.device, tp_group, gguf
        )
        self.tp_shard: TensorParallelShard | None = None
        if tp_group is not None:
            arch_config = LlamaArchConfig.from_hf_config(hf_config)
            self.tp_shard = TensorParallelShard(arch_config, tp_group.rank, tp_group.world_size)
        if args.quantization == "fp8":
            from infer8.quant.fp8_linear import quantize_model_weights, supports_scaled_mm

            quantize_model_weights(model, use_scaled_mm=supports_scaled_mm(model_config.device))
        self.tokenizer = _load_tokenizer(model_path, gguf)
        if args.chat_template is not None:
            self.tokenizer.set_chat_template(args.chat_template)
        # The name clients use: --served-model-name, else the --model string as given.
        self.served_model_name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
        self.default_sampling = sampling_defaults(
            model_path,
            args.generation_config,
            args.override_generation_config,
            None if gguf is None else gguf.generation_config,
        )
        if args.model is None and args.generation_config == "auto":
            self.default_sampling = {**DEFAULT_MODEL_SAMPLING, **self.default_sampling}
        SamplingParams(**self.default_sampling)  # refuse bad defaults at start-up
        if self.default_sampling:
            print(
                f"Default sampling parameters from the generation config: {self.default_sampling}"
            )
        self.model_config, self.cache_config, self.scheduler_config = (
            model_config,
            cache_config,
            scheduler_config,
        )
        arch = model.config
        kv_dtype = cache_config.kv_cache_dtype.torch_dtype(model_config.dtype)
        tail_tokens, hadamard = resolve_exact_tail(
            cache_config.kv_cache_exact_tail_tokens,
            cache_config.kv_cache_hadamard,
            is_fp8=kv_dtype in fp8.FP8_DTYPES,
            is_reference_backend=model_config.device.type != "cuda",
            has_static_scales=cache_config.kv_scale == "static",
            head_dim=arch.head_dim,
        )
        self.kv_spec = KVCacheSpec(
            num_layers=arch.num_hidden_layers,
            num_kv_heads=arch.num_key_value_heads,
            head_dim=arch.head_dim,
            block_size=cache_config.block_size,
            dtype=kv_dtype,
            exact_tail_tokens=tail_tokens,
            tail_dtype=model_config.dtype,
            hadamard=hadamard,
        )
        kv_bytes = self._kv_budget_bytes(args, model, model_config, scheduler_config)
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
        self.max_model_len = self._resolve_max_model_len(
            model_config, arch.max_position_embeddings, capacity_tokens
        )
        model_config = dataclasses.replace(model_config, max_model_len=self.max_model_len)
        self.model_config = model_config
        model.rope_tables(self.max_model_len, model_config.device, model_config.dtype)
        kv_caches = allocate_kv_cache(
            self.kv_spec, self.num_blocks, model_config.device, self.num_tail_rows
        )
        self.kv_caches = kv_caches
        self.kv_scale_source = self._setup_kv_scales(ckpt_kv_scales)
        self.attn_backend = self._attention_backend(model_config)
        model.set_attention_backend(self.attn_backend)
        tail_bytes = self.kv_spec.tail_bytes(self.num_tail_rows)
        gib = (self.num_blocks * self.kv_spec.bytes_per_block + tail_bytes) / GiB
        dtype_name = str(kv_dtype).removeprefix("torch.")
        per_request_blocks = cdiv(self.max_model_len, cache_config.block_size)
        print(
            f"KV cache: {self.num_blocks} blocks x {cache_config.block_size} tokens = "
            f"{capacity_tokens} tokens, {gib:.2f} GiB, dtype {dtype_name}; maximum concurrency "
            f"for {self.max_model_len} tokens per request: "
            f"{self.num_blocks / per_request_blocks:.2f}x"
            + describe_exact_tail(self.kv_spec, self.num_tail_rows),
            flush=True,
        )
        self.model: LlamaForCausalLM = model
        self.hf_config = hf_config
        self.kv_cache_manager, self.scheduler = self._build_scheduler()
        self.runner = ModelRunner(
            model,
            kv_caches,
            cache_config.block_size,
            model_config.device,
            self.tokenizer.eos_token_ids,
            seed=model_config.seed,
            is_driver=tp_group is None or tp_group.rank == 0,
            exact_tail_tokens=tail_tokens,
        )
        # Grammars compile on first use (xgrammar loads lazily); rank 0's runner masks logits.
        self.structured_output = StructuredOutputManager(self.tokenizer, model.config.vocab_size)
        self.runner.structured_output = self.structured_output
        if (
            model_config.device.type == "cuda"
            and not model_config.enforce_eager
            and tp_group is None
            and not self.uses_exact_tail
        ):
            # Decode steps replay captured CUDA graphs per batch bucket (vLLM's default);
            # --enforce-eager turns this off. Untested here: no GPU was available.
            from infer8.worker.cuda_graphs import CUDAGraphDecodeRunner

            graph_runner = CUDAGraphDecodeRunner(
                model,
                kv_caches,
                self.attn_backend,
                cache_config.block_size,  # type: ignore[arg-type]
                self.max_model_len,
                scheduler_config.max_num_seqs,
            )
            graph_runner.capture()
            self.runner.graph_runner = graph_runner
        self.req_states: dict[str, RequestState] = {}
        self._req_counter = itertools.count()
        self.stat_loggers: list[Callable[[SchedulerStats], None]] = []
        self.last_stats = SchedulerStats(num_kv_blocks_total=self.num_blocks)

    # -- construction helpers -------------------------------------------------------------
    def _build_scheduler(self) -> tuple[KVCacheManager, SchedulerBase]:
        """Return a fresh KV cache manager (every block free) and scheduler."""
        is_static = self.scheduler_config.scheduler == "static"
        # The static baseline reserves whole sequences up front and never reuses prefixes.
        kv_cache_manager = KVCacheManager(
            self.num_blocks,
            self.cache_config.block_size,
            enable_caching=self.cache_config.enable_prefix_caching and not is_static,
        )
        sched_cls = StaticScheduler if is_static else Scheduler
        max_num_seqs = self.scheduler_config.max_num_seqs
        scheduler = sched_cls(
            kv_cache_manager,
            # an FP8 exact tail holds one ring row (a seat) per running request
            min(max_num_seqs, self.num_tail_rows or max_num_seqs),
            self.scheduler_config.max_num_batched_tokens,
        )
        return kv_cache_manager, scheduler

    @property
    def can_reset(self) -> bool:
        """Return whether reset() can rebuild the engine in-process (not under TP)."""
        return self.tp_executor is None

    def reset(self) -> None:
        """Forget every request and cached block after a failed step; keep weights and KV memory.

        Refused under tensor parallelism: the other ranks' state cannot be trusted after a
        failure there, so the process should exit and be restarted instead.
        """
        if self.tp_executor is not None:
            raise RuntimeError("a tensor-parallel engine cannot be reset in-process")
        self.kv_cache_manager, self.scheduler = self._build_scheduler()
        self.runner.states.clear()
        if self.runner.tail_rows is not None:  # every ring row is free again
            self.runner.tail_rows.release_all()
        for req_id in self.req_states:
            self.structured_output.remove_request(req_id)
        self.req_states.clear()
        self.last_stats = SchedulerStats(num_kv_blocks_total=self.num_blocks)

    def _attention_backend(self, model_config: ModelConfig) -> AttentionBackend:
        """Choose the attention backend once: Triton kernels on CUDA, the torch reference on CPU."""
        if model_config.device.type == "cuda" and not self.uses_exact_tail:
            from infer8.attention.triton_paged import TritonAttention

            return TritonAttention(model_config.device)
        if model_config.device.type == "cuda":  # the kernels read no exact tail yet
            logger.warning("exact tail / rotated keys: using the reference attention on CUDA")
            return TorchRefAttention(use_compile=not model_config.enforce_eager)
        fp8 = self.kv_spec.is_fp8
        # On CPU the native kernels gather (and dequantize FP8) blocks over all threads; without
        # a C compiler, FP8 falls back to compiled torch dequantization.
        return TorchRefAttention(
            use_compile=fp8 and not model_config.enforce_eager, use_native=True
        )

    @property
    def uses_exact_tail(self) -> bool:
        """Return whether the FP8 cache keeps an exact tail or rotates keys."""
        return self.kv_spec.exact_tail_tokens > 0 or self.kv_spec.hadamard

    def _setup_kv_scales(self, ckpt_scales: dict[int, dict[str, torch.Tensor]]) -> str:
        """Install static FP8 scales if asked for; return where scales come from.

        Static mode without scales never falls back to 1.0: it says so loudly and uses
        dynamic per-token scales instead ("dynamic (static scales missing)").
        """
        cfg, spec = self.cache_config, self.kv_spec
        if not spec.is_fp8:
            if cfg.kv_scale == "static":
                logger.warning("--kv-scale static has no effect with a %s KV cache", spec.dtype)
            return "none"
        if cfg.kv_scale == "dynamic":
            return "dynamic"
        if cfg.kv_scales_path is not None:
            shard = self.tp_shard  # the file covers the model's KV heads; keep this rank's
            num_kv_heads = spec.num_kv_heads if shard is None else shard.config.num_key_value_heads
            scales = kv_scales.load_calibration(
                cfg.kv_scales_path, spec.dtype, spec.num_layers, num_kv_heads, spec.head_dim
            )
            if shard is not None:
                scales = shard.shard_static_scales(scales)
        else:
            scales = kv_scales.from_checkpoint(
                ckpt_scales, spec.num_layers, spec.num_kv_heads, spec.head_dim
            )
        if scales is None:
            message = (
                "WARNING: --kv-scale static was requested but the checkpoint has no k_scale/v_scale "
                "tensors and no --kv-scales-path was given; NOT using a scale of 1.0: falling back "
                "to dynamic per-token scales. Run `infer8 calibrate-kv MODEL --out scales.json`."
            )
            logger.warning(message)
            print(message, file=sys.stderr, flush=True)
            return "dynamic (static scales missing)"
        device = self.model_config.device
        for cache, k, v in zip(self.kv_caches, scales.k, scales.v):
            cache.k_static_scale = k.to(device)
            cache.v_static_scale = v.to(device)
        return f"static ({scales.source})"

    def kv_saturation_counts(self) -> list[int]:
        """Return per-layer counts of K/V values clipped at the FP8 max on write."""
        return [int(c.num_saturated) if c.num_saturated is not None else 0 for c in self.kv_caches]

    def _kv_budget_bytes(
        self,
        args: EngineArgs,
        model: LlamaForCausalLM,
        model_config: ModelConfig,
        scheduler_config: SchedulerConfig,
    ) -> int:
        """Return the KV cache budget (see worker/memory.py) and print where it came from."""
        arch = model.config
        # FP8 weights live in buffers (Fp8Linear), so count those too
        weight_bytes = sum(
            t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())
        )
        # Activations of the largest step: hidden states, fused projections and logits.
        tokens = scheduler_config.max_num_batched_tokens
        act_bytes = 4 * tokens * (4 * arch.hidden_size + 2 * arch.intermediate_size) * 2
        act_bytes += scheduler_config.max_num_seqs * arch.vocab_size * 4 * 2
        max_len = model_config.max_model_len or arch.max_position_embeddings
        need_blocks = scheduler_config.max_num_seqs * cdiv(max_len, self.kv_spec.block_size)
        plan = plan_kv_memory(
            _device_memory_bytes(model_config.device),
            self.cache_config.gpu_memory_utilization,
            weight_bytes,
            act_bytes,
            need_blocks * self.kv_spec.bytes_per_block,
            model_config.device.type == "cpu",
            self.cache_config.kv_cache_memory_bytes,
        )
        print(plan.report(model_config.device.type == "cpu"), flush=True)
        return plan.kv_bytes

    def _resolve_max_model_len(
        self, model_config: ModelConfig, max_position_embeddings: int, capacity_tokens: int
    ) -> int:
        """Resolve max_model_len against the model's positions and the cache's capacity."""
        requested = model_config.max_model_len
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

    # -- the request API ------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time_s: float | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Validate and queue a request; return its id. Raises ValueError on bad input.

        Requests with different `cache_salt` values never share prefix-cached KV blocks.
        """
        params = sampling_params or SamplingParams()
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string if provided")
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        self.validate_request(token_ids, params)
        if request_id is None:
            request_id = f"req-{next(self._req_counter)}"
        if request_id in self.req_states:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(
            request_id, token_ids, params, self.tokenizer.eos_token_ids, arrival_time_s, cache_salt
        )
        limit = self.max_model_len
        if params.max_tokens is not None:
            limit = min(limit, len(token_ids) + params.max_tokens)
        request.max_num_tokens = limit
        if (
            self.scheduler_config.scheduler == "static"
            and cdiv(limit, self.cache_config.block_size) > self.num_blocks
        ):
            raise ValueError(
                f"prompt + max_tokens ({limit} tokens) exceeds the whole KV cache "
                f"({self.num_blocks * self.cache_config.block_size} tokens)"
            )
        if params.structured_outputs is not None:
            # A cache hit when the front end compiled it already; ValueError if invalid.
            self.structured_output.add_request(request_id, params.structured_outputs)
        self.req_states[request_id] = RequestState(request, text, self.tokenizer)
        self.scheduler.add_request(request)
        return request_id

    @property
    def vocab_size(self) -> int:
        """Return the model's vocabulary size (valid token ids are below it)."""
        return self.model.config.vocab_size

    def validate_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if a request could never run (checked before it is queued)."""
        vocab = self.vocab_size
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise ValueError(f"stop_token_ids out of range [0, {vocab}): {bad_stop[:5]}")
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but max_model_len is "
                f"{self.max_model_len} (room is needed for at least one generated token)"
            )
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids out of range [0, {vocab}): {bad[:5]}")

    def abort_request(self, request_ids: list[str]) -> None:
        """Stop requests now and free their blocks."""
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)
        for req_id in request_ids:
            self.req_states.pop(req_id, None)
            self.structured_output.remove_request(req_id)

    def is_healthy(self) -> bool:
        """Return False once a tensor-parallel worker has failed or died, even between steps."""
        return self.tp_executor is None or self.tp_executor.is_healthy()

    def has_unfinished_requests(self) -> bool:
        """Return whether any request is waiting or running."""
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> int:
        """Drop every prefix-cached block that no running request holds; return how many."""
        return self.kv_cache_manager.reset_prefix_cache()

    def _process_output(
        self, request: Request, new_ids: list[int], runner_out: ModelRunnerOutput
    ) -> RequestOutput:
        """Detokenize a request's new tokens, check stop strings and build its output."""
        state = self.req_states[request.request_id]
        if self.structured_output.accept_tokens(request.request_id, new_ids):
            # The grammar is complete (or was broken): the request ends with "stop".
            if not request.is_finished:
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
        stop = state.add_tokens(new_ids, runner_out.logprobs.get(request.request_id))
        if stop is not None:
            if not request.is_finished:
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
            request.stop_reason = stop
        output = state.make_output(request)
        if request.is_finished:
            del self.req_states[request.request_id]
            self.structured_output.remove_request(request.request_id)
        return output

    def _fail_requests(self, errors: dict[str, str]) -> list[RequestOutput]:
        """Finish requests that failed alone (blocks freed); return their final outputs."""
        outputs = []
        for req_id, message in errors.items():
            request = self.scheduler.requests.get(req_id)
            if request is not None:
                outputs.append(self._fail_request(request, message))
        return outputs

    def _fail_request(self, request: Request, message: str) -> RequestOutput:
        """Finish one request with an error, whatever state it is in; return its final output."""
        logger.error("request %s failed alone and was finished: %s", request.request_id, message)
        request.error = message
        if request.is_finished:  # it finished this step, before its output could be built
            request.status = RequestStatus.FINISHED_ERROR
        else:
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ERROR)
        self.req_states.pop(request.request_id, None)
        self.structured_output.remove_request(request.request_id)
        return error_output(request)

    def step(self) -> list[RequestOutput]:
        """Run one scheduling iteration; return outputs of requests that got tokens."""
        t0 = time.perf_counter()
        sched_out = self.scheduler.schedule()
        if self.tp_executor is None:
            runner_out = self.runner.execute(sched_out)
        else:
            runner_out = self.tp_executor.execute(self.runner, sched_out)
        outputs = self._fail_requests(runner_out.failed_req_ids)
        progressed = self.scheduler.update_from_output(sched_out, runner_out)
        for request, new_ids in progressed:
            try:
                outputs.append(self._process_output(request, new_ids, runner_out))
            except Exception as e:  # noqa: BLE001 - one request's failure must stay its own
                logger.exception("output processing failed for %s", request.request_id)
                outputs.append(self._fail_request(request, f"output processing failed: {e!r}"))
        stats = self.scheduler.make_stats()
        stats.step_time_s = time.perf_counter() - t0
        self.last_stats = stats
        for log in self.stat_loggers:
            log(stats)
        return outputs


def _read_gguf(model_path: str) -> GGUFModel | None:
    """Read a GGUF checkpoint (weights dequantized to float32); None for a model directory."""
    if Path(model_path).is_dir():
        return None
    from infer8.models.gguf_loader import load_gguf

    return load_gguf(model_path, dtype=torch.float32)


def _load_tokenizer(model_path: str, gguf: GGUFModel | None) -> Tokenizer:
    """Load the tokenizer from a directory, or from an already read GGUF's metadata."""
    if gguf is None:
        return Tokenizer.from_dir(Path(model_path))
    from infer8.models.gguf_loader import tokenizer_from_gguf

    return tokenizer_from_gguf(gguf)


__all__ = ["LLMEngine", "EngineArgs", "CacheConfig"]
