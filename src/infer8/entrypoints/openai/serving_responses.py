"""`/v1/responses` (OpenAI's Responses API, as vLLM serves it): a request becomes a chat
completion (the chat path's template, tools, grammars and engine calls), its outputs become
output items, streamed as typed events or returned whole, and stored for retrieve, cancel,
delete and `previous_response_id`.

A response runs one way whatever its mode: one event generator reads the engine's outputs, and
its end (finished, failed, cancelled, or its client gone) stores the final object. Streamed, the
events go to the client; otherwise a task drains them (`background: true` returns at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from infer8.entrypoints.openai.protocol import APIError, DeltaToolCall, ErrorResponse
from infer8.entrypoints.openai.responses_events import Event, ResponseEvents, sse_event
from infer8.entrypoints.openai.responses_input import chat_request, echo_tools, input_messages
from infer8.entrypoints.openai.responses_protocol import (
    DeletedResponse,
    IncompleteDetails,
    InputTokensDetails,
    ResponseErrorInfo,
    ResponsesRequest,
    ResponsesResponse,
    ResponseStatus,
    ResponseUsage,
    check_supported,
)
from infer8.entrypoints.openai.responses_store import ResponsesStore, StoredResponse
from infer8.entrypoints.openai.serving import Submission, stream_outputs
from infer8.entrypoints.openai.serving_chat import OpenAIServingChat
from infer8.entrypoints.sse import SSEResponse, wait_for_disconnect

# How long a cancel waits for the aborted request's last output (to return its partial output).
_CANCEL_WAIT_S = 5.0
_FINAL_EVENTS: dict[ResponseStatus, str] = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "cancelled": "response.incomplete",  # OpenAI defines no cancelled event: stopped early
    "failed": "response.failed",
}
# One server-sent event of a streamed response: the event type names it, `data` is its JSON.
_SSE_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["event", "data"],
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
}
# Chat request fields named in the chat path's errors, as this API calls them.
_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "prompt": "input",
    "response_format": "text.format",
    "structured_outputs": "text.format",
}


@dataclass
class ResponseRun:
    """One response being generated: its submission, the object clients see, how it ended."""

    response: ResponsesResponse
    sub: Submission
    owner: str | None
    conversation: list[dict[str, Any]]  # chat messages before its output (no instructions)
    is_stored: bool
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    is_cancelled: bool = False
    error: APIError | None = None
    builder: ResponseEvents = field(default_factory=ResponseEvents)
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    async def cancel(self) -> None:
        """Abort the request; wait (a little) for its last output, to return what it wrote."""
        self.is_cancelled = True
        self.response.status = "cancelled"
        self.sub.group.abort()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.finished.wait(), _CANCEL_WAIT_S)


class OpenAIServingResponses:
    """`/v1/responses`: owns the store, the responses running now and the background tasks."""

    def __init__(self, chat: OpenAIServingChat, store: ResponsesStore | None = None) -> None:
        self.chat = chat
        self.store = store if store is not None else ResponsesStore()
        self.runs: dict[str, ResponseRun] = {}  # by response id, while generating
        self._tasks: set[asyncio.Task[None]] = set()

    # -- create ---------------------------------------------------------------------------------
    async def create(self, body: ResponsesRequest, raw_request: Request) -> Response:
        """Submit a response; return it whole, as an event stream, or (background) at once."""
        check_supported(body)
        self.chat.check_model(body.model)
        owner = _owner(raw_request)
        prior: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            prior = self._conversation(owner, body.previous_response_id)
        conversation = [*prior, *input_messages(body.input)]
        request = chat_request(body, conversation)
        with _responses_params():
            await self.chat.precompile(request)
            sub = await self.chat.submit_chat(request, getattr(raw_request.state, "tenant", None))
        run = ResponseRun(
            self._snapshot(body, sub), sub, owner, conversation, is_stored=body.store is not False
        )
        self.runs[run.response.id] = run
        if run.is_stored:
            self.store.put(owner, StoredResponse(run.response, conversation))
        if body.stream:
            return ResponseEventStream(self, run)
        task = asyncio.ensure_future(self._drain(run))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if body.background:
            return JSONResponse(run.response.model_dump())
        if not await _unless_disconnected(raw_request, task):
            self.finish(run, "cancelled")  # if the task was cancelled before it started
            return Response(status_code=499)  # the client left; nobody reads this
        if run.error is not None:
            raise run.error
        return JSONResponse(run.response.model_dump())

    def _conversation(self, owner: str | None, response_id: str) -> list[dict[str, Any]]:
        entry = self.store.get(owner, response_id)
        if entry is None:
            raise _not_found(response_id, "previous_response_id")
        if response_id in self.runs:
            raise APIError(
                400,
                f"Response with id '{response_id}' is still in progress; continue it once it "
                "has finished.",
                param="previous_response_id",
            )
        return entry.conversation

    def _snapshot(self, body: ResponsesRequest, sub: Submission) -> ResponsesResponse:
        params = sub.group.params[0]  # the sampling actually used (generation config defaults)
        return ResponsesResponse(
            model=self.chat.model_name,
            instructions=body.instructions,
            metadata=body.metadata,
            temperature=params.temperature,
            top_p=params.top_p,
            max_output_tokens=body.max_output_tokens,
            tools=echo_tools(body.tools),
            tool_choice=body.tool_choice or "auto",
            parallel_tool_calls=body.parallel_tool_calls is not False,
            text={"format": (body.text or {}).get("format") or {"type": "text"}},
            previous_response_id=body.previous_response_id,
            background=bool(body.background),
            store=body.store is not False,
            user=body.user,
        )

    # -- generate -------------------------------------------------------------------------------
    async def _drain(self, run: ResponseRun) -> None:
        async for _ in self.events(run):
            pass

    async def events(self, run: ResponseRun) -> AsyncGenerator[Event, None]:
        """Yield a response's events while generating it; store it however it ends."""
        builder = run.builder
        try:
            yield builder.event("response.created", response=run.response.model_dump())
            yield builder.event("response.in_progress", response=run.response.model_dump())
            streamer = run.sub.tools.streamer() if run.sub.tools is not None else None
            finish_reason = None
            try:
                async for _, output in stream_outputs(run.sub.group):
                    completion = output.outputs[0]
                    run.num_output_tokens += len(completion.delta_token_ids)
                    run.num_cached_tokens = max(run.num_cached_tokens, output.num_cached_tokens)
                    text: str | None = completion.delta_text
                    calls: list[DeltaToolCall] = []
                    if streamer is not None:
                        text, calls = streamer.feed(completion.delta_text, output.finished)
                    for event in [*builder.text(text or ""), *builder.calls(calls)]:
                        yield event
                    if output.finished:
                        finish_reason = completion.finish_reason
            except APIError as e:
                run.error = e
            status = self._status(run, finish_reason)
            if not builder.items and status in ("completed", "incomplete"):
                for event in builder.message():  # a text answer has a message, if empty
                    yield event
            for event in builder.close("completed" if status == "completed" else "incomplete"):
                yield event
            self.finish(run, status)
            yield builder.event(_FINAL_EVENTS[status], response=run.response.model_dump())
        finally:  # the client left or the task was cancelled: what was written is kept
            self.finish(run, "cancelled")

    def _status(self, run: ResponseRun, finish_reason: str | None) -> ResponseStatus:
        if run.is_cancelled:
            return "cancelled"
        if run.error is None and finish_reason == "abort":  # drained at shutdown
            run.error = APIError(
                503,
                "the request was aborted before it finished (the server is shutting down); "
                "retry on another replica",
                "server_error",
                code="request_aborted",
                headers={"Connection": "close"},
            )
        if run.error is not None:
            return "failed"
        return "incomplete" if finish_reason == "length" else "completed"

    def finish(self, run: ResponseRun, status: ResponseStatus) -> None:
        """Set the final object (once), free the request and store the response."""
        if run.finished.is_set():
            return
        run.finished.set()
        run.sub.group.abort()  # idempotent; frees the blocks of a request that did not finish
        self.runs.pop(run.response.id, None)
        builder = run.builder
        builder.close("incomplete")  # the item a cancel or a departed client left open
        response = run.response
        response.status = status
        response.output = builder.items
        response.completed_at = int(time.time())
        response.usage = ResponseUsage(
            input_tokens=run.sub.num_prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=run.num_cached_tokens),
            output_tokens=run.num_output_tokens,
            total_tokens=run.sub.num_prompt_tokens + run.num_output_tokens,
        )
        if status == "incomplete":
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        if run.error is not None:
            code = "invalid_prompt" if run.error.status_code == 400 else "server_error"
            response.error = ResponseErrorInfo(code=code, message=run.error.info.message)
        if run.is_stored:
            output = input_messages([item.model_dump() for item in builder.items])
            self.store.put(run.owner, StoredResponse(response, [*run.conversation, *output]))

    # -- retrieve, cancel, delete ---------------------------------------------------------------
    def retrieve(self, response_id: str, raw_request: Request) -> ResponsesResponse:
        """Return the caller's stored response (in progress or finished); 404 otherwise."""
        entry = self.store.get(_owner(raw_request), response_id)
        if entry is None:
            raise _not_found(response_id, "response_id")
        return entry.response

    async def cancel(self, response_id: str, raw_request: Request) -> ResponsesResponse:
        """Abort a response in progress and return it; 400 once it has finished."""
        response = self.retrieve(response_id, raw_request)
        run = self.runs.get(response_id)
        if run is None:
            raise APIError(
                400,
                f"Response with id '{response_id}' has already finished (status "
                f"{response.status}); only a response in progress can be cancelled.",
                param="response_id",
            )
        await run.cancel()
        return run.response

    def delete(self, response_id: str, raw_request: Request) -> DeletedResponse:
        """Forget the caller's stored response; a background one still running is cancelled."""
        if not self.store.delete(_owner(raw_request), response_id):
            raise _not_found(response_id, "response_id")
        run = self.runs.get(response_id)
        if run is not None:
            run.is_stored = False  # not stored again when it finishes
            if run.response.background:  # nobody could read it any more
                run.is_cancelled = True
                run.sub.group.abort()
        return DeletedResponse(id=response_id)


