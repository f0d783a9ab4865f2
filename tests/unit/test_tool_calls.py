"""Tool-call parsing and streaming, response_format mapping and the tool-calling server flags."""

from __future__ import annotations

import json

import pytest

from infer8.entrypoints.openai.cli_args import ServerConfig, make_serve_parser, serve_args_from
from infer8.entrypoints.openai.protocol import APIError, DeltaToolCall
from infer8.entrypoints.openai.structured import constraint_of
from infer8.entrypoints.openai.tool_calls import ToolContext, resolve_tools, template_messages
from infer8.entrypoints.openai.tool_parsers import parse_hermes, parse_llama3_json
from infer8.structured_output.params import StructuredOutputsParams

FUNCS = [
    {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    {"name": "now"},
]
TOOLS = [{"type": "function", "function": f} for f in FUNCS]


def _stream(ctx: ToolContext, text: str, step: int) -> tuple[str, dict[int, dict[str, str]]]:
    """Feed text in pieces of `step` chars; return content and the reassembled calls."""
    streamer = ctx.streamer()
    content, calls = "", {}
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        delta, deltas = streamer.feed(piece, finished=i == len(pieces) - 1)
        content += delta or ""
        for d in deltas:
            assert isinstance(d, DeltaToolCall)
            entry = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += d.id or ""
            if d.function is not None:
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    return content, calls


def test_hermes_parser_and_streaming_agree() -> None:
    text = (
        'Let me check. <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    )
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("add", {"a": 1}),
        ("now", {}),
    ]
    ctx = ToolContext(FUNCS, "auto", parser="hermes")
    for step in (1, 3, 7, len(text)):
        streamed_content, streamed = _stream(ctx, text, step)
        assert streamed_content == "Let me check. "
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == [
            ("add", {"a": 1}),
            ("now", {}),
        ]
        assert all(c["id"].startswith("chatcmpl-tool-") for c in streamed.values())
    # Text that only looks like a tag's start is content once the output ends.
    assert _stream(ctx, "a <tool", 1) == ("a <tool", {})
    assert parse_hermes("no calls <tool_call>{bad json</tool_call>") == (
        "no calls <tool_call>{bad json</tool_call>",
        [],
    )


def test_llama3_json_parser() -> None:
    content, calls = parse_llama3_json(
        '<|python_tag|>{"name": "add", "parameters": {"a": 2}}; {"name": "now", "parameters": {}}'
    )
    assert content is None and [c.function.name for c in calls] == ["add", "now"]
    assert json.loads(calls[0].function.arguments) == {"a": 2}
    assert parse_llama3_json("Just text.") == ("Just text.", [])
    ctx = ToolContext(FUNCS, "auto", parser="llama3_json")
    _, streamed = _stream(ctx, '{"name": "add", "parameters": {"a": 3}}', 4)
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == [
        ("add", {"a": 3})
    ]
    assert _stream(ctx, "Plain answer.", 4) == ("Plain answer.", {})


def test_required_and_named_constraints_and_streams() -> None:
    required = resolve_tools(TOOLS, "required", True, None)
    assert required is not None and required.mode == "required"
    so = required.constraint()
    assert so is not None and so.json["minItems"] == 1 and "maxItems" not in so.json
    one = resolve_tools(TOOLS, "required", False, None)
    assert one is not None and one.constraint().json["maxItems"] == 1  # type: ignore[union-attr]
    text = '[{"name": "add", "parameters": {"a": 5}}, {"name": "now", "parameters": {}}]'
    content, calls = required.extract(text)
    assert content is None and [c.function.name for c in calls] == ["add", "now"]
    _, streamed = _stream(required, text, 5)
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == [
        ("add", {"a": 5}),
        ("now", {}),
    ]
    # Cut short by max_tokens: the complete calls so far.
    assert [c.function.name for c in required.extract(text[:50])[1]] == ["add"]
    named = resolve_tools(TOOLS, {"type": "function", "function": {"name": "add"}}, True, None)
    assert named is not None and named.constraint().json == FUNCS[0]["parameters"]  # type: ignore[union-attr]
    _, streamed = _stream(named, '{"a": 12}', 2)
    assert streamed[0]["name"] == "add" and json.loads(streamed[0]["arguments"]) == {"a": 12}


def test_tool_choice_validation() -> None:
    assert resolve_tools(TOOLS, "none", True, None) is None
    assert resolve_tools(None, None, True, None) is None
    cases = [
        (TOOLS, "auto", None, "enable-auto-tool-choice"),
        (TOOLS, None, None, "enable-auto-tool-choice"),  # the default with tools is auto
        (None, "required", "hermes", "needs tools"),
        ([{"type": "function"}], "required", None, "each tool"),
        (TOOLS, {"type": "function", "function": {"name": "x"}}, None, "not in tools"),
        (TOOLS, "sometimes", None, "tool_choice must be"),
    ]
    for tools, choice, parser, message in cases:
        with pytest.raises(APIError, match=message) as info:
            resolve_tools(tools, choice, True, parser)
        assert info.value.status_code == 400
    assert resolve_tools(TOOLS, "auto", True, "hermes").mode == "auto"  # type: ignore[union-attr]


def test_response_format_mapping() -> None:
    assert constraint_of({"type": "text"}, None) is None
    assert constraint_of({"type": "json_object"}, None) == StructuredOutputsParams(json_object=True)
    schema = {"type": "object"}
    so = constraint_of(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, None
    )
    assert so is not None and so.json == schema
    assert constraint_of(None, {"regex": "[ab]+"}) == StructuredOutputsParams(regex="[ab]+")
    for response_format, extra in (
        ({"type": "json_schema", "json_schema": {"name": "x"}}, None),
        ({"type": "xml"}, None),
        (None, {"regexp": "a"}),
        (None, {"choice": []}),
        ({"type": "json_object"}, {"regex": "a"}),
    ):
        with pytest.raises(APIError):
            constraint_of(response_format, extra)
    # The cache key is canonical: key order in a schema does not matter.
    a = StructuredOutputsParams(json={"type": "object", "required": ["a"]})
    b = StructuredOutputsParams(json='{"required": ["a"], "type": "object"}')
    assert a.key == b.key != StructuredOutputsParams(json={"type": "object"}).key


def test_template_messages_for_templates_without_tool_support() -> None:
    call = {"id": "1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    messages = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    plain = template_messages(messages, "{{ messages }}")
    assert "tool_calls" not in plain[0] and '"arguments": {"a": 1}' in plain[0]["content"]
    aware = template_messages(messages, "{% for c in m.tool_calls %}{% endfor %}")
    assert aware[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert aware[0]["content"] == ""


def test_tool_call_flags() -> None:
    ns = make_serve_parser().parse_args(
        ["m", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    )
    _, config = serve_args_from(ns)
    assert config.enable_auto_tool_choice and config.tool_call_parser == "llama3_json"
    _, default = serve_args_from(make_serve_parser().parse_args(["m"]))
    assert not default.enable_auto_tool_choice and default.tool_call_parser is None
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerConfig(tool_call_parser="mistral")
