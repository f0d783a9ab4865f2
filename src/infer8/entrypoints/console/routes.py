"""The console's routes: the two pages, their static files, the served defaults, the event stream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from infer8.entrypoints.console import snapshot
from infer8.entrypoints.console.recorder import StepRecorder
from infer8.entrypoints.sse import SSEResponse

STATIC_DIR = Path(__file__).parent / "static"
PAGES = {"/": "chat.html", "/engine": "engine.html"}
STATIC_FILES = (
    "console.css",
    "common.js",
    "markdown.js",
    "chat.js",
    "charts.js",
    "engine.js",
    "favicon.svg",
)
EVENTS_PATH = "/console/api/events"
DEFAULTS_PATH = "/console/api/defaults"
CONFIG_PATH = "/console/config.js"
# Pages and static files hold nothing secret: they load without the API key, then ask for it.
# Everything they show comes from guarded endpoints (the event stream, the defaults, /v1/...).
# config.js tells the page whether to ask for a key (what a 401 from /v1/models tells anyway).
CONSOLE_PUBLIC_PATHS = (
    frozenset(PAGES)
    | frozenset(f"/console/{name}" for name in STATIC_FILES)
    | {CONFIG_PATH, "/favicon.ico"}
)
_MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}
_NO_CACHE = {"Cache-Control": "no-cache"}


def _static_response(name: str) -> FileResponse:
    path = STATIC_DIR / name
    return FileResponse(path, media_type=_MEDIA_TYPES[path.suffix], headers=_NO_CACHE)


def add_console_routes(app: FastAPI, recorder: StepRecorder, is_key_required: bool = False) -> None:
    """Add the chat page at `/`, the engine view at `/engine`, their defaults and event stream."""
    config_js = f"const INFER8_KEY_REQUIRED = {'true' if is_key_required else 'false'};\n"

    @app.get(CONFIG_PATH, include_in_schema=False)
    async def console_config() -> Response:
        return Response(config_js, media_type=_MEDIA_TYPES[".js"], headers=_NO_CACHE)

    for url_path, name in PAGES.items():
        app.add_api_route(
            url_path,
            lambda name=name: _static_response(name),
            methods=["GET"],
            include_in_schema=False,
        )
    for name in STATIC_FILES:
        app.add_api_route(
            f"/console/{name}",
            lambda name=name: _static_response(name),
            methods=["GET"],
            include_in_schema=False,
        )

    @app.get(EVENTS_PATH, include_in_schema=False)
    async def console_events(request: Request) -> Response:
        # Guarded by the API key middleware like every /v1 route: the page reads it with
        # fetch() and an Authorization header (EventSource cannot send one). With keys, the
        # viewer sees its own tenant's requests by id, others' as one row (none of them by
        # id when keys share the cache: requests then carry no tenant).
        tenant = getattr(request.state, "tenant", None)
        return ConsoleEventStream(recorder.stream(tenant=tenant, is_redacted=is_key_required))

    @app.get(DEFAULTS_PATH, include_in_schema=False)
    async def console_defaults() -> Response:
        # What a request leaving the sampling fields out gets (guarded like the event stream).
        return JSONResponse(snapshot.served_defaults(recorder.engine), headers=_NO_CACHE)

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        return _static_response("favicon.svg")


class ConsoleEventStream(SSEResponse):
    """A server-sent-events response that closes its generator as soon as the viewer leaves."""

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # SSEResponse.on_close closes the generator, which unregisters the viewer at once.
