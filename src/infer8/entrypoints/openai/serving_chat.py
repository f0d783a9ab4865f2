"""`/v1/chat/completions`: messages through the chat template (and tools) into engine requests,
engine outputs into a ChatCompletionResponse or its server-sent events (tool calls parsed)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import jinja2

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
    TopLogprob,
)
from infer8.entrypoints.openai.serving import (
    MIN_LOGPROB,
    OpenAIServing,
    Submission,
    collect,
    in_thread,
    sse,
    stream_outputs,
    usage_flags,
    usage_info,
)
from infer8.entrypoints.openai.structured import request_constraint
from infer8.entrypoints.openai.tool_calls import ToolContext, template_messages
from infer8.outputs import Logprobs


class OpenAIServingChat(OpenAIServing):
    """Chat completions: the template applied off the event loop, tool calls, chat logprobs."""

    def chat_prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None,
        tools: ToolContext | None = None,
    ) -> list[int]:
        """Apply the chat template; template errors are the client's (400)."""
        if len(messages) > self.max_model_len:  # each message is at least one token
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens; "
                f"{len(messages)} messages cannot fit it.",
                param="messages",
                code="context_length_exceeded",
            )
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

    async def submit_chat(
        self, request: ChatCompletionRequest, tenant: str | None = None
    ) -> Submission:
        """Validate, apply the chat template (off the event loop) and submit a chat request."""
        self.check_model(request.model)
        return await in_thread(self.pool, self._submit_chat, request, tenant)

    def _submit_chat(
        self, request: ChatCompletionRequest, loop: asyncio.AbstractEventLoop, tenant: str | None
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
            "chatcmpl", [token_ids] * n, params, request.cache_salt, loop, tenant,
            priority=request.priority, model=request.model,
        )  # fmt: skip
        return Submission(request_id, group, len(token_ids), *usage_flags(request), tools=tools)

    async def chat(self, request: ChatCompletionRequest, sub: Submission) -> ChatCompletionResponse:
        """Run a submitted chat completion to the end and return the whole response."""
        finals, logprobs = await collect(sub.group)
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
            usage=usage_info(sub.num_prompt_tokens, sum(len(c.token_ids) for c in finals.values())),
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
                response.usage = usage_info(sub.num_prompt_tokens, sum(num_tokens.values()))
            return sse(response.model_dump_json())

        try:
            for index in range(len(sub.group.request_ids)):
                num_tokens[index] = 0
                yield chunk(
                    ChatStreamChoice(
                        index=index, delta=AssistantMessage(role="assistant", content="")
                    )
                )
            streamers = {}
            async for index, output in stream_outputs(sub.group):
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
                    usage=usage_info(sub.num_prompt_tokens, sum(num_tokens.values())),
                )
                yield sse(final.model_dump_json())
        except APIError as e:
            yield sse(e.to_response().model_dump_json())
        yield sse("[DONE]")

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
            token=token, logprob=max(logprob, MIN_LOGPROB), bytes=list(token.encode("utf-8"))
        )
