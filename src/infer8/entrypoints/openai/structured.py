"""OpenAI `response_format` and vLLM's `structured_outputs` extra body -> StructuredOutputsParams."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from infer8.entrypoints.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest
from infer8.structured_output.compile_pool import GrammarTimeoutError
from infer8.structured_output.manager import GrammarBusyError
from infer8.structured_output.params import GrammarTooLargeError, StructuredOutputsParams

if TYPE_CHECKING:
    from infer8.entrypoints.openai.tool_calls import ToolContext
    from infer8.structured_output.manager import StructuredOutputManager

_STRUCTURED_OUTPUTS_FIELDS = {
    "json",
    "regex",
    "choice",
    "grammar",
    "json_object",
    "disable_any_whitespace",
}


def from_response_format(response_format: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """Return the constraint of OpenAI's response_format (text: none); APIError 400 if malformed."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(
                400,
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                param="response_format",
            )
        return _params({"json": schema}, "response_format")
    raise APIError(
        400,
        f"response_format type must be text, json_object or json_schema, got {kind!r}",
        param="response_format",
    )


def from_structured_outputs(
    body: dict[str, Any] | None, field_to_param: dict[str, str] | None = None
) -> StructuredOutputsParams | None:
    """Return the constraint of vLLM's structured_outputs extra body; APIError 400 if malformed."""
    if body is None:
        return None
    unknown = set(body) - _STRUCTURED_OUTPUTS_FIELDS
    if unknown:
        raise APIError(
            400,
            f"unknown structured_outputs field(s) {sorted(unknown)}; "
            f"supported: {sorted(_STRUCTURED_OUTPUTS_FIELDS)}",
            param="structured_outputs",
        )
    return _params(body, "structured_outputs", field_to_param)


def _params(
    fields: dict[str, Any], param: str, field_to_param: dict[str, str] | None = None
) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except GrammarTooLargeError as e:
        # Refused before any compile; named as the client spelled it (guided_regex, ...).
        named = (field_to_param or {}).get(e.field, param)
        raise APIError(400, str(e), param=named, code="grammar_too_large") from None
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e), param=param) from None


def constraint_of(
    response_format: dict[str, Any] | None,
    structured_outputs: dict[str, Any] | None,
    field_to_param: dict[str, str] | None = None,
) -> StructuredOutputsParams | None:
    """Return the one constraint response_format / structured_outputs ask for; 400 for two."""
    from_format = from_response_format(response_format)
    from_extra = from_structured_outputs(structured_outputs, field_to_param)
    if from_format is not None and from_extra is not None:
        raise APIError(
            400,
            "give either response_format or structured_outputs, not both",
            param="structured_outputs",
        )
    return from_format if from_format is not None else from_extra


def request_constraint(
    request: CompletionRequest | ChatCompletionRequest, tools: ToolContext | None
) -> StructuredOutputsParams | None:
    """Return the grammar a request's output must follow (response_format, extras, tools)."""
    extra = request.structured_outputs
    guided = {
        name: value
        for name, value in (
            ("json", request.guided_json),
            ("regex", request.guided_regex),
            ("choice", request.guided_choice),
            ("grammar", request.guided_grammar),
        )
        if value is not None
    }
    field_to_param = None
    if guided:
        if extra is not None:
            raise APIError(400, "give structured_outputs or guided_*, not both", param="guided")
        extra = guided
        field_to_param = {name: f"guided_{name}" for name in guided}
    constraint = constraint_of(request.response_format, extra, field_to_param)
    forced = None
    if tools is not None:
        try:
            forced = tools.constraint()
        except GrammarTooLargeError as e:
            raise APIError(400, str(e), param="tools", code="grammar_too_large") from None
    if constraint is not None and forced is not None:
        raise APIError(
            400,
            "a required or named tool_choice cannot be combined with response_format or "
            "structured_outputs",
            param="tool_choice",
        )
    return constraint if constraint is not None else forced


async def compile_or_400(
    manager: StructuredOutputManager,
    constraint: StructuredOutputsParams,
    request: CompletionRequest | ChatCompletionRequest,
) -> None:
    """Compile a grammar off the event loop (cached for the engine); APIError 400 if invalid.

    The compile runs in a process killed at the manager's time limit (a 400: the grammar is
    too costly); past its limit of compiles in flight the request is answered 503 at once.
    """
    try:
        await asyncio.wrap_future(manager.submit(constraint))
    except GrammarBusyError as e:
        raise APIError(
            503,
            f"cannot compile the grammar now: {e}",
            "server_overloaded",
            code="server_overloaded",
            headers={"Retry-After": "1"},
        ) from None
    except ValueError as e:
        param = "response_format" if request.response_format else "structured_outputs"
        for name in ("regex", "choice", "grammar", "json"):
            if getattr(request, f"guided_{name}", None) is not None:
                param = f"guided_{name}"
        if isinstance(request, ChatCompletionRequest) and request.tools:
            param = "tools"
        code = "grammar_too_costly" if isinstance(e, GrammarTimeoutError) else None
        raise APIError(400, str(e), param=param, code=code) from None
