"""The FastAPI app: OpenAI routes, /metrics, /health, API key, Host, head and body-size guards."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from infer8.engine import LLMEngine
from infer8.entrypoints.async_engine import AsyncLLMEngine
from infer8.entrypoints.console import CONSOLE_PUBLIC_PATHS, StepRecorder, add_console_routes
from infer8.entrypoints.openai.cli_args import ServerConfig
from infer8.entrypoints.openai.guards import (
    AdmissionMiddleware,
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
    HeaderLimitMiddleware,
    HostCheckMiddleware,
    JSONBodyMiddleware,
    SecurityHeadersMiddleware,
    allowed_host_patterns,
    error_response,
)
from infer8.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from infer8.entrypoints.openai.request_limits import (
    default_max_body_bytes,
    guarded_route,
    raw_limits,
)
from infer8.entrypoints.openai.serving import WorkPool
from infer8.entrypoints.openai.serving_chat import OpenAIServingChat
from infer8.entrypoints.openai.serving_completion import OpenAIServingCompletion
from infer8.entrypoints.openai.serving_responses import OpenAIServingResponses, add_responses_routes
from infer8.entrypoints.openai.vllm_compat import parse_json_list
from infer8.entrypoints.request_group import EngineDeadError, RequestGroup
from infer8.entrypoints.sse import SSEResponse, wait_for_disconnect
from infer8.entrypoints.supervision import SupervisionConfig
from infer8.lora.config import LoRAModulePath, LoRARequest
from infer8.metrics import EngineMetrics
from infer8.version import __version__

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Paths open without the API key (probes, docs), as in vLLM; /metrics too with
# --no-metrics-require-api-key.
_PUBLIC_PATHS = (
    frozenset({"/health", "/ready", "/version", "/openapi.json", "/docs"})
    | frozenset(f"/docs/{name}" for name in ("swagger-ui.css", "swagger-ui-bundle.js"))
    | CONSOLE_PUBLIC_PATHS
)
_MIN_STEP_TIMEOUT_S = 120.0
# A conservative sustained rate for the watchdog's estimate of the longest legitimate step.
_WATCHDOG_FLOPS_PER_S = {"cpu": 10e9, "cuda": 10e12}


_HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    503: {"model": HealthResponse, "description": "The engine is dead, wedged or draining."}
}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """Return OpenAPI entries for the error statuses a route really answers."""
    descriptions = {
        400: "Invalid request (bad JSON, parameters out of range, prompt too long).",
        401: "Missing or wrong API key (only with --api-key).",
        403: "Not allowed for one key among several (it would act on other keys' data).",
        404: "Unknown model.",
        413: "Request body too large.",
        500: "The engine failed this request alone; other requests were not affected.",
        503: "Overloaded (--max-waiting-requests), shutting down, or the engine is unavailable.",
    }
    return {c: {"model": ErrorResponse, "description": descriptions[c]} for c in codes}


# A server-sent event as the HTML standard defines its fields.
_SSE_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {"type": "string"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer", "minimum": 0},
    },
}

_GENERATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The completion, or a text/event-stream of chunks with `stream: true`.",
        # one event (OpenAPI 3.2's itemSchema; 3.0/3.1 tools read `schema` per event): `data`
        # holds a JSON chunk, the last one `[DONE]`
        "content": {"text/event-stream": {"schema": _SSE_EVENT_SCHEMA}},
    },
    **_errors(400, 401, 404, 413, 500, 503),
}


def default_step_timeout_s(engine: LLMEngine) -> float:
    """Return the watchdog limit: 4x a pessimistic time for the largest step, at least 120 s."""
    model = engine.worker.model  # packed CPU and FP8 weights are buffers
    num_params = sum(t.numel() for t in (*model.parameters(), *model.buffers()))
    tokens = engine.scheduler_config.max_num_batched_tokens
    flops = 2 * num_params * tokens
    rate = _WATCHDOG_FLOPS_PER_S.get(engine.model_config.device.type, 10e9)
    return max(_MIN_STEP_TIMEOUT_S, 4 * flops / rate)


def create_app(engine: LLMEngine, server_config: ServerConfig | None = None) -> FastAPI:
    """Return the app serving one engine; the engine thread runs for the app's lifespan."""
    config = server_config or ServerConfig()
    model_name = engine.served_model_name  # never a filesystem path unless the user typed one
    lora_config = engine.lora_config
    metrics = EngineMetrics(
        model_name, engine.cache_config, engine.num_blocks,
        max_loras=None if lora_config is None else lora_config.max_loras,
    )  # fmt: skip
    step_timeout_s = config.engine_step_timeout_s or default_step_timeout_s(engine)
    supervision = SupervisionConfig(step_timeout_s, config.max_engine_restarts)
    engine_client = AsyncLLMEngine(engine, metrics, config.max_waiting_requests, supervision)
    tool_parser = config.tool_call_parser if config.enable_auto_tool_choice else None
    api_keys = config.api_keys()
    pool = WorkPool()
    completions = OpenAIServingCompletion(engine_client, model_name, tool_parser, pool)
    chat = OpenAIServingChat(engine_client, model_name, tool_parser, pool)
    recorder = StepRecorder(engine, metrics)  # the web console's engine view
    engine.stat_loggers.append(recorder.on_step)
    engine_client.idle_loggers.append(recorder.on_idle)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_client.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine_client.shutdown)
            pool.shutdown()

    # /docs is served below from the package's Swagger UI files (no CDN).
    docs: dict[str, Any] = {"docs_url": None, "redoc_url": None}
    if config.disable_fastapi_docs:
        docs["openapi_url"] = None
    app = FastAPI(title="infer8", version=__version__, lifespan=lifespan, **docs)
    app.router.route_class = guarded_route(raw_limits(engine.max_model_len))
    app.state.engine_client = engine_client
    app.state.metrics = metrics
    app.state.console_recorder = recorder
    _add_error_handlers(app)
    app.add_middleware(JSONBodyMiddleware)
    max_body = config.max_request_body_bytes
    if max_body is None:
        max_body = default_max_body_bytes(engine.max_model_len)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=max_body)
    if api_keys:
        public = _PUBLIC_PATHS if config.metrics_require_api_key else _PUBLIC_PATHS | {"/metrics"}
        app.add_middleware(
            APIKeyMiddleware,
            api_keys=api_keys,
            public_paths=public,
            share_prefix_cache=config.share_prefix_cache_across_api_keys,
        )
    # An overload or drain 503 costs no parsing and no key check.
    app.add_middleware(AdmissionMiddleware, engine_client=engine_client)
    app.add_middleware(SecurityHeadersMiddleware)
    if config.allowed_origins is not None:  # CORS, outside the key check: preflights need none
        app.add_middleware(
            CORSMiddleware,
            allow_origins=parse_json_list(config.allowed_origins, "--allowed-origins"),
            allow_methods=parse_json_list(config.allowed_methods, "--allowed-methods"),
            allow_headers=parse_json_list(config.allowed_headers, "--allowed-headers"),
            allow_credentials=config.allow_credentials,
        )
    allowed_hosts = None
    if config.allowed_hosts is not None:
        allowed_hosts = parse_json_list(config.allowed_hosts, "--allowed-hosts")
    host_patterns = allowed_host_patterns(config.host, allowed_hosts)
    if host_patterns is not None:
        app.add_middleware(HostCheckMiddleware, allowed_hosts=host_patterns)
    app.add_middleware(  # outermost: an oversized head reaches nothing else
        HeaderLimitMiddleware,
        max_header_bytes=config.max_request_header_bytes,
        max_num_headers=config.max_num_request_headers,
    )

    @app.get("/health", response_model=HealthResponse, responses=_HEALTH_RESPONSES)
    async def health() -> JSONResponse:
        """Liveness: 503 with the reason when the engine is dead, a step or the tokenizer
        pool is wedged."""
        reason = engine_client.health() or pool.wedged_reason()
        if reason is None:
            return JSONResponse(HealthResponse(status="ok").model_dump())
        return JSONResponse(HealthResponse(status="unhealthy", reason=reason).model_dump(), 503)

    @app.get("/ready", response_model=HealthResponse, responses=_HEALTH_RESPONSES)
    async def ready() -> JSONResponse:
        """Readiness: also 503 while draining for shutdown, so no new traffic is routed here."""
        reason = engine_client.health() or pool.wedged_reason()
        if reason is None and engine_client.is_draining:
            reason = "the server is shutting down"
        if reason is None:
            return JSONResponse(HealthResponse(status="ok").model_dump())
        return JSONResponse(HealthResponse(status="unavailable", reason=reason).model_dump(), 503)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    for text in config.lora_modules or ():  # --lora-modules: checked before serving
        module = LoRAModulePath.parse(text)
        engine.add_lora(
            LoRARequest(module.name, engine.new_lora_id(), module.path, module.base_model_name)
        )

    @app.get("/v1/models", responses=_errors(401))
    async def list_models() -> JSONResponse:
        card = ModelCard(id=model_name, root=model_name, max_model_len=engine.max_model_len)
        cards = [card] + [
            ModelCard(
                id=lora.lora_name,
                root=lora.lora_path,
                parent=lora.base_model_name or model_name,
                max_model_len=engine.max_model_len,
            )  # fmt: skip
            for lora in engine.list_loras()
        ]
        return JSONResponse(ModelList(data=cards).model_dump())

    if config.allow_runtime_lora_updating:  # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING

        @app.post("/v1/load_lora_adapter", responses=_errors(400, 401, 404))
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
            """Serve a PEFT adapter under a new name (checked against the model first); a
            name in use or an adapter that does not fit is a 400."""
            lora = LoRARequest(body.lora_name, engine.new_lora_id(), body.lora_path)
            try:
                await asyncio.to_thread(engine.add_lora, lora)
            except ValueError as e:
                raise APIError(400, str(e)) from None
            return PlainTextResponse(
                f"Success: LoRA adapter '{body.lora_name}' added successfully."
            )

        @app.post("/v1/unload_lora_adapter", responses=_errors(400, 401, 404))
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
            """Stop serving an adapter; its running requests finish with it."""
            lora = engine.lora_by_name(body.lora_name)
            if lora is not None:
                engine.remove_lora(lora.lora_int_id)
                return PlainTextResponse(
                    f"Success: LoRA adapter '{body.lora_name}' removed successfully."
                )
            raise APIError(
                404, f"The lora adapter '{body.lora_name}' cannot be found.",
                param="lora_name", code="lora_adapter_not_found",
            )  # fmt: skip

    @app.post("/v1/completions", responses=_GENERATE_RESPONSES)
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        await completions.precompile(body)  # grammars compile in a thread: 400 if invalid
        sub = await completions.submit_completion(body, _tenant(raw_request))
        if body.stream:
            return EventStreamResponse(completions.stream_completion(body, sub), sub.group)
        try:
            result = await _unless_disconnected(raw_request, completions.complete(body, sub))
        finally:
            sub.group.abort()
        return _json_or_gone(result)

    @app.post("/v1/chat/completions", responses=_GENERATE_RESPONSES)
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
        await chat.precompile(body)
        sub = await chat.submit_chat(body, _tenant(raw_request))
        if body.stream:
            return EventStreamResponse(chat.stream_chat(body, sub), sub.group)
        try:
            result = await _unless_disconnected(raw_request, chat.chat(body, sub))
        finally:
            sub.group.abort()
        return _json_or_gone(result)

    add_responses_routes(app, OpenAIServingResponses(chat))  # /v1/responses and its store

    if config.enable_server_dev_mode:  # admin endpoints, as vLLM's VLLM_SERVER_DEV_MODE
        is_multi_tenant = len(set(api_keys)) > 1 and not config.share_prefix_cache_across_api_keys

        @app.post("/reset_prefix_cache", responses=_errors(401, 403, 503))
        async def reset_prefix_cache() -> JSONResponse:
            # Between two engine steps; blocks that running requests hold stay cached. The
            # cache is one pool: with several tenants a reset would drop the others' blocks.
            if is_multi_tenant:
                raise APIError(
                    403,
                    "/reset_prefix_cache drops every tenant's cached blocks, so it is refused "
                    "while several API keys are tenants; serve one key (or "
                    "--share-prefix-cache-across-api-keys) to use it",
                    code="permission_denied",
                )
            try:
                num_blocks = await engine_client.reset_prefix_cache()
            except EngineDeadError as e:
                raise APIError(503, str(e), "server_error", code="engine_unavailable") from None
            return JSONResponse({"num_dropped_blocks": num_blocks})

    @app.post("/tokenize", responses=_errors(400, 401, 404, 413, 503))
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> JSONResponse:
        """Tokenize a prompt or apply the chat template, in the tokenizer pool."""
        chat.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            token_ids = await pool.run(
                chat.chat_prompt,
                body.messages,
                body.add_generation_prompt,
                body.chat_template_kwargs,
            )
        else:
            chat.check_text_length(len(body.prompt), "prompt")  # before any tokenizing
            token_ids = await pool.run(chat.encode, body.prompt, "prompt", body.add_special_tokens)
        response = TokenizeResponse(
            count=len(token_ids), max_model_len=engine.max_model_len, tokens=token_ids
        )
        return JSONResponse(response.model_dump())

    @app.post("/detokenize", responses=_errors(400, 401, 404, 413, 503))
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        """Decode token ids, in the tokenizer pool."""
        completions.check_model(body.model)
        completions.check_token_ids(body.tokens, "tokens")
        text = await pool.run(engine.tokenizer.decode, body.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    if not config.disable_fastapi_docs:
        _add_docs_routes(app)

    add_console_routes(app, recorder, is_key_required=bool(api_keys))
    return app


# -- errors ------------------------------------------------------------------------------------
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
        # The details (names, paths) go to the log, never to the client.
        logger.exception("internal error on %s", request.url.path)
        return error_response(500, "internal server error (see the server log)", "server_error")


def _tenant(request: Request) -> str | None:
    """Return the request's tenant salt (set by the API key guard), if any."""
    return getattr(request.state, "tenant", None)


def _add_docs_routes(app: FastAPI) -> None:
    """Serve Swagger UI at /docs from the package's copy of its files (no CDN)."""
    from swagger_ui_bundle import swagger_ui_path

    assets = {"swagger-ui.css": "text/css", "swagger-ui-bundle.js": "text/javascript"}

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title="infer8 API",
            swagger_js_url="/docs/swagger-ui-bundle.js",
            swagger_css_url="/docs/swagger-ui.css",
            swagger_favicon_url="/favicon.ico",
        )

    for name, media_type in assets.items():
        app.add_api_route(
            f"/docs/{name}",
            lambda name=name, media_type=media_type: FileResponse(
                swagger_ui_path / name, media_type=media_type
            ),
            methods=["GET"],
            include_in_schema=False,
        )


# -- client disconnects ------------------------------------------------------------------------
async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Run work until done, or cancel it when the client goes away (then return None)."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(wait_for_disconnect(request.receive))
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


class EventStreamResponse(SSEResponse):
    """A server-sent-events response that aborts its requests when it ends or the client leaves."""

    def __init__(self, content: AsyncIterator[str], group: RequestGroup) -> None:
        super().__init__(content)
        self.group = group

    async def on_close(self) -> None:
        self.group.abort()
        await super().on_close()
