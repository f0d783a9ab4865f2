"""Tool calling: validate tools / tool_choice, render them, constrain and parse the model's calls.

`required` and named choices are enforced by a JSON-schema grammar (vLLM's formats: a list of
{"name", "parameters"} for required, the arguments object itself for a named function); `auto`
parses free text with a --tool-call-parser (hermes `<tool_call>` tags or Llama 3 JSON).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from infer8.entrypoints.openai.protocol import (
    APIError,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from infer8.structured_output.params import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_HERMES_START = "<tool_call>"
_HERMES_END = "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _make_call(name: str, arguments: Any) -> ToolCall:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=_call_id(), function=FunctionCall(name=name, arguments=args))


def _parse_call_objects(objects: list[Any]) -> list[ToolCall]:
    """Return calls from decoded {"name", "arguments" | "parameters"} objects (others skipped)."""
    calls = []
    for obj in objects:
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            args = obj.get("arguments", obj.get("parameters", {}))
            calls.append(_make_call(obj["name"], args))
    return calls


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """Return (content before the calls, calls) of `<tool_call>{json}</tool_call>` text."""
    objects = []
    for body in _HERMES_CALL.findall(text):
        try:
            objects.append(json.loads(body))
        except ValueError:
            continue
    calls = _parse_call_objects(objects)
    if not calls:
        return text, []
    content = text[: text.find(_HERMES_START)].strip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    """Return (content, calls) of Llama 3 JSON calls: `{"name", "parameters"}` separated by `;`."""
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    objects, pos = [], 0
    try:
        while pos < len(body):
            obj, pos = decoder.raw_decode(body, pos)
            objects.append(obj)
            pos += len(body[pos:]) - len(body[pos:].lstrip().lstrip(";").lstrip())
    except ValueError:
        if not objects:
            return text, []
    calls = _parse_call_objects(objects)
    return (None, calls) if calls else (text, [])


_PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


def _tool_prompt(tools: list[dict[str, Any]], parser: str) -> str:
    """Return a system-prompt section describing the tools (for templates that do not)."""
    listing = "\n".join(json.dumps({"type": "function", "function": t}) for t in tools)
    if parser == "llama3_json":
        return (
            "You have access to the following functions. To call a function, respond with a JSON "
            'object of the form {"name": function name, "parameters": dictionary of argument '
            "name and its value}.\n" + listing
        )
    return (
        "You are a function calling AI model. You may call one or more functions to assist with "
        f"the user query. Here are the available tools: <tools>\n{listing}\n</tools>\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


@dataclass
class ToolContext:
    """One chat request's tools, how they must be used, and how to read the model's calls."""

    tools: list[dict[str, Any]]  # the "function" objects
    mode: str  # "auto", "required" or "named"
    named: str | None = None
    parallel: bool = True
    parser: str = "hermes"

    def constraint(self) -> StructuredOutputsParams | None:
        """Return the grammar that enforces required / named choices (None for auto)."""
        if self.mode == "named":
            return StructuredOutputsParams(
                json=self._parameters(self.named), disable_any_whitespace=True
            )
        if self.mode == "required":
            items = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [t["name"]]},
                        "parameters": self._parameters(t["name"]),
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in self.tools
            ]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        return None

    def _parameters(self, name: str | None) -> dict[str, Any]:
        tool = next(t for t in self.tools if t["name"] == name)
        params = tool.get("parameters")
        return params if isinstance(params, dict) and params else {"type": "object"}

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Return (content, tool calls) of a finished output."""
        if self.mode == "named":
            assert self.named is not None
            return None, [_make_call(self.named, text.strip())]
        if self.mode == "required":
            # Every complete element of the array, also when max_tokens cut the array short.
            calls = _parse_call_objects(_complete_array_items(text, 0)[0])
            return (None, calls) if calls else (text, [])
        content, calls = _PARSERS[self.parser](text)
        if not self.parallel:
            calls = calls[:1]
        return content, calls

    def render(
        self, conversation: list[dict[str, Any]], chat_template: str | None
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Return the conversation and template kwargs that show the model its tools."""
        return render_tools(conversation, chat_template, self.tools, self.parser)

    def streamer(self) -> ToolCallStreamer:
        """Return a per-choice converter of text deltas into content and tool-call deltas."""
        return ToolCallStreamer(self)


def render_tools(
    conversation: list[dict[str, Any]],
    chat_template: str | None,
    functions: list[dict[str, Any]],
    parser: str = "hermes",
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Return the conversation and template kwargs that show the model its tools.

    A template that renders tools gets them as `tools`; for one that does not, a Hermes-style
    (or Llama 3 JSON) tool description is added to the system message.
    """
    if chat_template and "tools" in chat_template:
        return conversation, {"tools": [{"type": "function", "function": f} for f in functions]}
    text = _tool_prompt(functions, parser)
    if conversation and conversation[0].get("role") == "system":
        first = dict(conversation[0])
        first["content"] = f"{first.get('content') or ''}\n\n{text}".strip()
        return [first, *conversation[1:]], {}
    return [{"role": "system", "content": text}, *conversation], {}


def tool_functions(tools: list[Any]) -> list[dict[str, Any]]:
    """Return the function objects of OpenAI tools; APIError 400 if one is malformed."""
    functions = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
        ):
            raise APIError(
                400,
                'each tool must be {"type": "function", "function": {"name": ..., ...}}',
                param="tools",
            )
        if "parameters" in function and not isinstance(function["parameters"], dict):
            raise APIError(400, "a tool's parameters must be a JSON schema object", param="tools")
        functions.append(function)
    return functions


