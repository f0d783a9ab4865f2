"""One API request as the AsyncLLMEngine sees it: the RequestGroup its caller streams from, the
errors it raises to that caller, and the engine thread's record of each of its requests."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from infer8.lora.config import LoRARequest
from infer8.metrics import EngineMetrics
from infer8.outputs import CompletionOutput, RequestOutput
from infer8.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from infer8.entrypoints.async_engine import AsyncLLMEngine


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down or crashed); no request can run."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; the caller should retry later."""


class EngineDrainingError(RuntimeError):
    """The server is shutting down and takes no new requests."""


class RequestFailedError(RuntimeError):
    """The engine failed this request (alone, or with the step it was in); the server lives on."""


class RequestGroup:
    """Owns the engine requests of one API request (its choices) and the queue of their outputs.

    Outputs arrive as (index, RequestOutput). With DELTA requests (what the server sends) each
    output holds only this step's text, token ids and logprobs; the reader accumulates.
    """

    def __init__(
        self,
        request_id: str,
        prompts: Sequence[list[int]],
        params: Sequence[SamplingParams],
        loop: asyncio.AbstractEventLoop,
        engine: AsyncLLMEngine,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        assert len(prompts) == len(params) > 0
        self.request_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self.prompts = list(prompts)
        self.params = list(params)
        self.cache_salt = cache_salt
        self.priority = priority
        self.lora_request = lora_request  # the adapter its `model` named (None: the base)
        self.arrival_time_s = time.monotonic()
        self._loop = loop
        self._engine = engine
        self._queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException] = asyncio.Queue()
        self._is_finished = [False] * len(prompts)
        self._is_closed = False

    def put(self, item: tuple[int, RequestOutput] | BaseException) -> None:
        """Hand an output or an error to the event loop (called from the engine thread)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    async def stream(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield (index, output) until every request of the group has finished.

        Raises RequestFailedError when the engine failed one of them, EngineDeadError when the
        engine stopped, ValueError when the engine refused them.
        """
        try:
            while not all(self._is_finished):
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self._is_finished = [True] * len(self._is_finished)
                    raise item
                index, output = item
                if output.finished:
                    self._is_finished[index] = True
                if output.error is not None:
                    raise RequestFailedError(
                        "the engine failed while generating this request (an internal error; "
                        "other requests were not affected); retry it"
                    )
                yield index, output
        finally:
            self._engine.forget(self)

    def abort(self) -> None:
        """Abort the requests that have not finished (idempotent; safe from any code path)."""
        if self._is_closed:
            return
        self._is_closed = True
        self._engine.forget(self)
        unfinished = [rid for rid, done in zip(self.request_ids, self._is_finished) if not done]
        if unfinished:
            self._engine.abort(unfinished)

    def aborted_output(self, index: int, last: RequestOutput | None) -> RequestOutput:
        """Return the final output of request `index` once aborted: what it had, nothing new."""
        if last is None:
            completion = CompletionOutput(0, "", [], None, None)
            prompt_token_ids = self.prompts[index]
        else:
            previous = last.outputs[0]
            is_delta = self.params[index].output_kind == RequestOutputKind.DELTA
            completion = dataclasses.replace(
                previous,
                text="" if is_delta else previous.text,
                token_ids=[] if is_delta else previous.token_ids,
                delta_text="",
                delta_token_ids=[],
                logprobs=None if previous.logprobs is None else [],
            )
            prompt_token_ids = last.prompt_token_ids
        completion.finish_reason = "abort"
        return RequestOutput(
            self.request_ids[index], None, prompt_token_ids, [completion], finished=True
        )


@dataclass
class TrackedRequest:
    """The engine thread's record of one engine request of a group."""

    group: RequestGroup
    index: int
    num_prompt_tokens: int
    is_admitted: bool = False
    first_token_time_s: float | None = None
    last_token_time_s: float | None = None
    last_output: RequestOutput | None = None

    def record_tokens(
        self, output: RequestOutput, now_s: float, metrics: EngineMetrics | None
    ) -> None:
        """Keep the latest output and report its tokens' timing (TTFT, inter-token latency)."""
        self.last_output = output
        num_new = len(output.outputs[0].delta_token_ids)
        if not num_new:
            return
        if metrics is not None:
            if self.first_token_time_s is None:
                metrics.on_first_token(now_s - self.group.arrival_time_s, self.num_prompt_tokens)
            else:
                assert self.last_token_time_s is not None
                metrics.on_next_tokens((now_s - self.last_token_time_s) / num_new)
            metrics.on_generation_tokens(num_new)
        self.first_token_time_s = self.first_token_time_s or now_s
        self.last_token_time_s = now_s
