"""Turn OpenAI requests into engine requests: what completions and chat completions share
(validation, submission, grammars, tool choice) and the helpers that read engine outputs into
responses (serving_completion.py and serving_chat.py build each endpoint's responses)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from infer8.entrypoints.async_engine import AsyncLLMEngine
from infer8.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    UsageInfo,
)
from infer8.entrypoints.openai.request_limits import MAX_ENGINE_REQUESTS_PER_API_REQUEST
from infer8.entrypoints.openai.structured import compile_or_400, request_constraint
from infer8.entrypoints.openai.tool_calls import ToolContext, resolve_tools
from infer8.entrypoints.request_group import (
    EngineDeadError,
    EngineDrainingError,
    EngineOverloadedError,
    RequestFailedError,
    RequestGroup,
)
from infer8.lora.config import LoRARequest
from infer8.outputs import CompletionOutput, Logprobs, RequestOutput
from infer8.sampling_params import RequestOutputKind, SamplingParams

T = TypeVar("T")
MIN_LOGPROB = -9999.0  # JSON has no -inf
_CLOSE = {"Connection": "close"}


@dataclass
class Submission:
    """One API request in flight: its engine requests and what its response needs."""

    request_id: str
    group: RequestGroup
    num_prompt_tokens: int  # over distinct prompts (choices of one prompt share it)
    stream_usage: bool
    continuous_usage: bool
    echo_texts: list[str] = field(default_factory=list)  # per choice; completions with echo
    tools: ToolContext | None = None  # chat requests that use tools


class OpenAIServing:
    """What the completion and chat servings share: validation, submission, grammars, tools."""

    def __init__(
        self,
        engine_client: AsyncLLMEngine,
        model_name: str,
        tool_call_parser: str | None = None,
        pool: WorkPool | None = None,
    ) -> None:
        self.engine_client = engine_client
        engine = engine_client.engine
        self.model_name = model_name
        # Set with --enable-auto-tool-choice: how "auto" tool choice reads the model's calls.
        self.tool_call_parser = tool_call_parser
        self.structured_output = engine.structured_output
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.default_sampling = engine.default_sampling  # the model's generation config
        self.scheduling_policy = engine.scheduler_config.policy
        # Tokenization and templating run here, off the event loop, on at most all cores but one:
        # a flood of huge prompts then never takes the core the event loop and engine need.
        # The completion and chat servings share one pool (`pool`, the other's).
        self.pool = pool or WorkPool()
        # A rendered chat prompt this long cannot fit the context whatever its tokens (the
        # bound check_text_length applies): the template stops there instead of handing the
        # tokenizer text that takes seconds and gigabytes to refuse.
        fits_chars = 2 * self.tokenizer.max_token_chars * self.max_model_len
        budget = self.tokenizer.template_budget
        if budget.max_chars > fits_chars:
            self.tokenizer.template_budget = dataclasses.replace(budget, max_chars=fits_chars)

    # -- shared validation ------------------------------------------------------------------
    def check_model(self, model: str | None) -> LoRARequest | None:
        """Return the LoRA adapter a request's `model` names (None: the base model); refuse a
        name this server does not serve (404, as OpenAI answers)."""
        if model is None or model == self.model_name:
            return None
        lora = self.engine_client.engine.lora_by_name(model)
        if lora is not None:
            return lora
        raise APIError(
            404,
            f"The model `{model}` does not exist. This server serves `{self.model_name}`"
            + "".join(f", `{lora.lora_name}`" for lora in self.engine_client.engine.list_loras())
            + ".",
            param="model",
            code="model_not_found",
        )

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        """Refuse token ids outside the model's vocabulary."""
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(
                400,
                f"{param} has token ids out of range [0, {self.vocab_size}): {bad[:5]}",
                param=param,
            )

    def resolve_max_tokens(self, num_prompt_tokens: int, requested: int | None, param: str) -> int:
        """Return max_tokens for a prompt; refuse what does not fit max_model_len (no truncation)."""
        if num_prompt_tokens == 0:
            raise APIError(400, "the prompt is empty", param="prompt")
        if requested is not None and requested < 1:
            raise APIError(400, f"{param} must be at least 1, got {requested}", param=param)
        room = self.max_model_len - num_prompt_tokens
        if room < 1 or (requested is not None and requested > room):
            asked = num_prompt_tokens + (requested if requested is not None else 1)
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {asked} tokens ({num_prompt_tokens} in the prompt, "
                f"{asked - num_prompt_tokens} in the completion). Please reduce the length of "
                "the prompt or completion.",
                param=param,
                code="context_length_exceeded",
            )
        return room if requested is None else requested

    def check_priority(self, priority: int) -> None:
        """Refuse a non-zero priority unless --scheduling-policy priority (400, as vLLM does)."""
        if priority != 0 and self.scheduling_policy != "priority":
            raise APIError(
                400,
                f"priority {priority} needs --scheduling-policy priority; this server schedules "
                "first come, first served (fcfs), where only priority 0 is accepted",
                param="priority",
            )

    def _params(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        max_tokens: int,
        logprobs: int | None,
        choice: int,
    ) -> SamplingParams:
        self.check_priority(request.priority)
        try:
            params = request.sampling_params(
                max_tokens, logprobs, seed_offset=choice, defaults=self.default_sampling
            )
        except ValueError as e:
            raise APIError(400, str(e)) from None
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        # Outputs as deltas: each step costs O(new tokens), whatever the answer's length.
        return dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)

    def _check_fan_out(self, num_sequences: int) -> None:
        if num_sequences > MAX_ENGINE_REQUESTS_PER_API_REQUEST:
            raise APIError(
                400,
                f"this request fans out into {num_sequences} sequences (prompts x n); "
                f"the limit is {MAX_ENGINE_REQUESTS_PER_API_REQUEST}",
                param="n",
            )

    def _submit(
        self,
        kind: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        cache_salt: str | None,
        loop: asyncio.AbstractEventLoop,
        tenant: str | None = None,
        priority: int = 0,
        model: str | None = None,
    ) -> tuple[str, RequestGroup]:
        request_id = f"{kind}-{uuid.uuid4().hex}"
        cache_salt = tenant_salt(tenant, cache_salt)
        self.check_priority(priority)
        lora_request = self.check_model(model)
        try:
            group = self.engine_client.add_requests(
                request_id, prompts, params, cache_salt, loop, priority=priority,
                lora_request=lora_request,
            )  # fmt: skip
        except EngineOverloadedError as e:
            if self.engine_client.metrics is not None:
                self.engine_client.metrics.on_rejected()
            raise APIError(
                503,
                str(e),
                "server_overloaded",
                code="server_overloaded",
                headers={"Retry-After": "1"},
            ) from None
        except EngineDrainingError as e:
            raise APIError(
                503, str(e), "server_error", code="server_shutting_down", headers=_CLOSE
            ) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), "server_error", code="engine_unavailable") from None
        return request_id, group

    # -- structured outputs and tools -------------------------------------------------------
    def _tool_context(
        self, request: CompletionRequest | ChatCompletionRequest
    ) -> ToolContext | None:
        if not isinstance(request, ChatCompletionRequest):
            return None
        return resolve_tools(
            request.tools, request.tool_choice, request.parallel_tool_calls, self.tool_call_parser
        )

    async def precompile(self, request: CompletionRequest | ChatCompletionRequest) -> None:
        """Compile a request's grammar off the event loop and the engine thread; 400 if invalid."""
        constraint = request_constraint(request, self._tool_context(request))
        if constraint is not None:
            await compile_or_400(self.structured_output, constraint, request)

    def check_text_length(self, num_chars: int, param: str) -> None:
        """Refuse text that cannot fit the context whatever its tokens, before tokenizing it."""
        min_tokens = self.tokenizer.min_num_tokens(num_chars)
        if min_tokens >= self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"the {param} has {num_chars} characters, at least {min_tokens} tokens. Please "
                "reduce the length of the prompt.",
                param=param,
                code="context_length_exceeded",
            )

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize text that can fit the context (checked first); 400 if it cannot."""
        self.check_text_length(len(text), param)
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None


class WorkPool:
    """The threads that tokenize, template and detokenize requests, with a bounded queue.

    Sized to the machine (all cores but one); past `max_pending` queued or running calls the
    next request is answered 503 at once instead of waiting behind the others. A pool whose
    every thread has run one call for over `wedged_after_s` is wedged (`wedged_reason`):
    nothing queued behind them moves, which /health should report.
    """

    def __init__(
        self, max_workers: int | None = None, max_pending: int = 1024, wedged_after_s: float = 30.0
    ) -> None:
        self.num_workers = max_workers or max(1, (os.cpu_count() or 2) - 1)
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.num_workers, thread_name_prefix="infer8-tokenize"
        )
        self.max_pending = max_pending
        self.num_pending = 0  # only read and written on the event loop
        self.wedged_after_s = wedged_after_s
        self._lock = threading.Lock()
        self._call_to_start_s: dict[int, float] = {}  # calls running now: when each began
        self._call_ids = itertools.count()

    def submit(
        self, loop: asyncio.AbstractEventLoop, fn: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        """Queue fn(*args); APIError 503 when the queue is full."""
        if self.num_pending >= self.max_pending:
            raise APIError(
                503,
                f"the server is busy ({self.num_pending} requests being tokenized); retry later",
                "server_overloaded",
                code="server_overloaded",
                headers={"Retry-After": "1"},
            )
        self.num_pending += 1
        future = loop.run_in_executor(self.executor, self._timed, fn, *args)
        future.add_done_callback(self._done)
        return future

    def _timed(self, fn: Callable[..., T], *args: Any) -> T:
        call_id = next(self._call_ids)
        with self._lock:
            self._call_to_start_s[call_id] = time.monotonic()
        try:
            return fn(*args)
        finally:
            with self._lock:
                del self._call_to_start_s[call_id]

    def _done(self, future: asyncio.Future[Any]) -> None:
        self.num_pending -= 1

    def wedged_reason(self) -> str | None:
        """Return why the pool is wedged (every thread stuck in one call), or None."""
        now = time.monotonic()
        with self._lock:
            stuck_s = sorted((now - t for t in self._call_to_start_s.values()), reverse=True)
        if len(stuck_s) < self.num_workers or stuck_s[self.num_workers - 1] < self.wedged_after_s:
            return None
        return (
            f"the tokenizer pool is wedged: all {self.num_workers} threads have run one call "
            f"for over {self.wedged_after_s:g} s (the longest {stuck_s[0]:.0f} s)"
        )

    def is_wedged(self) -> bool:
        """Return whether every thread of the pool is stuck in one call."""
        return self.wedged_reason() is not None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) in the pool and return its result."""
        return await self.submit(asyncio.get_running_loop(), fn, *args)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False)


