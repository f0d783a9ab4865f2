"""Turn OpenAI requests into engine requests and engine outputs into (streamed) responses."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import jinja2

from infer8.entrypoints.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineDrainingError,
    EngineOverloadedError,
    RequestFailedError,
    RequestGroup,
)
from infer8.entrypoints.openai.protocol import (
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    TopLogprob,
    UsageInfo,
)
from infer8.entrypoints.openai.structured import compile_or_400, request_constraint
from infer8.entrypoints.openai.tool_calls import ToolContext, resolve_tools, template_messages
from infer8.outputs import CompletionOutput, Logprobs, RequestOutput
from infer8.sampling_params import RequestOutputKind, SamplingParams

# One API request may fan out into at most this many engine requests (prompts x n).
MAX_ENGINE_REQUESTS_PER_API_REQUEST = 1024
_MIN_LOGPROB = -9999.0  # JSON has no -inf
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
    """Owns request validation and response building for completions and chat completions."""

    def __init__(
        self,
        engine_client: AsyncLLMEngine,
        model_name: str,
        tool_call_parser: str | None = None,
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
        # Tokenization and templating run here, off the event loop, on at most all cores but one:
        # a flood of huge prompts then never takes the core the event loop and engine need.
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, (os.cpu_count() or 2) - 1), thread_name_prefix="infer8-tokenize"
        )

    # -- shared validation ------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        """Refuse a model name this server does not serve (404, as OpenAI answers)."""
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
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

    def _params(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        max_tokens: int,
        logprobs: int | None,
        choice: int,
    ) -> SamplingParams:
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
    ) -> tuple[str, RequestGroup]:
        request_id = f"{kind}-{uuid.uuid4().hex}"
        try:
            group = self.engine_client.add_requests(request_id, prompts, params, cache_salt, loop)
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

    # -- completions ------------------------------------------------------------------------
    async def submit_completion(self, request: CompletionRequest) -> Submission:
        """Validate, tokenize (off the event loop) and submit a completion request."""
        self.check_model(request.model)
        return await _in_thread(self.executor, self._submit_completion, request)

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

    def _encode(self, text: str, param: str) -> list[int]:
        self.check_text_length(len(text), param)
        try:
            return self.tokenizer.encode(text)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None

    def _submit_completion(
        self, request: CompletionRequest, loop: asyncio.AbstractEventLoop
    ) -> Submission:
        prompt = request.prompt
        texts: list[str | None]
        if isinstance(prompt, str):
            texts, token_lists = [prompt], [self._encode(prompt, "prompt")]
        elif prompt and isinstance(prompt[0], str):
            texts = list(prompt)  # type: ignore[arg-type]
            token_lists = [self._encode(p, "prompt") for p in texts]  # type: ignore[arg-type]
        elif prompt and isinstance(prompt[0], list):
            token_lists = [list(p) for p in prompt]  # type: ignore[union-attr]
            texts = [None] * len(token_lists)
        else:
            token_lists, texts = [list(prompt)], [None]  # type: ignore[arg-type]
        n = request.n or 1
        self._check_fan_out(len(token_lists) * n)
        constraint = request_constraint(request, None)
        prompts, params, echo_texts = [], [], []
        for text, token_ids in zip(texts, token_lists):
            self.check_token_ids(token_ids, "prompt")
            max_tokens = self.resolve_max_tokens(len(token_ids), request.max_tokens, "max_tokens")
            for i in range(n):
                prompts.append(token_ids)
                params.append(self._params(request, max_tokens, request.logprobs, i))
                params[-1].structured_outputs = constraint
                if request.echo:
                    echo_texts.append(
                        text if text is not None else self.tokenizer.decode(token_ids)
                    )
        request_id, group = self._submit("cmpl", prompts, params, request.cache_salt, loop)
        return Submission(
            request_id,
            group,
            sum(len(t) for t in token_lists),
            *_usage_flags(request),
            echo_texts=echo_texts,
        )

    async def complete(self, request: CompletionRequest, sub: Submission) -> CompletionResponse:
        """Run a submitted completion to the end and return the whole response."""
        finals, logprobs = await _collect(sub.group)
        choices = []
        for index in sorted(finals):
            completion = finals[index]
            prefix = sub.echo_texts[index] if sub.echo_texts else ""
            choices.append(
                CompletionChoice(
                    index=index,
                    text=prefix + completion.text,
                    logprobs=self._completion_logprobs(
                        completion.token_ids, logprobs[index], len(prefix)
                    )
                    if request.logprobs is not None
                    else None,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
            )
        return CompletionResponse(
            id=sub.request_id,
            model=self.model_name,
            choices=choices,
            usage=_usage(sub.num_prompt_tokens, sum(len(c.token_ids) for c in finals.values())),
        )

    async def stream_completion(
        self, request: CompletionRequest, sub: Submission
    ) -> AsyncIterator[str]:
        """Yield a submitted completion as server-sent events."""
        created = int(time.time())
        num_tokens: dict[int, int] = {}
        text_lens: dict[int, int] = {}
        try:
            async for index, output in _outputs(sub.group):
                completion = output.outputs[0]
                text = completion.delta_text
                if sub.echo_texts and index not in num_tokens:
                    text = sub.echo_texts[index] + text
                num_tokens[index] = num_tokens.get(index, 0) + len(completion.delta_token_ids)
                if not (text or completion.delta_token_ids or output.finished):
                    continue
                offset = text_lens.get(index, 0)
                text_lens[index] = offset + len(text)
                chunk = CompletionResponse(
                    id=sub.request_id,
                    created=created,
                    model=self.model_name,
                    choices=[
                        CompletionChoice(
                            index=index,
                            text=text,
                            logprobs=self._completion_logprobs(
                                completion.delta_token_ids, completion.logprobs or [], offset
                            )
                            if request.logprobs is not None
                            else None,
                            finish_reason=completion.finish_reason,
                            stop_reason=completion.stop_reason,
                        )
                    ],
                )
                if sub.continuous_usage:
                    chunk.usage = _usage(sub.num_prompt_tokens, sum(num_tokens.values()))
                yield _sse(chunk.model_dump_json())
            if sub.stream_usage:
                usage = _usage(sub.num_prompt_tokens, sum(num_tokens.values()))
                final = CompletionResponse(
                    id=sub.request_id,
                    created=created,
                    model=self.model_name,
                    choices=[],
                    usage=usage,
                )
                yield _sse(final.model_dump_json())
        except APIError as e:
            yield _sse(e.to_response().model_dump_json())
        yield _sse("[DONE]")

    def _completion_logprobs(
        self, token_ids: list[int], entries: list[Logprobs], text_offset: int
    ) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for token_id, entry in zip(token_ids, entries):
            token = self.tokenizer.token_to_str(token_id)
            result.tokens.append(token)
            result.token_logprobs.append(max(entry[token_id], _MIN_LOGPROB))
            result.top_logprobs.append(
                {self.tokenizer.token_to_str(t): max(lp, _MIN_LOGPROB) for t, lp in entry.items()}
            )
            result.text_offset.append(text_offset)
            text_offset += len(token)
        return result

    # -- chat completions -------------------------------------------------------------------
    def chat_prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None,
        tools: ToolContext | None = None,
    ) -> list[int]:
        """Apply the chat template; template errors are the client's (400)."""
        self.check_text_length(sum(m.num_chars() for m in messages), "messages")
        try:
            conversation = [m.to_template_dict() for m in messages]
            template = self.tokenizer.chat_template
            conversation = template_messages(conversation, template)
            tool_kwargs: dict[str, Any] = {}
            if tools is not None:
                conversation, tool_kwargs = tools.render(conversation, template)
            return self.tokenizer.encode_chat(
                conversation,
                add_generation_prompt=add_generation_prompt,
                **tool_kwargs,
                **(chat_template_kwargs or {}),
            )
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None

    async def submit_chat(self, request: ChatCompletionRequest) -> Submission:
        """Validate, apply the chat template (off the event loop) and submit a chat request."""
        self.check_model(request.model)
        return await _in_thread(self.executor, self._submit_chat, request)

    def _submit_chat(
        self, request: ChatCompletionRequest, loop: asyncio.AbstractEventLoop
    ) -> Submission:
        tools = self._tool_context(request)
        constraint = request_constraint(request, tools)
        token_ids = self.chat_prompt(
            request.messages,
            request.add_generation_prompt is not False,
            request.chat_template_kwargs,
            tools,
        )
        param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
        max_tokens = self.resolve_max_tokens(len(token_ids), request.requested_max_tokens, param)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        n = request.n or 1
        params = [self._params(request, max_tokens, logprobs, i) for i in range(n)]
        for p in params:
            p.structured_outputs = constraint
        request_id, group = self._submit(
            "chatcmpl", [token_ids] * n, params, request.cache_salt, loop
        )
        return Submission(request_id, group, len(token_ids), *_usage_flags(request), tools=tools)

    async def chat(self, request: ChatCompletionRequest, sub: Submission) -> ChatCompletionResponse:
        """Run a submitted chat completion to the end and return the whole response."""
        finals, logprobs = await _collect(sub.group)
        choices = []
        for index in sorted(finals):
            final = finals[index]
            message = AssistantMessage(role="assistant", content=final.text)
            finish_reason = final.finish_reason
            if sub.tools is not None:
                content, calls = sub.tools.extract(final.text)
                message = AssistantMessage(
                    role="assistant", content=content, tool_calls=calls or None
                )
                if calls and finish_reason == "stop":
                    finish_reason = "tool_calls"
            choices.append(
                ChatChoice(
                    index=index,
                    message=message,
                    logprobs=self._chat_logprobs(
                        final.token_ids, logprobs[index], request.top_logprobs or 0
                    )
                    if request.logprobs
                    else None,
                    finish_reason=finish_reason,
                    stop_reason=final.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=sub.request_id,
            model=self.model_name,
            choices=choices,
            usage=_usage(sub.num_prompt_tokens, sum(len(c.token_ids) for c in finals.values())),
        )

    async def stream_chat(
        self, request: ChatCompletionRequest, sub: Submission
    ) -> AsyncIterator[str]:
        """Yield a submitted chat completion as server-sent events."""
        created = int(time.time())
        num_tokens: dict[int, int] = {}

        def chunk(choice: ChatStreamChoice) -> str:
            response = ChatCompletionStreamResponse(
                id=sub.request_id, created=created, model=self.model_name, choices=[choice]
            )
            if sub.continuous_usage:
                response.usage = _usage(sub.num_prompt_tokens, sum(num_tokens.values()))
            return _sse(response.model_dump_json())

        try:
            for index in range(len(sub.group.request_ids)):
                num_tokens[index] = 0
                yield chunk(
                    ChatStreamChoice(
                        index=index, delta=AssistantMessage(role="assistant", content="")
                    )
                )
            streamers = {}
            async for index, output in _outputs(sub.group):
                completion = output.outputs[0]
                num_tokens[index] += len(completion.delta_token_ids)
                if not (completion.delta_text or completion.delta_token_ids or output.finished):
                    continue
                delta = AssistantMessage(content=completion.delta_text)
                finish_reason = completion.finish_reason
                if sub.tools is not None:
                    streamer = streamers.setdefault(index, sub.tools.streamer())
                    content, calls = streamer.feed(completion.delta_text, output.finished)
                    if not (content or calls or output.finished):
                        continue  # held back: part of a tool call not complete yet
                    delta = AssistantMessage(content=content, tool_calls=calls or None)
                    if finish_reason == "stop" and streamer.num_calls:
                        finish_reason = "tool_calls"
                yield chunk(
                    ChatStreamChoice(
                        index=index,
                        delta=delta,
                        logprobs=self._chat_logprobs(
                            completion.delta_token_ids,
                            completion.logprobs or [],
                            request.top_logprobs or 0,
                        )
                        if request.logprobs
                        else None,
                        finish_reason=finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                )
            if sub.stream_usage:
                final = ChatCompletionStreamResponse(
                    id=sub.request_id,
                    created=created,
                    model=self.model_name,
                    choices=[],
                    usage=_usage(sub.num_prompt_tokens, sum(num_tokens.values())),
                )
                yield _sse(final.model_dump_json())
        except APIError as e:
            yield _sse(e.to_response().model_dump_json())
        yield _sse("[DONE]")

    def _chat_logprobs(
        self, token_ids: list[int], entries: list[Logprobs], num_top: int
    ) -> ChatChoiceLogprobs:
        content = []
        for token_id, entry in zip(token_ids, entries):
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:num_top]
            content.append(
                ChatTokenLogprob(
                    **self._top_logprob(token_id, entry[token_id]).model_dump(),
                    top_logprobs=[self._top_logprob(t, lp) for t, lp in top],
                )
            )
        return ChatChoiceLogprobs(content=content)

    def _top_logprob(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.tokenizer.token_to_str(token_id)
        return TopLogprob(
            token=token, logprob=max(logprob, _MIN_LOGPROB), bytes=list(token.encode("utf-8"))
        )


async def _in_thread(
    executor: concurrent.futures.Executor,
    submit: Callable[[Any, asyncio.AbstractEventLoop], Submission],
    request: Any,
) -> Submission:
    """Run a submit function in a worker thread (tokenizing there keeps the event loop free).

    If the caller is cancelled (the client left) the submission still completes in its thread;
    its requests are then aborted instead of running for nobody.
    """
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(executor, submit, request, loop)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(
            lambda f: f.result().group.abort() if not f.cancelled() and not f.exception() else None
        )
        raise


async def _outputs(group: RequestGroup) -> AsyncIterator[tuple[int, RequestOutput]]:
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


async def _collect(
    group: RequestGroup,
) -> tuple[dict[int, CompletionOutput], dict[int, list[Logprobs]]]:
    """Run a group to the end; return each choice's whole completion and its logprobs."""
    texts: dict[int, list[str]] = {}
    token_ids: dict[int, list[int]] = {}
    logprobs: dict[int, list[Logprobs]] = {}
    finals: dict[int, CompletionOutput] = {}
    async for index, output in _outputs(group):
        completion = output.outputs[0]
        texts.setdefault(index, []).append(completion.delta_text)
        token_ids.setdefault(index, []).extend(completion.delta_token_ids)
        logprobs.setdefault(index, []).extend(completion.logprobs or [])
        if output.finished:
            finals[index] = dataclasses.replace(
                completion, text="".join(texts[index]), token_ids=token_ids[index]
            )
    return finals, logprobs


def _usage_flags(request: CompletionRequest | ChatCompletionRequest) -> tuple[bool, bool]:
    """Return (usage in a final chunk, usage in every chunk) for a streamed response."""
    options = request.stream_options
    if not request.stream or options is None:
        return False, False
    return bool(options.include_usage), bool(options.continuous_usage_stats)


def _usage(num_prompt_tokens: int, num_completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
    )


def _sse(data: str) -> str:
    return f"data: {data}\n\n"
