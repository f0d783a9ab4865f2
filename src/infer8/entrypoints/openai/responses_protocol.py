"""`/v1/responses` bodies (OpenAI's Responses API as vLLM serves it): the request, the response
object and its output items, and the 400s for the request fields this server cannot honour."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, NoReturn

from pydantic import BaseModel, Field

from infer8.entrypoints.openai.protocol import APIError, OpenAIBaseModel

ResponseStatus = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]
# `include` values that ask for nothing this server produces: no reasoning items are emitted,
# so there is no encrypted reasoning to include (agents such as Codex send it by default).
_NO_OP_INCLUDES = frozenset({"reasoning.encrypted_content"})
_MAX_METADATA_PAIRS, _MAX_METADATA_KEY_CHARS, _MAX_METADATA_VALUE_CHARS = 16, 64, 512


def new_id(prefix: str) -> str:
    """Return a fresh id: resp_..., msg_..., fc_..., call_..."""
    return f"{prefix}_{uuid.uuid4().hex}"


# -- request -----------------------------------------------------------------------------------
class ResponsesRequest(OpenAIBaseModel):
    """POST /v1/responses."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    text: dict[str, Any] | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: no padding is sent
    metadata: dict[str, str] | None = None
    store: bool | None = True
    background: bool | None = False
    previous_response_id: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # a routing hint for OpenAI; one cache serves all here
    # "auto" is accepted and behaves as "disabled": nothing is ever dropped from the input; an
    # input over the context is answered 400 context_length_exceeded.
    truncation: Literal["auto", "disabled"] | None = "disabled"
    # Refused when set to something this server cannot do (check_supported).
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    service_tier: str | None = None
    # vLLM's sampling extras, as on chat completions
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    cache_salt: str | None = None
    priority: int | None = None  # --scheduling-policy priority (the chat path checks it)


def check_supported(request: ResponsesRequest) -> None:
    """Refuse (400, naming the field) what this server would otherwise have to drop silently."""
    if isinstance(request.input, list) and not request.input:
        refuse("input must be a string or a non-empty list of items", "input")
    reasoning = request.reasoning or {}
    if reasoning.get("effort") not in (None, "none"):
        refuse(
            f"reasoning effort {reasoning.get('effort')!r} is not supported: this server runs no "
            'reasoning step (use null or "none")',
            "reasoning.effort",
        )
    for name in ("summary", "generate_summary"):
        if reasoning.get(name) is not None:
            refuse("reasoning summaries are not supported", f"reasoning.{name}")
    for index, value in enumerate(request.include or []):
        if value not in _NO_OP_INCLUDES:
            refuse(f"include value {value!r} is not supported", f"include[{index}]")
    for name, what in (
        ("prompt", "reusable prompts"),
        ("conversation", "the Conversations API"),
        ("max_tool_calls", "max_tool_calls (use parallel_tool_calls: false for one call)"),
    ):
        if getattr(request, name) is not None:
            refuse(f"{what} is not supported", name)
    if request.top_logprobs:
        refuse("top_logprobs is not supported on /v1/responses", "top_logprobs")
    if request.service_tier not in (None, "auto", "default"):
        refuse(f"service_tier {request.service_tier!r} is not supported", "service_tier")
    if request.background and request.store is False:
        refuse("a background response must be stored (store: true)", "background")
    if request.background and request.stream:
        refuse(
            "background with stream is not supported; poll GET /v1/responses/{id} instead",
            "background",
        )
    _check_metadata(request.metadata)


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > _MAX_METADATA_PAIRS:
        refuse(f"metadata has {len(metadata)} pairs; at most {_MAX_METADATA_PAIRS}", "metadata")
    for key, value in metadata.items():
        if len(key) > _MAX_METADATA_KEY_CHARS or len(value) > _MAX_METADATA_VALUE_CHARS:
            refuse(
                f"metadata keys are at most {_MAX_METADATA_KEY_CHARS} characters and values at "
                f"most {_MAX_METADATA_VALUE_CHARS}",
                "metadata",
            )


def refuse(message: str, param: str) -> NoReturn:
    """Raise the 400 that names the refused field."""
    raise APIError(400, message, param=param)


# -- response ----------------------------------------------------------------------------------
class OutputText(BaseModel):
    """An `output_text` content part of a message."""

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    """A `message` output item: the assistant's text."""

    id: str = Field(default_factory=lambda: new_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    """A `function_call` output item: a call the client runs and answers with its output."""

    id: str = Field(default_factory=lambda: new_id("fc"))
    type: Literal["function_call"] = "function_call"
    call_id: str = Field(default_factory=lambda: new_id("call"))
    name: str
    arguments: str = ""
    status: ItemStatus = "in_progress"


OutputItem = OutputMessage | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    """Token counts of one response."""

    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseErrorInfo(BaseModel):
    """Why a response failed."""

    code: str
    message: str


class ResponsesResponse(BaseModel):
    """The response object (and the snapshot events carry): output items, status, echoes."""

    id: str = Field(default_factory=lambda: new_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    status: ResponseStatus = "in_progress"
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: ResponseErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    previous_response_id: str | None = None
    background: bool = False
    store: bool = True
    truncation: Literal["disabled"] = "disabled"
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    service_tier: str = "default"
    user: str | None = None


class DeletedResponse(BaseModel):
    """DELETE /v1/responses/{id}."""

    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