def add_responses_routes(app: FastAPI, responses: OpenAIServingResponses) -> None:
    """Serve POST /v1/responses and GET, DELETE and cancel of /v1/responses/{response_id}.

    The serving (and its store) is kept on `app.state.responses`.
    """
    app.state.responses = responses

    @app.post("/v1/responses", response_model=ResponsesResponse, responses=_docs(400, 404, 503))
    async def create_response(body: ResponsesRequest, raw_request: Request) -> Response:
        return await responses.create(body, raw_request)

    @app.get("/v1/responses/{response_id}", response_model=ResponsesResponse, responses=_docs(404))
    async def retrieve_response(response_id: str, raw_request: Request) -> JSONResponse:
        return JSONResponse(responses.retrieve(response_id, raw_request).model_dump())

    @app.post(
        "/v1/responses/{response_id}/cancel",
        response_model=ResponsesResponse,
        responses=_docs(400, 404),
    )
    async def cancel_response(response_id: str, raw_request: Request) -> JSONResponse:
        return JSONResponse((await responses.cancel(response_id, raw_request)).model_dump())

    @app.delete("/v1/responses/{response_id}", response_model=DeletedResponse, responses=_docs(404))
    async def delete_response(response_id: str, raw_request: Request) -> JSONResponse:
        return JSONResponse(responses.delete(response_id, raw_request).model_dump())


