"""LLMEngine: add_request / step / abort over the tokenizer, the scheduler and an executor."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from infer8.attention.tail_defaults import tail_segment
from infer8.config import EngineArgs
from infer8.core.kv_cache_manager import KVCacheManager, cdiv
from infer8.core.kv_events import AllBlocksCleared
from infer8.core.sched_output import ModelRunnerOutput, SchedulerStats
from infer8.core.scheduler import Scheduler, SchedulerBase
from infer8.core.static_scheduler import StaticScheduler
from infer8.executor import Executor, create_executor
from infer8.generation_config import sampling_defaults
from infer8.kv_events import create_event_publisher
from infer8.lora.config import LoRARequest
from infer8.lora.peft import read_adapter
from infer8.models.default_model import DEFAULT_MODEL_NAME
from infer8.models.llama import LlamaArchConfig
from infer8.models.loader import read_hf_config, resolve_model_path
from infer8.outputs import RequestOutput, RequestState, error_output
from infer8.request import Request, RequestStatus
from infer8.sampling_params import SamplingParams
from infer8.spec_decode.speculator import Speculator
from infer8.structured_output.manager import StructuredOutputManager
from infer8.tokenizer import Tokenizer
from infer8.worker.fit_check import check_fits_memory

if TYPE_CHECKING:
    from infer8.models.gguf_loader import GGUFModel
    from infer8.worker.worker import Worker

logger = logging.getLogger(__name__)


class LLMEngine:
    """Owns the tokenizer, the scheduler and output processing of one model; driven by step().

    The device side (weights, KV cache, attention, graphs) is the executor's Workers: one in
    this process, or one per tensor-parallel rank.
    """

    def __init__(self, args: EngineArgs) -> None:
        """Build the engine: the executor's workers first, then the scheduler over their cache."""
        model_path = resolve_model_path(args.model)
        # A GGUF file is read once, for the weights, the tokenizer and its config.
        gguf = _read_gguf(model_path)
        # a clear error for a directory without config.json
        hf_config = read_hf_config(Path(model_path)) if gguf is None else gguf.hf_config
        self.config = args.create_engine_config(model_path, hf_config)  # every auto, once
        # the weights, the CPU's KV budget and the host tier against memory, before any is
        # allocated (the planner's arithmetic over config.json)
        check_fits_memory(self.config, hf_config)
        model_config = self.config.model_config
        cache_config, scheduler_config = self.config.cache_config, self.config.scheduler_config
        if args.dtype == "auto" and model_config.dtype == torch.float32:
            logger.info(
                "dtype auto: float32 (this CPU has no bf16 units; bf16 would be emulated, "
                "~70x slower)"
            )
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
        SamplingParams(**self.default_sampling)  # refuse bad defaults at start-up
        if self.default_sampling:
            defaults = ", ".join(f"{k} {v}" for k, v in self.default_sampling.items())
            logger.info(
                "Sampling defaults (the generation config's) for requests that set none: %s",
                defaults,
            )
        self.vocab_size = int(hf_config["vocab_size"])  # valid token ids are below it
        # Grammars compile on first use (xgrammar loads lazily); rank 0's runner masks logits.
        self.structured_output = StructuredOutputManager(self.tokenizer, self.vocab_size)
        self.executor: Executor = create_executor(self.config, gguf, self.structured_output)
        info = self.executor.driver_worker.info  # what the device side sized: plain data
        self.model_config = dataclasses.replace(model_config, max_model_len=info.max_model_len)
        self.cache_config, self.scheduler_config = cache_config, scheduler_config
        self.kv_spec = info.kv_spec
        self.num_blocks = info.num_blocks
        self.num_tail_rows = info.num_tail_rows
        self.num_host_blocks = info.num_host_blocks
        self.max_model_len = info.max_model_len
        self._kv_scale_source = info.kv_scale_source
        self.kv_events_config = self.config.kv_events_config
        self.kv_event_publisher = create_event_publisher(self.kv_events_config)
        if self.kv_events_config.is_enabled and (
            not cache_config.enable_prefix_caching or scheduler_config.scheduler == "static"
        ):
            logger.warning("KV cache events are on but prefix caching is off: none will be sent")
        # --enable-lora: the adapters requests may name (lora_int_id -> request)
        self.lora_config = self.config.lora_config
        self.loras: dict[int, LoRARequest] = {}
        self._max_lora_id = 0  # ids are never reused: no cached block outlives its adapter
        self._lora_arch = LlamaArchConfig.from_hf_config(hf_config) if self.lora_config else None
        self.kv_cache_manager, self.scheduler = self._build_scheduler()
        self.req_states: dict[str, RequestState] = {}
        self._req_counter = itertools.count()
        self.stat_loggers: list[Callable[[SchedulerStats], None]] = []
        self.last_stats = SchedulerStats(num_kv_blocks_total=self.num_blocks)

    @property
    def worker(self) -> Worker:
        """Return rank 0's Worker (this process's device side: model, KV cache, backend)."""
        worker = self.executor.driver_worker
        assert worker is not None
        return worker

    @property
    def kv_scale_source(self) -> str:
        """Return where FP8 scales come from: none, dynamic, static (...)."""
        return self._kv_scale_source

    def kv_saturation_counts(self) -> list[int]:
        """Return per-layer counts of K/V values clipped at the FP8 max on write."""
        return self.worker.kv_saturation_counts()

    # -- construction helpers -------------------------------------------------------------
    def _build_scheduler(self) -> tuple[KVCacheManager, SchedulerBase]:
        """Return a fresh KV cache manager (every block free) and scheduler."""
        is_static = self.scheduler_config.scheduler == "static"
        # The static baseline reserves whole sequences up front and never reuses prefixes.
        kv_cache_manager = KVCacheManager(
            self.num_blocks,
            self.cache_config.block_size,
            enable_caching=self.cache_config.enable_prefix_caching and not is_static,
            enable_kv_cache_events=self.kv_events_config.is_enabled,
            num_host_blocks=self.num_host_blocks,
            exact_tail=self._exact_tail_seats(),
        )
        max_num_seqs = self.scheduler_config.max_num_seqs
        max_num_batched_tokens = self.scheduler_config.max_num_batched_tokens
        scheduler: SchedulerBase
        if is_static:
            scheduler = StaticScheduler(kv_cache_manager, max_num_seqs, max_num_batched_tokens)
        else:
            scheduler = Scheduler(
                kv_cache_manager,
                max_num_seqs,
                max_num_batched_tokens,
                policy=self.scheduler_config.policy,
                speculator=self._speculator(),
                max_loras=None if self.lora_config is None else self.lora_config.max_loras,
            )
        return kv_cache_manager, scheduler

    def _speculator(self) -> Speculator | None:
        """Return the draft proposer for --speculative-config (None without)."""
        config = self.config.speculative_config
        if config is None:
            return None
        max_drafts = config.num_speculative_tokens
        if self.num_tail_rows:
            # a step's drafts and its own token must fit in the tail's ring (W - 1 positions),
            # or a rejected draft would overwrite an accepted token's slot
            max_drafts = self.kv_spec.exact_tail_tokens - 2
            if config.method == "suffix" and config.num_speculative_tokens > max_drafts:
                logger.info(
                    "Suffix decoding drafts at most %d tokens a step with this FP8 cache's exact "
                    "tail of %d tokens", max_drafts, self.kv_spec.exact_tail_tokens,
                )  # fmt: skip
            elif config.num_speculative_tokens > max_drafts:
                raise ValueError(
                    f"--speculative-config: num_speculative_tokens "
                    f"({config.num_speculative_tokens}) must be at most {max_drafts} with this "
                    f"FP8 cache's exact tail of {self.kv_spec.exact_tail_tokens} tokens (raise "
                    "--kv-cache-exact-tail-tokens or speculate fewer tokens)"
                )
        return Speculator(config, max_drafts)

    def _exact_tail_seats(self) -> tuple[int, int, int] | None:
        """Return an FP8 cache's exact-tail seats for the KV cache manager: (rows, segment,
        sinks), or None without a tail."""
        if not self.num_tail_rows:
            return None
        spec = self.kv_spec
        return self.num_tail_rows, tail_segment(spec.exact_tail_tokens), spec.exact_sink_tokens

    @property
    def can_reset(self) -> bool:
        """Return whether reset() can rebuild the engine in-process (not under TP)."""
        return self.executor.can_reset

    def reset(self) -> None:
        """Forget every request and cached block after a failed step; keep weights and KV memory.

        Refused under tensor parallelism: the other ranks' state cannot be trusted after a
        failure there, so the process should exit and be restarted instead.
        """
        if not self.executor.can_reset:
            raise RuntimeError("a tensor-parallel engine cannot be reset in-process")
        self.kv_cache_manager, self.scheduler = self._build_scheduler()
        if self.kv_events_config.is_enabled:
            # The old pool's unsent events are moot: every cached block is gone.
            self.kv_event_publisher.publish([AllBlocksCleared()], time.time())
        self.worker.reset()
        for req_id in self.req_states:
            self.structured_output.remove_request(req_id)
        self.req_states.clear()
        self.last_stats = SchedulerStats(num_kv_blocks_total=self.num_blocks)

    # -- LoRA adapters ----------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Check an adapter against the model and let requests use it; ValueError if it does
        not fit (a one-line reason naming the file or field). Its weights load on first use."""
        if self.lora_config is None:
            raise ValueError("LoRA adapters need --enable-lora")
        known = self.loras.get(lora_request.lora_int_id)
        if known is not None:
            if known != lora_request:
                raise ValueError(
                    f"lora_int_id {lora_request.lora_int_id} is already {known.lora_name!r} "
                    f"({known.lora_path})"
                )
            return
        name = lora_request.lora_name
        if name == self.served_model_name or self.lora_by_name(name) is not None:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        assert self._lora_arch is not None
        read_adapter(lora_request.lora_path, self._lora_arch, self.lora_config.max_lora_rank)
        self.loras[lora_request.lora_int_id] = lora_request
        self._max_lora_id = max(self._max_lora_id, lora_request.lora_int_id)

    def new_lora_id(self) -> int:
        """Return an adapter id no adapter holds (the server numbers the ones it loads)."""
        return self._max_lora_id + 1

    def remove_lora(self, lora_int_id: int) -> bool:
        """Stop accepting requests for an adapter (running ones finish with it); return
        whether it was known."""
        return self.loras.pop(lora_int_id, None) is not None

    def lora_by_name(self, name: str) -> LoRARequest | None:
        """Return the adapter requests name `name` (None: no such adapter)."""
        return next((lora for lora in self.loras.values() if lora.lora_name == name), None)

    def list_loras(self) -> list[LoRARequest]:
        """Return the adapters requests may use."""
        return list(self.loras.values())

    # -- the request API ------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time_s: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Validate and queue a request; return its id. Raises ValueError on bad input.

        Requests with different `cache_salt` values (or LoRA adapters) never share
        prefix-cached KV blocks. `lora_request`: the adapter it runs with, registered here on
        first sight (add_lora).
        `priority` orders requests under --scheduling-policy priority (lower values first);
        under fcfs only 0 is accepted, as in vLLM.
        """
        params = sampling_params or SamplingParams()
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string if provided")
        self.check_priority(priority)
        if lora_request is not None:
            self.add_lora(lora_request)
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
            request_id,
            token_ids,
            params,
            self.tokenizer.eos_token_ids,
            arrival_time_s,
            cache_salt,
            priority,
            lora_request,
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

    def check_priority(self, priority: int) -> None:
        """Raise ValueError for a priority the scheduling policy cannot honour."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.scheduler_config.policy != "priority":
            raise ValueError(
                f"priority {priority} needs --scheduling-policy priority; this server schedules "
                "first come, first served (fcfs), where only priority 0 is accepted"
            )

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
        return self.executor.is_healthy()

    def has_unfinished_requests(self) -> bool:
        """Return whether any request is waiting or running."""
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> int:
        """Drop every prefix-cached block that no running request holds; return how many."""
        num_dropped = self.kv_cache_manager.reset_prefix_cache()
        self._publish_kv_events()  # now: no step may follow soon
        return num_dropped

    def score_tokens(self, token_ids: list[int], chunk_tokens: int = 512) -> torch.Tensor:
        """Return float32 log-probabilities [len(token_ids), vocab] of each next token.

        Teacher-forced scoring for accuracy harnesses: the sequence takes blocks and a tail seat
        from the KV cache manager like a request and is prefilled in chunks of `chunk_tokens`
        through the paged cache, so the numbers include the cache's quantization. Its own
        cache salt keeps whatever it leaves in the prefix cache from being reused.
        """
        if self.has_unfinished_requests():
            raise RuntimeError("scoring needs an idle engine: requests are still running")
        if self.worker.tp_group is not None:  # the model runs here alone: workers would not join
            raise ValueError("scoring runs on one device; use --tensor-parallel-size 1")
        n = len(token_ids)
        if n > self.max_model_len:
            raise ValueError(f"{n} tokens exceed max_model_len {self.max_model_len}")
        kv, req_id = self.kv_cache_manager, "__score__"
        request = Request(req_id, token_ids, SamplingParams(max_tokens=1), [], cache_salt=req_id)
        if not kv.can_seat() or kv.allocate_slots(request, n) is None:
            raise ValueError(f"the KV cache cannot hold {n} tokens")
        try:
            kv.seat(request)
            return self.worker.score_tokens(
                token_ids, kv.get_block_ids(req_id), kv.get_seat(req_id), chunk_tokens
            )
        finally:
            kv.free(req_id)

    def _publish_kv_events(self) -> None:
        """Hand the prefix cache's events since the last call to the publisher, as one batch."""
        events = self.kv_cache_manager.take_events()
        if events:
            self.kv_event_publisher.publish(events, time.time())

    def shutdown(self) -> None:
        """Stop the KV events publisher (its queued batches are sent first)."""
        self.kv_event_publisher.shutdown()

    def _process_output(
        self, request: Request, new_ids: list[int], runner_out: ModelRunnerOutput
    ) -> RequestOutput:
        """Detokenize a request's new tokens, check stop strings and build its output."""
        state = self.req_states[request.request_id]
        if self.structured_output.accept_tokens(request.request_id, new_ids):
            # The grammar is complete (or was broken): the request ends with "stop".
            if not request.is_finished:
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
        if len(new_ids) > 1 and state.stop:
            # accepted drafts: a stop string ends the output at the token that completes it,
            # as it would have one token a step
            for n, token_id in enumerate(new_ids, 1):
                stop = state.add_tokens([token_id], None)
                if stop is not None:
                    del request.output_token_ids[len(request.output_token_ids) - len(new_ids) + n :]
                    break
        else:
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
        runner_out = self.executor.execute_model(sched_out)
        outputs = self._fail_requests(runner_out.failed_req_ids)
        self._publish_kv_events()
        progressed = self.scheduler.update_from_output(sched_out, runner_out)
        for request, new_ids in progressed:
            try:
                outputs.append(self._process_output(request, new_ids, runner_out))
            except Exception as e:  # noqa: BLE001 - one request's failure must stay its own
                logger.exception("output processing failed for %s", request.request_id)
                outputs.append(self._fail_request(request, f"output processing failed: {e!r}"))
        stats = self.scheduler.make_stats()
        stats.step_time_s = time.perf_counter() - t0
        if self.scheduler.speculator is not None:  # what a step costs, for who drafts how much
            self.scheduler.speculator.observe_step(sched_out, stats.step_time_s)
        self.last_stats = stats
        for log in self.stat_loggers:
            log(stats)
        return outputs


def _read_gguf(model_path: str) -> GGUFModel | None:
    """Read a GGUF checkpoint (weights stay in the file until loaded); None for a directory."""
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


__all__ = ["LLMEngine", "EngineArgs", "resolve_model_path"]
