"""A `/v1/responses` request as the chat path takes it: input items -> chat messages, flat
function tools -> chat tools, tool_choice and text.format -> their chat forms; 400s (naming the
field) for items, parts, tools and formats this server does not serve."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from infer8.entrypoints.openai.protocol import APIError, ChatCompletionRequest
from infer8.entrypoints.openai.responses_protocol import ResponsesRequest, refuse

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_SAMPLING_EXTRAS = ("seed", "top_k", "min_p", "repetition_penalty", "stop", "ignore_eos")


def chat_request(
    request: ResponsesRequest, conversation: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """Return the chat completion request that generates this response after `conversation`."""
    messages = list(conversation)
    if request.instructions is not None:  # never carried over from a previous response
        messages.insert(0, {"role": "system", "content": request.instructions})
    body: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "tools": chat_tools(request.tools),
        "tool_choice": chat_tool_choice(request.tool_choice),
        "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": response_format(request.text),
        "user": request.user,
        "cache_salt": request.cache_salt,
        **{name: getattr(request, name) for name in _SAMPLING_EXTRAS},
    }
    if request.priority is not None:
        body["priority"] = request.priority
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        error = e.errors()[0]
        loc = ".".join(str(p) for p in error.get("loc", ()))
        raise APIError(400, f"{loc}: {error.get('msg', 'invalid')}", param=loc or None) from None


# -- input -------------------------------------------------------------------------------------
def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return the chat messages of a Responses input (a string is one user message)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        param = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                refuse(
                    f"role {role!r} is not one of user, system, developer, assistant",
                    f"{param}.role",
                )
            content = _text(item.get("content"), f"{param}.content")
            messages.append({"role": _ROLES[role], "content": content})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", param),
                "type": "function",
                "function": {
                    "name": _string(item, "name", param),
                    "arguments": _string(item, "arguments", param),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # calls of one turn: one message
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", param)
            output = _text(item.get("output"), f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            hint = "; use previous_response_id" if kind == "item_reference" else ""
            refuse(
                f"input item type {kind!r} is not supported (message, function_call and "
                f"function_call_output are){hint}",
                f"{param}.type",
            )
    return messages


def _text(content: Any, param: str) -> str:
    """Return the text of a string or a list of text parts; 400 for other parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        refuse("content must be a string or a list of input_text parts", param)
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            refuse(
                f"content part type {kind!r} is not supported: this server takes text only "
                "(input_text / output_text)",
                f"{param}[{index}].type",
            )
        text = part.get("text")
        if not isinstance(text, str):
            refuse("a text part needs a string `text`", f"{param}[{index}].text")
        texts.append(text)
    return "\n".join(texts)


def _string(item: dict[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        refuse(f"{item.get('type')} items need a string `{name}`", f"{param}.{name}")
    return value


# -- tools and formats -------------------------------------------------------------------------
def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Return the chat form of Responses function tools; 400 for built-in tools."""
    if tools is None:
        return None
    out = []
    for index, tool in enumerate(tools):
        param = f"tools[{index}]"
        kind = tool.get("type")
        if kind != "function":
            refuse(
                f"tool type {kind!r} is not supported: only function tools are (built-in tools "
                "such as web_search, file_search, code_interpreter or mcp are not)",
                f"{param}.type",
            )
        if not isinstance(tool.get("name"), str):
            refuse(
                'function tools are flat in the Responses API: {"type": "function", "name": '
                '..., "parameters": {...}}',
                f"{param}.name",
            )
        if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
            refuse("a tool's parameters must be a JSON schema object", f"{param}.parameters")
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def echo_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Return the tools as the response object echoes them."""
    return [
        {
            "type": "function",
            "name": tool["name"],
            "description": tool.get("description"),
            "parameters": tool.get("parameters"),
            "strict": tool.get("strict"),
        }
        for tool in tools or []
    ]


def chat_tool_choice(tool_choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Return the chat form of a Responses tool_choice; 400 for the forms not served."""
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return tool_choice
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = tool_choice.get("name")
        if not isinstance(name, str):
            refuse('tool_choice needs {"type": "function", "name": ...}', "tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    kind = tool_choice.get("type") if isinstance(tool_choice, dict) else tool_choice
    refuse(
        f'tool_choice {kind!r} is not supported: use "auto", "none", "required" or '
        '{"type": "function", "name": ...}',
        "tool_choice",
    )


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """Return the chat response_format of `text.format`; 400 for what is not served."""
    text = text or {}
    if text.get("verbosity") is not None:
        refuse("text.verbosity is not supported", "text.verbosity")
    spec = text.get("format")
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        refuse(
            f"text.format type must be text, json_object or json_schema, got {kind!r}",
            "text.format.type",
        )
    if not isinstance(spec.get("name"), str):
        refuse("a json_schema format needs a `name`", "text.format.name")
    if not isinstance(spec.get("schema"), dict):
        refuse("a json_schema format needs a `schema` object", "text.format.schema")
    json_schema = {k: spec[k] for k in ("name", "schema", "strict", "description") if k in spec}
    return {"type": "json_schema", "json_schema": json_schema}