def tenant_salt(tenant: str | None, cache_salt: str | None) -> str | None:
    """Return the prefix-cache salt of a request: its tenant's, then its own cache_salt."""
    if tenant is None:
        return cache_salt
    return tenant if cache_salt is None else f"{tenant}:{cache_salt}"


async def in_thread(
    pool: WorkPool,
    submit: Callable[..., Submission],
    request: Any,
    tenant: str | None = None,
) -> Submission:
    """Run a submit function in a worker thread (tokenizing there keeps the event loop free).

    If the caller is cancelled (the client left) the submission still completes in its thread;
    its requests are then aborted instead of running for nobody.
    """
    loop = asyncio.get_running_loop()
    future = pool.submit(loop, submit, request, loop, tenant)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(
            lambda f: f.result().group.abort() if not f.cancelled() and not f.exception() else None
        )
        raise


async def stream_outputs(group: RequestGroup) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield a group's outputs, turning engine-side failures into API errors."""
    try:
        async for item in group.stream():
            yield item
    except ValueError as e:  # the engine refused the request after the server's checks
        raise APIError(400, str(e)) from None
    except EngineDeadError as e:
        raise APIError(503, str(e), "server_error", code="engine_unavailable") from None
    except RequestFailedError as e:
        raise APIError(500, str(e), "server_error", code="generation_failed") from None


