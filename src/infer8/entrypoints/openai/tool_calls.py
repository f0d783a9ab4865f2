"""Tool calling: validate tools / tool_choice, render them, constrain and parse the model's calls.

`required` and named choices are enforced by a JSON-schema grammar (vLLM's formats: a list of
{"name", "parameters"} for required, the arguments object itself for a named function); `auto`
parses free text with a --tool-call-parser (hermes `<tool_call>` tags or Llama 3 JSON).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from infer8.entrypoints.openai.protocol import (
    APIError,
    DeltaFunctionCall,
    DeltaToolCall,
    ToolCall,
)
from infer8.entrypoints.openai.request_limits import MAX_TOOLS
from infer8.entrypoints.openai.tool_parsers import (
    HERMES_END,
    HERMES_START,
    PARSERS,
    PYTHON_TAG,
    call_id,
    complete_array_items,
    make_call,
    parse_call_objects,
    parse_hermes,
    parse_llama3_json,
    partial_suffix,
)
from infer8.structured_output.params import StructuredOutputsParams


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
    name_to_tool: dict[str, dict[str, Any]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # The first tool of a name wins, as a linear search would find it.
        self.name_to_tool = {}
        for tool in self.tools:
            self.name_to_tool.setdefault(tool["name"], tool)

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
        assert name is not None
        tool = self.name_to_tool[name]
        params = tool.get("parameters")
        return params if isinstance(params, dict) and params else {"type": "object"}

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Return (content, tool calls) of a finished output."""
        if self.mode == "named":
            assert self.named is not None
            return None, [make_call(self.named, text.strip())]
        if self.mode == "required":
            # Every complete element of the array, also when max_tokens cut the array short.
            calls = parse_call_objects(complete_array_items(text, 0)[0])
            return (None, calls) if calls else (text, [])
        content, calls = PARSERS[self.parser](text)
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
                functions = [_with_dict_arguments(c)["function"] for c in calls]
                rendered = "\n".join(
                    "<tool_call>\n"
                    + json.dumps({"name": f.get("name"), "arguments": f.get("arguments")})
                    + "\n</tool_call>"
                    for f in functions
                )
                message["content"] = f"{message.get('content') or ''}{rendered}"
                del message["tool_calls"]
            if message.get("content") is None:  # a call without text: empty content
                message["content"] = ""
        out.append(message)
    return out


def _with_dict_arguments(call: Any) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise APIError(400, "an assistant tool_calls entry needs a function", param="messages")
    function = dict(call["function"])
    if not isinstance(function.get("name"), str):
        raise APIError(400, "an assistant tool call needs a function name", param="messages")
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
    if len(tools) > MAX_TOOLS:  # before any per-tool work (this runs on the event loop)
        raise APIError(
            400,
            f"tools has {len(tools)} entries; the limit is {MAX_TOOLS}",
            param="tools",
            code="too_many_tools",
        )
    functions = tool_functions(tools)
    names = {f["name"] for f in functions}
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
            self._named_id = call_id()
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
        objects, self._sent = complete_array_items(self.text, self._sent)
        return self._emit(parse_call_objects(objects))

    def _auto(self, finished: bool) -> tuple[str | None, list[DeltaToolCall]]:
        rest = self.text[self._sent :]
        if self.ctx.parser == "llama3_json":
            if self._sent == 0 and rest.lstrip().startswith(("{", PYTHON_TAG)):
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
                start = rest.find(HERMES_START)
                if start < 0:
                    keep = 0 if finished else partial_suffix(rest, HERMES_START)
                    chunk = rest[: len(rest) - keep]
                    self._sent += len(chunk)
                    content += "" if self.num_calls else chunk  # text between calls is dropped
                    break
                content += "" if self.num_calls else rest[:start]
                self._sent += start
                self._in_calls = True
                continue
            end = rest.find(HERMES_END)
            if end < 0:
                break
            block = rest[: end + len(HERMES_END)]
            self._sent += len(block)
            self._in_calls = False
            deltas.extend(self._emit(parse_hermes(block)[1]))
        return content or None, deltas
