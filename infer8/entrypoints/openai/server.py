"""The FastAPI app: OpenAI routes, /metrics, /health, API key and body-size guards."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from infer8 import __version__
from infer8.engine import LLMEngine
from infer8.entrypoints.async_engine import AsyncLLMEngine, EngineDeadError, RequestGroup
from infer8.entrypoints.openai.cli_args import ServerConfig
from infer8.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from infer8.entrypoints.openai.serving import OpenAIServing
from infer8.metrics import EngineMetrics

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Paths open without the API key (probes and scrapers), as in vLLM.
_PUBLIC_PATHS = frozenset({"/health", "/version", "/metrics"})


def create_app(engine: LLMEngine, server_config: ServerConfig | None = None) -> FastAPI:
    """Return the app serving one engine; the engine thread runs for the app's lifespan."""
    config = server_config or ServerConfig()
    model_config = engine.model_config
    model_name = model_config.served_model_name or model_config.model
    metrics = EngineMetrics(model_name, engine.cache_config, engine.num_blocks)
    engine_client = AsyncLLMEngine(engine, metrics, config.max_waiting_requests)
    tool_parser = config.tool_call_parser if config.enable_auto_tool_choice else None
    serving = OpenAIServing(engine_client, model_name, tool_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_client.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine_client.shutdown)

    app = FastAPI(title="infer8", version=__version__, lifespan=lifespan)
    app.state.engine_client = engine_client
    app.state.metrics = metrics
    _add_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=config.max_request_body_bytes)
    if config.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine_client.is_healthy else 503)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        card = ModelCard(id=model_name, root=model_config.model, max_model_len=engine.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        await serving.precompile(body)  # grammars compile in a thread: 400 if invalid
        sub = serving.submit_completion(body)
        if body.stream:
            return EventStreamResponse(serving.stream_completion(body, sub), sub.group)
        try:
            result = await _unless_disconnected(raw_request, serving.complete(body, sub))
        finally:
            sub.group.abort()
        return _json_or_gone(result)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
        await serving.precompile(body)
        sub = serving.submit_chat(body)
        if body.stream:
            return EventStreamResponse(serving.stream_chat(body, sub), sub.group)
        try:
            result = await _unless_disconnected(raw_request, serving.chat(body, sub))
        finally:
            sub.group.abort()
        return _json_or_gone(result)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        # Between two engine steps; blocks that running requests hold stay cached.
        try:
            num_blocks = await engine_client.reset_prefix_cache()
        except EngineDeadError as e:
            raise APIError(503, str(e), "server_error", code="engine_unavailable") from None
        return JSONResponse({"num_dropped_blocks": num_blocks})

    @app.post("/tokenize")
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> JSONResponse:
        serving.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            token_ids = serving.chat_prompt(
                body.messages, body.add_generation_prompt, body.chat_template_kwargs
            )
        else:
            token_ids = engine.tokenizer.encode(
                body.prompt, add_special_tokens=body.add_special_tokens
            )
        response = TokenizeResponse(
            count=len(token_ids), max_model_len=engine.max_model_len, tokens=token_ids
        )
        return JSONResponse(response.model_dump())

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        serving.check_model(body.model)
        serving.check_token_ids(body.tokens, "tokens")
        text = engine.tokenizer.decode(body.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    return app


# -- errors ------------------------------------------------------------------------------------
def error_response(
    status_code: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """Return OpenAI's error JSON with a status code."""
    info = ErrorInfo(message=message, type=type_, param=param, code=code)
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    """Answer every failure with OpenAI's error JSON: 4xx for the client's, 500 for ours."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        body = exc.to_response().model_dump()
        return JSONResponse(body, exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        if errors and errors[0].get("type") == "json_invalid":
            reason = errors[0].get("ctx", {}).get("error", "")
            return error_response(400, f"The request body is not valid JSON: {reason}")
        content_type = request.headers.get("content-type", "")
        if "json" not in content_type and any(e.get("loc") == ("body",) for e in errors):
            return error_response(
                400, "The request body must be a JSON object sent as application/json."
            )
        parts, params = [], []
        for error in errors[:5]:
            loc = ".".join(str(p) for p in error.get("loc", ())[1:])
            params.append(loc)
            parts.append(f"{loc or 'body'}: {error.get('msg', 'invalid')}")
        return error_response(400, "; ".join(parts) or "invalid request", param=params[0] or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        headers = dict(exc.headers) if exc.headers else None
        return error_response(exc.status_code, str(exc.detail), type_, headers=headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        return error_response(500, f"internal server error: {exc!r}", "server_error")


# -- client disconnects ------------------------------------------------------------------------
async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Run work until done, or cancel it when the client goes away (then return None)."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
        await asyncio.gather(work_task, watch_task, return_exceptions=True)
    if work_task.cancelled():
        return None
    return work_task.result()


def _json_or_gone(result: Any) -> Response:
    if result is None:  # the client disconnected; nobody reads this
        return Response(status_code=499)
    return JSONResponse(result.model_dump())


class EventStreamResponse(StreamingResponse):
    """A server-sent-events response that aborts its requests when it ends or the client leaves."""

    def __init__(self, content: AsyncIterator[str], group: RequestGroup) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.group = group

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream_task = asyncio.ensure_future(self.stream_response(send))
        watch_task = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({stream_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream_task, watch_task):
                task.cancel()
            await asyncio.gather(stream_task, watch_task, return_exceptions=True)
            self.group.abort()
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
        if not stream_task.cancelled() and stream_task.exception() is not None:
            error = stream_task.exception()
            if not isinstance(error, OSError):  # OSError: the client went away mid-send
                raise error  # type: ignore[misc]


# -- guards ------------------------------------------------------------------------------------
class APIKeyMiddleware:
    """Refuses requests without `Authorization: Bearer <api_key>` (probes and /metrics open)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in _PUBLIC_PATHS:
            given = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(given, self.expected):
                response = error_response(
                    401,
                    "Incorrect or missing API key; send `Authorization: Bearer <key>`.",
                    code="invalid_api_key",
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Refuses request bodies over the limit with 413, declared or chunked."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _too_large(self) -> JSONResponse:
        return error_response(
            413,
            f"The request body exceeds {self.max_body_bytes} bytes.",
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None:
            # The HTTP server enforces the declared length, so checking it is enough.
            if declared.isdigit() and int(declared) > self.max_body_bytes:
                await self._too_large()(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        # No declared length (chunked): read the body up to the limit before the app sees it.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                await self._too_large()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        is_replayed = False

        async def replay() -> Message:
            nonlocal is_replayed
            if is_replayed:
                return await receive()
            is_replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)
