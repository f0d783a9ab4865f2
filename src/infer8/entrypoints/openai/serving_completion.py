"""`/v1/completions`: prompts (text or token ids, one or several) into engine requests, engine
outputs into a CompletionResponse or its server-sent events."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from infer8.entrypoints.openai.protocol import (
    APIError,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
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
from infer8.outputs import Logprobs


class OpenAIServingCompletion(OpenAIServing):
    """Completions: tokenized off the event loop, echo and logprobs as OpenAI returns them."""

    async def submit_completion(
        self, request: CompletionRequest, tenant: str | None = None
    ) -> Submission:
        """Validate, tokenize (off the event loop) and submit a completion request.

        `tenant` (the API key's salt) keeps tenants' prefix-cache blocks apart.
        """
        self.check_model(request.model)
        return await in_thread(self.pool, self._submit_completion, request, tenant)

    def _submit_completion(
        self, request: CompletionRequest, loop: asyncio.AbstractEventLoop, tenant: str | None
    ) -> Submission:
        prompt = request.prompt
        texts: list[str | None]
        if isinstance(prompt, str):
            texts, token_lists = [prompt], [self.encode(prompt, "prompt")]
        elif prompt and isinstance(prompt[0], str):
            texts = list(prompt)  # type: ignore[arg-type]
            token_lists = [self.encode(p, "prompt") for p in texts]  # type: ignore[arg-type]
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
        request_id, group = self._submit(
            "cmpl", prompts, params, request.cache_salt, loop, tenant, priority=request.priority,
            model=request.model,
        )  # fmt: skip
        return Submission(
            request_id,
            group,
            sum(len(t) for t in token_lists),
            *usage_flags(request),
            echo_texts=echo_texts,
        )

    async def complete(self, request: CompletionRequest, sub: Submission) -> CompletionResponse:
        """Run a submitted completion to the end and return the whole response."""
        finals, logprobs = await collect(sub.group)
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
            usage=usage_info(sub.num_prompt_tokens, sum(len(c.token_ids) for c in finals.values())),
        )

    async def stream_completion(
        self, request: CompletionRequest, sub: Submission
    ) -> AsyncIterator[str]:
        """Yield a submitted completion as server-sent events."""
        created = int(time.time())
        num_tokens: dict[int, int] = {}
        text_lens: dict[int, int] = {}
        try:
            async for index, output in stream_outputs(sub.group):
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
                    chunk.usage = usage_info(sub.num_prompt_tokens, sum(num_tokens.values()))
                yield sse(chunk.model_dump_json())
            if sub.stream_usage:
                usage = usage_info(sub.num_prompt_tokens, sum(num_tokens.values()))
                final = CompletionResponse(
                    id=sub.request_id,
                    created=created,
                    model=self.model_name,
                    choices=[],
                    usage=usage,
                )
                yield sse(final.model_dump_json())
        except APIError as e:
            yield sse(e.to_response().model_dump_json())
        yield sse("[DONE]")

    def _completion_logprobs(
        self, token_ids: list[int], entries: list[Logprobs], text_offset: int
    ) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for token_id, entry in zip(token_ids, entries):
            token = self.tokenizer.token_to_str(token_id)
            result.tokens.append(token)
            result.token_logprobs.append(max(entry[token_id], MIN_LOGPROB))
            result.top_logprobs.append(
                {self.tokenizer.token_to_str(t): max(lp, MIN_LOGPROB) for t, lp in entry.items()}
            )
            result.text_offset.append(text_offset)
            text_offset += len(token)
        return result