def template_messages(
    conversation: list[dict[str, Any]], chat_template: str | None
) -> list[dict[str, Any]]:
    """Prepare `tool` messages and assistant `tool_calls` for the chat template.

    Templates that know tool calls get arguments as objects (as vLLM passes them); for others
    the calls are written into the assistant's content in Hermes form.
    """
    knows_calls = bool(chat_template) and "tool_calls" in (chat_template or "")
    out = []
    for message in conversation:
        message = dict(message)
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and calls:
            if knows_calls:
                message["tool_calls"] = [_with_dict_arguments(c) for c in calls]
            else:
                rendered = "\n".join(
                    "<tool_call>\n"
                    + json.dumps(
                        {
                            "name": c["function"]["name"],
                            "arguments": _with_dict_arguments(c)["function"]["arguments"],
                        }
                    )
                    + "\n</tool_call>"
                    for c in calls
                )
                message["content"] = f"{message.get('content') or ''}{rendered}"
                del message["tool_calls"]
        if message.get("content") is None:
            message["content"] = ""
        out.append(message)
    return out


def _with_dict_arguments(call: Any) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise APIError(400, "an assistant tool_calls entry needs a function", param="messages")
    function = dict(call["function"])
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            function["arguments"] = json.loads(args)
        except ValueError:
            pass
    return {**call, "function": function}


