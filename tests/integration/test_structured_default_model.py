"""Structured outputs on the default model through the server, sampled at temperature 1.0.

What a user of the official openai client relies on: with enough max_tokens every schema-bound
output parses and validates, a cut one says finish_reason "length", and tool_choice="required"
yields valid calls, streamed too.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.entrypoints.openai.cli_args import ServerConfig
from infer8.models.default_model import pull_default_model
from tests.utils import RunningServer, start_server, stop_server

pytestmark = pytest.mark.real_model

MODEL = "smollm2"
REPORT = {  # bounded strings, integers and arrays: a bounded output (whitespace runs are too)
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "temperature_c": {"type": "integer", "minimum": -30, "maximum": 45},
        "sky": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 1,
            "maxItems": 2,
        },
    },
    "required": ["city", "temperature_c", "sky", "tags"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Give today's weather report for a city you like, as JSON."}]
RESPONSE_FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "report", "schema": REPORT}}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER,
        },
    }
]
# Far above what the bounded grammars above can produce: no output can be cut.
ENOUGH_TOKENS = 1000


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    engine = LLMEngine(
        EngineArgs(
            model=str(pull_default_model(progress=False)),
            kv_cache_memory_bytes=128 << 20,
            served_model_name=MODEL,
        )
    )
    running = start_server(engine, ServerConfig(host="127.0.0.1", port=0))
    yield running
    stop_server(running)


def _stream(client: openai.OpenAI, **kwargs: Any) -> tuple[str, list[dict[str, str]], str | None]:
    """Return the content, the reassembled tool calls and the finish reason of a stream."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
            if d.function is not None:
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, list(calls.values()), finish


def test_json_schema_at_temperature_1_always_parses_and_validates(server: RunningServer) -> None:
    client = server.client()

    def ask(seed: int) -> Any:
        return client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            temperature=1.0,
            seed=seed,
            max_tokens=ENOUGH_TOKENS,
            response_format=RESPONSE_FORMAT,
        ).choices[0]

    with ThreadPoolExecutor(20) as pool:
        choices = list(pool.map(ask, range(20)))
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), REPORT)


def test_a_constrained_output_cut_by_max_tokens_says_length(server: RunningServer) -> None:
    client = server.client()
    kwargs: dict[str, Any] = dict(
        messages=ASK, temperature=1.0, seed=0, max_tokens=6, response_format=RESPONSE_FORMAT
    )
    choice = client.chat.completions.create(model=MODEL, **kwargs).choices[0]
    content, _, finish = _stream(client, **kwargs)
    for text, reason in ((choice.message.content or "", choice.finish_reason), (content, finish)):
        assert reason == "length" and text
        with pytest.raises(ValueError):
            json.loads(text)


def test_tool_choice_required_yields_valid_calls_plain_and_streamed(
    server: RunningServer,
) -> None:
    client = server.client()
    ask = [{"role": "user", "content": "What's the weather in Oslo?"}]
    base: dict[str, Any] = dict(messages=ask, tools=TOOLS, tool_choice="required", temperature=1.0)

    def plain(kwargs: dict[str, Any]) -> tuple[list[tuple[str, str]], str | None]:
        choice = client.chat.completions.create(model=MODEL, **kwargs).choices[0]
        assert choice.message.content is None
        calls = choice.message.tool_calls or []
        return [(c.function.name, c.function.arguments) for c in calls], choice.finish_reason

    def streamed(kwargs: dict[str, Any]) -> tuple[list[tuple[str, str]], str | None]:
        content, calls, finish = _stream(client, **kwargs)
        assert content == ""
        return [(c["name"], c["arguments"]) for c in calls], finish

    # One call: the list is closed after it, and the request ends by itself.
    one = [
        dict(base, seed=seed, max_tokens=ENOUGH_TOKENS, parallel_tool_calls=False)
        for seed in range(4)
    ]
    # Parallel calls (the default) leave the list open, as in vLLM: the small model often repeats
    # its call until max_tokens; the complete calls so far come back, each valid.
    many = [dict(base, seed=seed, max_tokens=60) for seed in range(2)]
    jobs = [(f, kw) for kw in one + many for f in (plain, streamed)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: job[0](job[1]), jobs))
    for (_, kwargs), (calls, finish) in zip(jobs, results):
        if kwargs.get("parallel_tool_calls") is False:
            assert finish == "tool_calls" and len(calls) == 1
        else:
            assert finish in ("tool_calls", "length") and calls
        for name, arguments in calls:
            assert name == "get_weather"
            jsonschema.validate(json.loads(arguments), WEATHER)
