"""Size and shape limits on request bodies, checked before any validation or tokenization work.

Every JSON POST goes through `GuardedRoute`: the raw body's objects are counted first (parsing
500,000 small objects held the event loop for a second), then the parsed body is walked once,
iteratively (no recursion): too deep, too many values, or text that is not valid Unicode (a
lone surrogate such as the JSON escape "\\ud800", which no tokenizer can encode and no response
can echo) is refused with 400. Fan-out (prompts x n) and message counts are refused in O(1),
before pydantic validates the lists (two million prompts took it seconds).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from infer8.entrypoints.openai.protocol import APIError

# One API request may fan out into at most this many engine requests (prompts x n).
MAX_ENGINE_REQUESTS_PER_API_REQUEST = 1024
# Chat messages in one request; each also costs at least one token (checked against the
# context when the template is applied).
MAX_MESSAGES = 10_000
# JSON nesting and size of one body: generous for schemas and tools, bounded for the walk.
MAX_JSON_DEPTH = 64
MAX_JSON_VALUES = 1 << 19
# JSON objects and strings in one body, counted on the raw bytes before parsing ("{" and '"'
# bytes, those inside strings included: an over-count only); more for models whose context
# could hold that much text.
MIN_MAX_JSON_OBJECTS = 1 << 15
MIN_MAX_JSON_STRINGS = 1 << 16
_SCALARS = frozenset({int, float, bool, type(None)})


def default_max_body_bytes(max_model_len: int) -> int:
    """Return the default body limit: room for a context's worth of escaped text, and more.

    A whole context of prompt text JSON-escaped takes well under 64 bytes a token; the 4 MiB
    on top hold tools, schemas and batches of prompts. Parsing a body holds the event loop (a
    15 MB one ~25-50 ms on one core), so the cap also bounds how long one request can stall
    /health; --max-request-body-bytes raises it.
    """
    return (4 << 20) + 64 * max_model_len


def raw_limits(max_model_len: int) -> tuple[int, int]:
    """Return the most JSON objects and strings a body may hold for a model of this context."""
    return max(MIN_MAX_JSON_OBJECTS, max_model_len // 4), max(MIN_MAX_JSON_STRINGS, max_model_len)


def check_raw_body(body: bytes, limits: tuple[int, int]) -> None:
    """Raise ValueError for a body with more objects or strings than allowed, before parsing."""
    max_objects, max_strings = limits
    num_objects = body.count(b"{")
    if num_objects > max_objects:
        raise ValueError(
            f"the request body holds {num_objects} JSON objects (or braces); "
            f"the limit is {max_objects}"
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
    for name in ("messages", "input"):  # chat messages, Responses input items
        messages = data.get(name)
        if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
            raise ValueError(f"{name} has {len(messages)} items; the limit is {MAX_MESSAGES}")


def _walk(data: Any) -> None:
    """Check depth, size and Unicode of every value, iteratively."""
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    num_values = 1
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                check_unicode(value, path or "body")
            continue
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"{path or 'body'} is nested deeper than {MAX_JSON_DEPTH} levels")
        num_values += len(value)
        if num_values > MAX_JSON_VALUES:
            raise ValueError(f"the request body holds more than {MAX_JSON_VALUES} JSON values")
        if isinstance(value, dict):
            for key, item in value.items():
                check_unicode(key, f"a key of {path or 'body'}")
                if isinstance(item, (str, dict, list)):
                    stack.append((item, depth + 1, f"{path}.{key}" if path else key))
        elif not _SCALARS.issuperset(map(type, value)):  # token ids: counted, not pushed
            stack.extend(
                (item, depth + 1, f"{path}[{i}]")
                for i, item in enumerate(value)
                if isinstance(item, (str, dict, list))
            )


def check_unicode(text: str, param: str) -> None:
    """Raise ValueError for text with a lone surrogate (not encodable as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{param} is not valid Unicode (a lone surrogate at character {e.start})"
        ) from None


def guarded_route(limits: tuple[int, int]) -> type[APIRoute]:
    """Return an APIRoute class whose JSON bodies pass these checks before validation."""

    class GuardedRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def guarded(request: Request) -> Response:
                if request.method == "POST":
                    body = await request.body()
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