def resolve_tools(
    tools: list[Any] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    auto_parser: str | None,
) -> ToolContext | None:
    """Validate tools and tool_choice; return how this request uses tools (None: it does not)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    functions = tool_functions(tools)
    names = [f["name"] for f in functions]
    parallel = parallel_tool_calls is not False
    parser = auto_parser or "hermes"
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None
    if choice == "auto":
        if auto_parser is None:
            raise APIError(
                400,
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
                param="tool_choice",
            )
        return ToolContext(functions, "auto", None, parallel, parser)
    if choice == "required":
        return ToolContext(functions, "required", None, parallel, parser)
    named = None
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        named = choice["function"].get("name")
    if not isinstance(named, str) or choice.get("type") != "function":
        raise APIError(
            400,
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if named not in names:
        raise APIError(
            400, f"tool_choice names {named!r}, which is not in tools", param="tool_choice"
        )
    return ToolContext(functions, "named", named, parallel, parser)


@dataclass
class ToolCallStreamer:
    """Turns one choice's text deltas into content deltas and OpenAI tool-call deltas."""

    ctx: ToolContext
    text: str = ""
    num_calls: int = 0
    _sent: int = 0  # chars of text already consumed (content sent, or calls emitted)
    _in_calls: bool = False
    _named_id: str | None = None

    def feed(self, delta: str, finished: bool) -> tuple[str | None, list[DeltaToolCall]]:
        """Return (content delta or None, tool-call deltas) for newly generated text."""
        self.text += delta
        if self.ctx.mode == "named":
            return None, self._named(delta)
        if self.ctx.mode == "required":
            return None, self._complete_calls(finished)
        return self._auto(finished)

    def _named(self, delta: str) -> list[DeltaToolCall]:
        if self._named_id is None:
            self._named_id = _call_id()
            self.num_calls = 1
            return [
                DeltaToolCall(
                    index=0,
                    id=self._named_id,
                    type="function",
                    function=DeltaFunctionCall(name=self.ctx.named, arguments=delta),
                )
            ]
        return (
            [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))] if delta else []
        )

    def _emit(self, calls: list[ToolCall]) -> list[DeltaToolCall]:
        out = []
        for call in calls:
            if not self.ctx.parallel and self.num_calls >= 1:
                break
            out.append(
                DeltaToolCall(
                    index=self.num_calls,
                    id=call.id,
                    type="function",
                    function=DeltaFunctionCall(
                        name=call.function.name, arguments=call.function.arguments
                    ),
                )
            )
            self.num_calls += 1
        return out

    def _complete_calls(self, finished: bool) -> list[DeltaToolCall]:
        """Emit each element of the JSON array of calls once it is complete."""
        objects, self._sent = _complete_array_items(self.text, self._sent)
        return self._emit(_parse_call_objects(objects))

    def _auto(self, finished: bool) -> tuple[str | None, list[DeltaToolCall]]:
        rest = self.text[self._sent :]
        if self.ctx.parser == "llama3_json":
            if self._sent == 0 and rest.lstrip().startswith(("{", _PYTHON_TAG)):
                self._in_calls = True
            if not self._in_calls:
                self._sent = len(self.text)
                return rest or None, []
            if not finished:
                return None, []
            self._sent = len(self.text)
            content, calls = parse_llama3_json(rest)
            return (content, []) if not calls else (None, self._emit(calls))
        # hermes: content until the first "<tool_call>", then one call per closed tag pair
        content, deltas = "", []
        while True:
            rest = self.text[self._sent :]
            if not self._in_calls:
                start = rest.find(_HERMES_START)
                if start < 0:
                    keep = 0 if finished else _partial_suffix(rest, _HERMES_START)
                    chunk = rest[: len(rest) - keep]
                    self._sent += len(chunk)
                    content += "" if self.num_calls else chunk  # text between calls is dropped
                    break
                content += "" if self.num_calls else rest[:start]
                self._sent += start
                self._in_calls = True
                continue
            end = rest.find(_HERMES_END)
            if end < 0:
                break
            block = rest[: end + len(_HERMES_END)]
            self._sent += len(block)
            self._in_calls = False
            deltas.extend(self._emit(parse_hermes(block)[1]))
        return content or None, deltas


def _partial_suffix(text: str, tag: str) -> int:
    """Return the length of text's longest suffix that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _complete_array_items(text: str, start: int) -> tuple[list[Any], int]:
    """Return the top-level elements of a JSON array completed after start, and the new offset."""
    items: list[Any] = []
    depth, in_string, escaped, item_start = 0, False, False, None
    pos = 0
    for pos, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth == 2 and ch == "{":
                item_start = pos
        elif ch in "]}":
            if depth == 2 and ch == "}" and item_start is not None and pos >= start:
                try:
                    items.append(json.loads(text[item_start : pos + 1]))
                except ValueError:
                    pass
                start = pos + 1
            depth -= 1
    return items, start
