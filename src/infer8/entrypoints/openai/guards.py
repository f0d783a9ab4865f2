"""ASGI guards in front of the app: request head size, Host names, admission and drain, API keys
(one tenant each), body size, JSON-only POST bodies and security headers. Each answers before the
body is parsed."""

from __future__ import annotations

import hashlib
import ipaddress
import secrets
from collections.abc import Iterable, Sequence

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from infer8.entrypoints.async_engine import AsyncLLMEngine
from infer8.entrypoints.openai.protocol import APIError

# Paths that start work: refused at once (before parsing) when overloaded or draining.
GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
_DRAINED_PATHS = GENERATE_PATHS | {"/tokenize", "/detokenize"}
# Pages of the web console get a content security policy: scripts and connections to this
# origin only; inline style attributes allowed (the pages' legends use them).
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
    "form-action 'none'"
)
# Swagger UI's page starts itself with an inline script.
_DOCS_CSP = _CSP.replace("script-src 'self'", "script-src 'self' 'unsafe-inline'")
_COMMON_HEADERS = (
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
)


def error_response(
    status_code: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """Return OpenAI's error JSON with a status code."""
    error = APIError(status_code, message, type_, param, code, headers)
    return JSONResponse(error.to_response().model_dump(), status_code, headers=headers)


def is_loopback_name(host: str) -> bool:
    """Return whether a host name or address always means this machine (127/8, ::1, localhost)."""
    name = host.lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):  # RFC 6761: never sent to DNS
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_host_patterns(bind_host: str, allowed_hosts: Sequence[str] | None) -> list[str] | None:
    """Return the Host names to serve besides loopback ones; None: any Host.

    Without a list, a server bound to loopback serves loopback names only: a web page whose
    name an attacker re-points at 127.0.0.1 (DNS rebinding) then reaches nothing.
    """
    if allowed_hosts is None:
        return [] if is_loopback_name(bind_host) else None
    if "*" in allowed_hosts:
        return None
    return [h.lower().rstrip(".") for h in allowed_hosts]


