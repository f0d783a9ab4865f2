"""Size and shape limits on request bodies, checked before any validation or tokenization work.

Every JSON POST goes through `GuardedRoute`: the raw body's objects, lists and strings are counted
first (parsing 500,000 small objects, or 1.5 million empty lists, held the event loop for one to
two seconds), then the parsed body is walked once,
iteratively (no recursion): too deep, too many values, or text that is not valid Unicode (a
lone surrogate such as the JSON escape "\\ud800", which no tokenizer can encode and no response
can echo) is refused with 400. Fan-out (prompts x n) and message counts are refused in O(1),
before pydantic validates the lists (two million prompts took it seconds). A client that leaves
while its body is uploading is one log line, not an internal error.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, NamedTuple

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect

from infer8.entrypoints.openai.protocol import APIError
from infer8.logging_setup import RateLimitedLog

logger = logging.getLogger(__name__)

# One API request may fan out into at most this many engine requests (prompts x n).
MAX_ENGINE_REQUESTS_PER_API_REQUEST = 1024
# Chat messages in one request; each also costs at least one token (checked against the
# context when the template is applied).
MAX_MESSAGES = 10_000
# OpenAI's limit on tools in one request. A `required` choice compiles one grammar over all of
# them, and each is rendered into the prompt.
MAX_TOOLS = 128
# JSON nesting and size of one body: generous for schemas and tools, bounded for the walk.
MAX_JSON_DEPTH = 64
MAX_JSON_VALUES = 1 << 19
# JSON objects, lists and strings in one body, counted on the raw bytes before parsing ("{", "["
# and '"' bytes, those inside strings included: an over-count only); more for models whose
# context could hold that much text. 65,536 empty lists parse in ~6 ms.
MIN_MAX_JSON_OBJECTS = 1 << 15
MIN_MAX_JSON_LISTS = 1 << 16
MIN_MAX_JSON_STRINGS = 1 << 16
_SCALARS = frozenset({int, float, bool, type(None)})
# Set in a request's scope["state"] by the HTTP server when it closed a body too slow to wait
# for: the server has logged it, the app's ClientDisconnect is not news.
BODY_TIMED_OUT = "infer8_body_timed_out"


class RawLimits(NamedTuple):
    """The most JSON objects, lists and strings (opening bytes) one raw body may hold."""

    max_objects: int
    max_lists: int
    max_strings: int


def default_max_body_bytes(max_model_len: int) -> int:
    """Return the default body limit: room for a context's worth of escaped text, and more.

    A whole context of prompt text JSON-escaped takes well under 64 bytes a token; the 4 MiB
    on top hold tools, schemas and batches of prompts. Parsing a body holds the event loop (a
    15 MB one ~25-50 ms on one core), so the cap also bounds how long one request can stall
    /health; --max-request-body-bytes raises it.
    """
    return (4 << 20) + 64 * max_model_len


def raw_limits(max_model_len: int) -> RawLimits:
    """Return the most JSON objects, lists and strings a body may hold for this context."""
    return RawLimits(
        max(MIN_MAX_JSON_OBJECTS, max_model_len // 4),
        max(MIN_MAX_JSON_LISTS, max_model_len),
        max(MIN_MAX_JSON_STRINGS, max_model_len),
    )


def check_raw_body(body: bytes, limits: RawLimits) -> None:
    """Raise ValueError for a body with more objects, lists or strings than allowed, unparsed."""
    max_objects, max_lists, max_strings = limits
    num_objects = body.count(b"{")
    if num_objects > max_objects:
        raise ValueError(
            f"the request body holds {num_objects} JSON objects (or braces); "
            f"the limit is {max_objects}"
        )
    num_lists = body.count(b"[")
    if num_lists > max_lists:
        raise ValueError(
            f"the request body holds {num_lists} JSON lists (or brackets); the limit is {max_lists}"
        )
    num_strings = body.count(b'"') // 2
    if num_strings > max_strings:
        raise ValueError(
            f"the request body holds {num_strings} JSON strings (or quote pairs); "
            f"the limit is {max_strings}"
        )


def check_body(data: Any) -> None:
    """Raise ValueError when a parsed request body is malformed past what validation handles."""
    if not isinstance(data, dict):
        return  # pydantic answers this one
    _check_fan_out(data)
    _walk(data)


def _check_fan_out(data: dict[str, Any]) -> None:
    prompt = data.get("prompt")
    n = data.get("n")
    num_prompts = 1
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        num_prompts = len(prompt)
    num_sequences = num_prompts * (n if isinstance(n, int) and n > 0 else 1)
    if num_sequences > MAX_ENGINE_REQUESTS_PER_API_REQUEST:
        raise ValueError(
            f"this request fans out into {num_sequences} sequences (prompts x n); "
            f"the limit is {MAX_ENGINE_REQUESTS_PER_API_REQUEST}"
        )
    tools = data.get("tools")
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:  # before the walk over each one
        raise APIError(
            400,
            f"tools has {len(tools)} entries; the limit is {MAX_TOOLS}",
            param="tools",
            code="too_many_tools",
        )
    for name in ("messages", "input"):  # chat messages, Responses input items
        messages = data.get(name)
        if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
            raise ValueError(f"{name} has {len(messages)} items; the limit is {MAX_MESSAGES}")


def _walk(data: Any) -> None:
    """Check depth, size and Unicode of every value, iteratively.

    A value's path is kept as a link to its parent's and spelled out only for an error: the
    walk over a 30,000-object body (128+ tools) then holds the event loop half as long.
    """
    stack: list[tuple[Any, int, Any]] = [(data, 1, None)]
    num_values = 1
    while stack:
        value, depth, link = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                check_unicode(value, _path(link) or "body")
            continue
        if depth > MAX_JSON_DEPTH:
            raise ValueError(
                f"{_path(link) or 'body'} is nested deeper than {MAX_JSON_DEPTH} levels"
            )
        num_values += len(value)
        if num_values > MAX_JSON_VALUES:
            raise ValueError(f"the request body holds more than {MAX_JSON_VALUES} JSON values")
        if isinstance(value, dict):
            for key, item in value.items():
                if not key.isascii():
                    check_unicode(key, f"a key of {_path(link) or 'body'}")
                if isinstance(item, (str, dict, list)):
                    stack.append((item, depth + 1, (link, key)))
        elif not _SCALARS.issuperset(map(type, value)):  # token ids: counted, not pushed
            stack.extend(
                (item, depth + 1, (link, i))
                for i, item in enumerate(value)
                if isinstance(item, (str, dict, list))
            )


def _path(link: Any) -> str:
    """Spell out a value's path from its (parent link, key or index) chain: messages[0].content."""
    parts: list[str] = []
    while link is not None:
        link, key = link
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return "".join(reversed(parts)).removeprefix(".")


