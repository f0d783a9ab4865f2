"""Structured outputs and tool calling through the official openai client against a live server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.entrypoints.openai.cli_args import ServerConfig
from tests.utils import RunningServer, build_tiny_model, start_server, stop_server

MODEL = "tiny"
HI = [{"role": "user", "content": "What is the weather?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
PARAMS_BY_NAME = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    model_dir = build_tiny_model(
        tmp_path_factory.mktemp("tools_llama"), "llama", max_position_embeddings=2048
    )
    engine = LLMEngine(
        EngineArgs(
            model=str(model_dir),
            dtype="float32",
            kv_cache_memory_bytes=8 << 20,
            served_model_name=MODEL,
        )
    )
    config = ServerConfig(
        host="127.0.0.1", port=0, enable_auto_tool_choice=True, tool_call_parser="hermes"
    )
    running = start_server(engine, config)
    yield running
    stop_server(running)


def _check_calls(calls: list[Any]) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), PARAMS_BY_NAME[call.function.name])


def _reassemble(stream: Any) -> tuple[dict[int, dict[str, str]], str | None, str]:
    """Return {index: {id, name, arguments}}, the finish reason and the content of a stream."""
    calls: dict[int, dict[str, str]] = {}
    finish, content = None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += d.id or ""
            if d.function is not None:
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return calls, finish, content


def test_response_format_and_structured_outputs(server: RunningServer) -> None:
    client = server.client()
    small = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    chat = client.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=400,
        seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": small}},
    )
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content or ""), small)
    extra = {"structured_outputs": {"json": WEATHER, "disable_any_whitespace": True}}
    cmpl = client.completions.create(
        model=MODEL, prompt="Weather:", max_tokens=100, n=3, seed=2, extra_body=extra
    )
    for choice in cmpl.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), WEATHER)
    choice_out = client.completions.create(
        model=MODEL,
        prompt="Pick:",
        max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}},
    )
    assert choice_out.choices[0].text in ("left", "right")
    guided = client.completions.create(  # vLLM's older spelling
        model=MODEL, prompt="Code:", max_tokens=20, extra_body={"guided_regex": "[0-9]{4}"}
    )
    assert guided.choices[0].text.isdigit() and len(guided.choices[0].text) == 4


def test_invalid_constraints_are_400_with_the_parser_message(server: RunningServer) -> None:
    client = server.client()
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError, match="nope"):
        client.chat.completions.create(model=MODEL, messages=HI, response_format=bad_schema)
    with pytest.raises(openai.BadRequestError, match="parenthesis"):
        client.completions.create(
            model=MODEL, prompt="x", extra_body={"structured_outputs": {"regex": "a(b"}}
        )
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(
            model=MODEL,
            messages=HI,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    with pytest.raises(openai.BadRequestError, match="exactly one"):
        client.completions.create(
            model=MODEL,
            prompt="x",
            extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}},
        )
    server.wait_idle()


def test_required_and_named_tool_calls_non_streaming_and_streaming(server: RunningServer) -> None:
    client = server.client()
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice in ("required", named):
        # One call (maxItems 1): a greedy random model would otherwise repeat calls forever.
        kwargs: dict[str, Any] = dict(
            model=MODEL,
            messages=HI,
            tools=TOOLS,
            tool_choice=tool_choice,
            max_tokens=200,
            parallel_tool_calls=False,
        )
        reply = client.chat.completions.create(temperature=0.0, **kwargs)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls or []
        _check_calls(calls)
        if tool_choice == named:
            assert [c.function.name for c in calls] == ["get_weather"]
        # Streaming, greedy: the reassembled deltas are the same calls.
        streamed, finish, content = _reassemble(
            client.chat.completions.create(temperature=0.0, stream=True, **kwargs)
        )
        assert finish == "tool_calls" and content == ""
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == [
            (c.function.name, json.loads(c.function.arguments)) for c in calls
        ]
        assert all(c["id"].startswith("chatcmpl-tool-") for c in streamed.values())
        # Sampled at temperature 1.0 with parallel calls, every call returned matches its schema
        # (when max_tokens cuts the list short, the complete calls so far come back).
        kwargs["parallel_tool_calls"] = True
        for seed in range(3):
            sampled = client.chat.completions.create(temperature=1.0, seed=seed, **kwargs)
            _check_calls(sampled.choices[0].message.tool_calls or [])


def test_parallel_tool_calls_false_gives_one_call(server: RunningServer) -> None:
    client = server.client()
    for seed in range(3):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=HI,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        assert len(reply.choices[0].message.tool_calls or []) == 1


def test_auto_choice_and_tool_messages_in_the_conversation(server: RunningServer) -> None:
    client = server.client()
    conversation: list[Any] = [
        *HI,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "c"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    reply = client.chat.completions.create(
        model=MODEL, messages=conversation, tools=TOOLS, tool_choice="auto", max_tokens=8
    )
    # A random model writes no <tool_call> tags: plain content comes back.
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "length"
    _, finish, content = _reassemble(
        client.chat.completions.create(
            model=MODEL, messages=conversation, tools=TOOLS, max_tokens=8, stream=True
        )
    )
    assert finish == "length" and content