def _host_name(value: str) -> str:
    """Return a Host header's name or address without its port, lower-cased."""
    value = value.strip().lower()
    if value.startswith("["):  # [v6 address]:port
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class HostCheckMiddleware:
    """Refuses requests whose Host header names no host this server is meant to serve (421).

    Loopback names are always served. A request without a Host header passes: browsers always
    send one, so it cannot be a rebound page.
    """

    def __init__(self, app: ASGIApp, allowed_hosts: Sequence[str]) -> None:
        self.app = app
        self.names = frozenset(h for h in allowed_hosts if not h.startswith("*."))
        self.suffixes = tuple(h[1:] for h in allowed_hosts if h.startswith("*."))

    def is_allowed(self, host: str) -> bool:
        """Return whether a Host header value names a served host."""
        name = _host_name(host).rstrip(".")
        return (
            is_loopback_name(name)
            or name in self.names
            or (bool(self.suffixes) and name.endswith(self.suffixes))
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            host = Headers(scope=scope).get("host")
            if host is not None and not self.is_allowed(host):
                response = error_response(
                    421,
                    f"This server does not serve the host {_host_name(host)!r} (--allowed-hosts).",
                    code="misdirected_request",
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class HeaderLimitMiddleware:
    """Refuses a request head with too many header lines or too many header bytes (431).

    The HTTP server has read the head already (its time is bounded by the head deadline); this
    keeps oversized heads from reaching the app and says why.
    """

    def __init__(self, app: ASGIApp, max_header_bytes: int, max_num_headers: int) -> None:
        self.app = app
        self.max_header_bytes = max_header_bytes
        self.max_num_headers = max_num_headers
        self.refused = error_response(
            431,
            f"The request head exceeds {max_num_headers} headers or {max_header_bytes} bytes "
            "(--max-num-request-headers, --max-request-header-bytes).",
            code="request_header_fields_too_large",
            headers={"Connection": "close"},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            headers = scope["headers"]
            if len(headers) > self.max_num_headers or (
                sum(len(name) + len(value) for name, value in headers) > self.max_header_bytes
            ):
                await self.refused(scope, receive, send)
                return
        await self.app(scope, receive, send)


def tenant_of(key: str) -> str:
    """Return the prefix-cache salt of an API key's tenant (never the key itself)."""
    return "tenant-" + hashlib.sha256(key.encode()).hexdigest()[:24]


class AdmissionMiddleware:
    """Refuses work at once, before reading the body, when draining or full.

    The two answers are rendered once, so a 503 under a burst costs no parsing, no tokenization
    and no JSON encoding. While draining every API request gets 503 with `Connection: close`;
    probes and /metrics still answer.
    """

    def __init__(self, app: ASGIApp, engine_client: AsyncLLMEngine) -> None:
        self.app = app
        self.engine_client = engine_client
        self.draining = error_response(
            503,
            "the server is shutting down; retry on another replica",
            "server_error",
            code="server_shutting_down",
            headers={"Connection": "close"},
        )
        self.overloaded = error_response(
            503,
            f"the server is overloaded (--max-waiting-requests "
            f"{engine_client.max_waiting_requests} reached); retry later",
            "server_overloaded",
            code="server_overloaded",
            headers={"Retry-After": "1"},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in _DRAINED_PATHS:
            client = self.engine_client
            if client.is_draining:
                await self.draining(scope, receive, send)
                return
            if client.is_overloaded and scope["path"] in GENERATE_PATHS:
                if client.metrics is not None:
                    client.metrics.on_rejected()
                await self.overloaded(scope, receive, send)
                return
        await self.app(scope, receive, send)


class APIKeyMiddleware:
    """Refuses requests without `Authorization: Bearer <key>` for one of the keys.

    The matched key's tenant (a salt, not the key) goes to `request.state.tenant`, so that
    tenants never share prefix-cache blocks unless `share_prefix_cache` is set; the same salt
    goes to `request.state.key_id` whatever that setting (stored responses are per key).
    """

    def __init__(
        self,
        app: ASGIApp,
        api_keys: Iterable[str],
        public_paths: frozenset[str],
        share_prefix_cache: bool = False,
    ) -> None:
        self.app = app
        self.public_paths = public_paths
        self.share_prefix_cache = share_prefix_cache
        self.expected = [(f"Bearer {key}".encode(), tenant_of(key)) for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.public_paths:
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("authorization", "").encode()
        found = False
        key_id: str | None = None
        for expected, salt in self.expected:  # every key compared: no timing by position
            if secrets.compare_digest(given, expected):
                found, key_id = True, salt
        if not found:
            response = error_response(
                401,
                "Incorrect or missing API key; send `Authorization: Bearer <key>`.",
                code="invalid_api_key",
            )
            await response(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["tenant"] = None if self.share_prefix_cache else key_id
        state["key_id"] = key_id
        await self.app(scope, receive, send)


class JSONBodyMiddleware:
    """Refuses a POST with a body that is not declared `application/json` (415).

    A page on another origin can send a "simple" cross-origin POST (text/plain, a form, or no
    content type at all) without a CORS preflight; only JSON bodies are accepted here.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.refused = error_response(
            415,
            "POST bodies must be JSON sent with `Content-Type: application/json`.",
            code="unsupported_media_type",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = Headers(scope=scope)
            has_body = headers.get("content-length", "0") != "0" or (
                "chunked" in headers.get("transfer-encoding", "").lower()
            )
            media_type = headers.get("content-type", "").split(";")[0].strip().lower()
            is_json = media_type == "application/json" or media_type.endswith("+json")
            if has_body and not is_json:
                await self.refused(scope, receive, send)
                return
        await self.app(scope, receive, send)


class SecurityHeadersMiddleware:
    """Adds nosniff, no framing and no referrer to every response, and a CSP to HTML pages."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in _COMMON_HEADERS:
                    headers.setdefault(name.decode(), value.decode())
                if headers.get("content-type", "").startswith("text/html"):
                    is_docs = scope["path"] == "/docs"
                    headers.setdefault("content-security-policy", _DOCS_CSP if is_docs else _CSP)
            await send(message)

        await self.app(scope, receive, send_with_headers)


class BodySizeLimitMiddleware:
    """Refuses request bodies over the limit with 413, declared or chunked."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _too_large(self) -> JSONResponse:
        return error_response(
            413,
            f"The request body exceeds {self.max_body_bytes} bytes (--max-request-body-bytes).",
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