def _docs(*codes: int) -> dict[int | str, dict[str, Any]]:
    """Return OpenAPI entries for the error statuses a route answers (and 401 with keys)."""
    docs: dict[int | str, dict[str, Any]] = {
        code: {"model": ErrorResponse} for code in (*codes, 401)
    }
    if 400 in codes and 503 in codes:  # POST /v1/responses: it streams too, and may fail
        docs[200] = {"content": {"text/event-stream": {"schema": _SSE_EVENT_SCHEMA}}}
        docs.update({code: {"model": ErrorResponse} for code in (413, 500)})
    return docs


def _owner(request: Request) -> str | None:
    """Return the id of the API key that sent a request (None when the server has no keys)."""
    return getattr(request.state, "key_id", None)


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(
        404, f"Response with id '{response_id}' not found.", param=param, code="not_found"
    )


@contextlib.contextmanager
def _responses_params() -> Iterator[None]:
    """Rename the chat fields that the chat path's errors name to this API's fields."""
    try:
        yield
    except APIError as e:
        e.info.param = _PARAMS.get(e.info.param or "", e.info.param)
        raise


class ResponseEventStream(SSEResponse):
    """A response's events as server-sent events; when they end or the client leaves, the
    response is finished (its request aborted, what it wrote stored)."""

    def __init__(self, serving: OpenAIServingResponses, run: ResponseRun) -> None:
        super().__init__(_sse(serving.events(run)))
        self.serving = serving
        self.run = run

    async def on_close(self) -> None:
        await super().on_close()
        self.serving.finish(self.run, "cancelled")  # a no-op once it finished


async def _sse(events: AsyncGenerator[Event, None]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield sse_event(event)
    finally:
        await events.aclose()


async def _unless_disconnected(request: Request, task: asyncio.Task[None]) -> bool:
    """Wait for a task; cancel it if the client goes away first (then return False)."""
    watch = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    return not task.cancelled()