def check_unicode(text: str, param: str) -> None:
    """Raise ValueError for text with a lone surrogate (not encodable as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{param} is not valid Unicode (a lone surrogate at character {e.start})"
        ) from None


def guarded_route(limits: RawLimits) -> type[APIRoute]:
    """Return an APIRoute class whose JSON bodies pass these checks before validation."""

    # One line per client that leaves mid-upload, up to 10 per 10 s, then a count.
    left_log = RateLimitedLog(logger, "clients that left during their request body")

    class GuardedRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def guarded(request: Request) -> Response:
                if request.method == "POST":
                    try:
                        body = await request.body()
                    except ClientDisconnect:
                        _log_disconnect(request, left_log)
                        return Response(status_code=499)  # nobody reads it
                    try:
                        check_raw_body(body, limits)
                        data = json.loads(body) if body else None
                    except ValueError as e:
                        if not isinstance(e, json.JSONDecodeError):
                            raise APIError(400, str(e)) from None
                    except RecursionError:
                        raise APIError(400, "the request body is nested too deeply") from None
                    else:
                        try:
                            check_body(data)
                        except ValueError as e:
                            raise APIError(400, str(e)) from None
                        request._json = data  # parsed once: the handler reads this
                return await handler(request)

            return guarded

    return GuardedRoute


def _log_disconnect(request: Request, log: RateLimitedLog) -> None:
    """Log, in one line, a client that left before its request body was in."""
    if getattr(request.state, BODY_TIMED_OUT, False):
        return  # closed by the server, which logged why
    client = request.client
    log.info(
        time.monotonic(),
        "client %s left during the request body of %s %s (content-length %s)",
        f"{client.host}:{client.port}" if client else "?",
        request.method,
        request.url.path,
        request.headers.get("content-length", "none: chunked"),
    )