async def collect(
    group: RequestGroup,
) -> tuple[dict[int, CompletionOutput], dict[int, list[Logprobs]]]:
    """Run a group to the end; return each choice's whole completion and its logprobs."""
    texts: dict[int, list[str]] = {}
    token_ids: dict[int, list[int]] = {}
    logprobs: dict[int, list[Logprobs]] = {}
    finals: dict[int, CompletionOutput] = {}
    async for index, output in stream_outputs(group):
        completion = output.outputs[0]
        texts.setdefault(index, []).append(completion.delta_text)
        token_ids.setdefault(index, []).extend(completion.delta_token_ids)
        logprobs.setdefault(index, []).extend(completion.logprobs or [])
        if output.finished and completion.finish_reason == "abort":
            # Not a complete answer: a status says so (the stream's final event does, streamed).
            raise APIError(
                503,
                "the request was aborted before it finished (the server is shutting down); "
                "retry on another replica",
                "server_error",
                code="request_aborted",
                headers=_CLOSE,
            )
        if output.finished:
            finals[index] = dataclasses.replace(
                completion, text="".join(texts[index]), token_ids=token_ids[index]
            )
    return finals, logprobs


def usage_flags(request: CompletionRequest | ChatCompletionRequest) -> tuple[bool, bool]:
    """Return (usage in a final chunk, usage in every chunk) for a streamed response."""
    options = request.stream_options
    if not request.stream or options is None:
        return False, False
    return bool(options.include_usage), bool(options.continuous_usage_stats)


def usage_info(num_prompt_tokens: int, num_completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
    )


def sse(data: str) -> str:
    return f"data: {data}\n\n"
