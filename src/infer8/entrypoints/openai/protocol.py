"""OpenAI-compatible request and response bodies (pydantic), with vLLM's sampling extras."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from infer8.sampling_params import SamplingParams

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 128
MAX_LOGPROBS = 20


class OpenAIBaseModel(BaseModel):
    """Base of request bodies: strict JSON types (no "10" for an int, no NaN); extras ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


# -- errors ------------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    """The body of OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo


class HealthResponse(BaseModel):
    """The body of /health and /ready: "ok", or why not."""

    status: str
    reason: str | None = None


class APIError(Exception):
    """A request the server refuses, carried to the HTTP status and OpenAI's error JSON."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=type_, param=param, code=code)
        self.headers = headers

    def to_response(self) -> ErrorResponse:
        """Return the JSON body."""
        return ErrorResponse(error=self.info)


# -- requests ----------------------------------------------------------------------------------
class StreamOptions(OpenAIBaseModel):
    """What a streamed response carries besides text (vLLM's defaults)."""

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _SamplingRequest(OpenAIBaseModel):
    """Fields shared by completions and chat completions: OpenAI's plus vLLM's extras."""

    model: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    n: int | None = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    # Prefix caching: requests with different salts never share cached KV blocks (tenants).
    cache_salt: str | None = None
    # Under --scheduling-policy priority, lower values are scheduled first; fcfs takes only 0.
    priority: int = Field(0, ge=_INT64_MIN, le=_INT64_MAX)
    # Structured outputs: OpenAI's response_format, or vLLM's structured_outputs extra body.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's older spellings of structured_outputs' json / regex / choice / grammar
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _check_common(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.cache_salt is not None and not self.cache_salt:
            raise ValueError("cache_salt must be a non-empty string if provided")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        return self

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        seed_offset: int = 0,
        defaults: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """Return the engine's SamplingParams for one choice; raise ValueError on bad values.

        `defaults` (the model's generation config) fills the sampling fields the client left out.
        """
        seed = self.seed
        if seed is not None and seed_offset:
            seed = (seed + seed_offset - _INT64_MIN) % 2**64 + _INT64_MIN
        given = {k: getattr(self, k) for k in _DEFAULTABLE if getattr(self, k) is not None}
        values = {**_API_DEFAULTS, **(defaults or {}), **given}
        return SamplingParams(
            temperature=values["temperature"],
            top_p=values["top_p"],
            top_k=values["top_k"],
            min_p=values["min_p"],
            seed=seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=values["repetition_penalty"],
            max_tokens=max_tokens,
            min_tokens=self.min_tokens or 0,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=bool(self.ignore_eos),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens is not False,
        )


# Sampling fields a model's generation config may default, with the API's own defaults.
_API_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}
_DEFAULTABLE = tuple(_API_DEFAULTS)


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("best_of is not supported (only best_of == n)")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported (no prompt logprobs)")
        return self


class ContentPart(OpenAIBaseModel):
    """One part of a message's content; only text parts are supported."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    """One chat message; extra fields (name, tool_calls...) reach the chat template."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    role: str
    content: str | list[ContentPart] | None = None

    def num_chars(self) -> int:
        """Return the characters of the message's text (its content, all text parts)."""
        if isinstance(self.content, str):
            return len(self.content)
        return sum(len(p.text or "") for p in self.content or [])

    def to_template_dict(self) -> dict[str, Any]:
        """Return the message for the chat template, text parts joined into one string."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"content part type {part.type!r} is not supported")
                texts.append(part.text)
            message["content"] = "\n".join(texts)
        return message


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    # vLLM's extras
    add_generation_prompt: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        """Return max_completion_tokens, or the deprecated max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens else self.max_tokens


class TokenizeCompletionRequest(OpenAIBaseModel):
    """POST /tokenize with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(OpenAIBaseModel):
    """POST /tokenize with chat messages (the chat template is applied)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class DetokenizeRequest(OpenAIBaseModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]


# -- responses ---------------------------------------------------------------------------------
def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    """Token counts of one API request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs object."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One choice of a completion (or a streamed chunk of one)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    """A completion, or one streamed chunk of it (same object name, as OpenAI does)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    """An alternative token at one position."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    """The sampled token at one position and its alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    """Logprobs of a chat choice."""

    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    """A function the model calls, with its arguments as a JSON string."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One tool call of an assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    """A streamed piece of a function call."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed piece of tool call `index` (id, type and name come in its first piece)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class AssistantMessage(BaseModel):
    """The generated message (or a streamed delta of it)."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] | list[DeltaToolCall] | None = None


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """A chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatStreamChoice(BaseModel):
    """One choice's delta in a streamed chat chunk."""

    index: int
    delta: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    """One streamed chat chunk."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    """One served model in /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "infer8"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """POST /v1/unload_lora_adapter (vLLM's body; lora_int_id is accepted and unused)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    """POST /tokenize."""

    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    """POST /detokenize."""

    prompt: str
