"""`/v1/responses` through the official openai client against a live server on a tiny model:
plain, streamed, tools, JSON schema, previous_response_id, retrieve / cancel / delete, the
store's bounds, API-key isolation and the 400s naming each unsupported field."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.entrypoints.openai.cli_args import ServerConfig
from infer8.entrypoints.openai.serving_responses import OpenAIServingResponses
from tests.utils import RunningServer, build_tiny_model, start_server, stop_server

MODEL = "tiny"
KEY_A, KEY_B = "key-a", "key-b"
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}
]
LONG = {"ignore_eos": True}  # a random model may stop at any step; these never stop early


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    model_dir = build_tiny_model(
        tmp_path_factory.mktemp("responses_llama"), "llama", max_position_embeddings=4096
    )
    engine = LLMEngine(
        EngineArgs(
            model=str(model_dir),
            dtype="float32",
            kv_cache_memory_bytes=8 << 20,
            max_model_len=4096,
            served_model_name=MODEL,
        )
    )
    config = ServerConfig(
        host="127.0.0.1",
        port=0,
        api_key=(KEY_A, KEY_B),
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
    )
    running = start_server(engine, config)
    yield running
    stop_server(running)


def _client(server: RunningServer, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def _serving(server: RunningServer) -> OpenAIServingResponses:
    return server.server.config.app.state.responses


def _num_prompt_tokens(server: RunningServer, messages: list[dict[str, Any]]) -> int:
    return len(server.engine.tokenizer.encode_chat(messages, add_generation_prompt=True))


def _post(server: RunningServer, body: dict[str, Any], key: str = KEY_A) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{server.url}/v1/responses", json=body, headers=headers, timeout=60)


# -- create ------------------------------------------------------------------------------------
def test_plain_response_counts_and_shape(server: RunningServer) -> None:
    client = _client(server)
    response = client.responses.create(
        model=MODEL,
        input="Hello there",
        instructions="Answer briefly.",
        max_output_tokens=5,
        temperature=0.0,
        metadata={"run": "1"},
        extra_body=LONG,
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.status == "incomplete"
    assert [part.type for part in item.content] == ["output_text"]
    assert response.output_text == item.content[0].text  # type: ignore[union-attr]
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hello there"},
    ]
    usage = response.usage
    assert usage is not None
    assert usage.input_tokens == _num_prompt_tokens(server, messages)
    assert usage.output_tokens == 5
    assert usage.total_tokens == usage.input_tokens + 5
    assert usage.input_tokens_details.cached_tokens >= 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    # Echoes.
    assert response.instructions == "Answer briefly." and response.metadata == {"run": "1"}
    assert response.temperature == 0.0 and response.max_output_tokens == 5
    assert response.model == MODEL and response.parallel_tool_calls is True
    assert response.tool_choice == "auto" and response.tools == []
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "text"


def test_streamed_events_in_order_and_deltas_make_the_text(server: RunningServer) -> None:
    client = _client(server)
    kwargs: dict[str, Any] = dict(
        model=MODEL, input="Tell me a story", max_output_tokens=12, temperature=0.0
    )
    whole = client.responses.create(extra_body=LONG, **kwargs)
    events = list(client.responses.create(stream=True, extra_body=LONG, **kwargs))
    types = [e.type for e in events]
    num_deltas = types.count("response.output_text.delta")
    assert num_deltas >= 1
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * num_deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # max_output_tokens reached
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, final = events[0].response, events[-1].response  # type: ignore[union-attr]
    assert created.status == "in_progress" and created.output == [] and created.id == final.id
    item_id = events[2].item.id  # type: ignore[union-attr]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert {(e.item_id, e.output_index, e.content_index) for e in deltas} == {(item_id, 0, 0)}
    text = "".join(e.delta for e in deltas)
    assert events[-4].text == text  # type: ignore[union-attr]
    assert events[-3].part.text == text  # type: ignore[union-attr]
    assert final.output_text == text == whole.output_text  # greedy: as the whole response
    assert final.usage is not None and final.usage.output_tokens == 12
    assert final.usage.input_tokens == whole.usage.input_tokens  # type: ignore[union-attr]


def test_function_tool_round_trip(server: RunningServer) -> None:
    client = _client(server)
    first = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0.0,
        max_output_tokens=200,
    )
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert first.tools[0].name == "get_weather"  # echoed in the flat shape
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
        tools=TOOLS,  # tool_choice auto (--enable-auto-tool-choice): this model writes no call
        max_output_tokens=8,
        extra_body=LONG,
    )
    assert [item.type for item in second.output] == ["message"]
    assert second.previous_response_id == first.id
    assert second.usage and first.usage
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its output
    # Named choice, streamed: the arguments arrive as deltas of one function_call item.
    events = list(
        client.responses.create(
            model=MODEL,
            input="Weather?",
            tools=TOOLS,
            tool_choice={"type": "function", "name": "get_weather"},
            temperature=0.0,
            max_output_tokens=200,
            stream=True,
        )
    )
    types = [e.type for e in events]
    num_deltas = types.count("response.function_call_arguments.delta")
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * num_deltas,
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert events[-3].arguments == arguments  # type: ignore[union-attr]
    [final_call] = events[-1].response.output  # type: ignore[union-attr]
    assert final_call.arguments == arguments and final_call.name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER)


def test_json_schema_and_json_object_formats(server: RunningServer) -> None:
    client = _client(server)
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    for stream in (False, True):
        kwargs: dict[str, Any] = dict(
            model=MODEL, input="Weather as JSON", text={"format": fmt}, max_output_tokens=100
        )
        if stream:
            response = list(client.responses.create(stream=True, **kwargs))[-1].response
        else:
            response = client.responses.create(**kwargs)
        assert response.status == "completed"
        jsonschema.validate(json.loads(response.output_text), WEATHER)
        assert response.text.format.type == "json_schema"  # type: ignore[union-attr]
    loose = client.responses.create(
        model=MODEL, input="JSON", text={"format": {"type": "json_object"}}, max_output_tokens=300
    )
    if loose.status == "completed":  # a random model may write one long string
        assert isinstance(json.loads(loose.output_text), dict)


def test_previous_response_id_continues_the_conversation(server: RunningServer) -> None:
    client = _client(server)
    first = client.responses.create(
        model=MODEL,
        input="Hello",
        instructions="Be brief.",
        max_output_tokens=4,
        extra_body=LONG,
    )
    second = client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "And then?"}]}],
        previous_response_id=first.id,
        max_output_tokens=4,
        extra_body=LONG,
    )
    # The instructions are not carried over (as OpenAI does); the first turn is.
    turns = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    assert second.usage is not None
    assert second.usage.input_tokens == _num_prompt_tokens(server, turns)
    third = client.responses.create(
        model=MODEL,
        input="Last one",
        instructions="New rules.",
        previous_response_id=second.id,
        max_output_tokens=4,
        extra_body=LONG,
    )
    turns = [
        {"role": "system", "content": "New rules."},
        *turns,
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Last one"},
    ]
    assert third.usage is not None
    assert third.usage.input_tokens == _num_prompt_tokens(server, turns)


# -- retrieve, cancel, delete ------------------------------------------------------------------
def test_retrieve_cancel_and_delete(server: RunningServer) -> None:
    client = _client(server)
    response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    got = client.responses.retrieve(response.id)
    assert got.model_dump() == response.model_dump()
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.cancel(response.id)  # finished: only one in progress can be
    assert bad.value.body["param"] == "response_id"  # type: ignore[index]
    deleted = httpx.delete(
        f"{server.url}/v1/responses/{response.id}", headers={"Authorization": f"Bearer {KEY_A}"}
    ).json()
    assert deleted == {"id": response.id, "object": "response.deleted", "deleted": True}
    for call in (client.responses.retrieve, client.responses.delete, client.responses.cancel):
        with pytest.raises(openai.NotFoundError, match=response.id):
            call(response.id)
    # store: false is generated but never kept.
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_background_response_polled_and_cancelled(server: RunningServer) -> None:
    client = _client(server)
    done = client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=4, background=True, extra_body=LONG
    )
    assert done.status == "in_progress" and done.background is True
    deadline = time.monotonic() + 30
    while (polled := client.responses.retrieve(done.id)).status == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert polled.status == "incomplete" and polled.usage and polled.usage.output_tokens == 4
    running = client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=3000, background=True, extra_body=LONG
    )
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled"
    assert cancelled.usage is not None and cancelled.usage.output_tokens < 3000
    assert client.responses.retrieve(running.id).status == "cancelled"
    server.wait_idle()  # its blocks are free


def test_cancel_and_disconnect_of_a_streamed_response(server: RunningServer) -> None:
    client = _client(server)
    # Cancelled from another connection: the stream ends with its final event.
    stream = client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=3000, stream=True, extra_body=LONG
    )
    events = []
    for event in stream:
        events.append(event)
        if event.type == "response.output_text.delta" and len(events) == 5:
            client.responses.cancel(events[0].response.id)  # type: ignore[union-attr]
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.status == "cancelled"
    assert events[-2].type == "response.output_item.done"
    assert events[-2].item.status == "incomplete"  # type: ignore[union-attr]
    # A client that leaves mid-stream: its request is aborted, the response kept as cancelled.
    stream = client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=3000, stream=True, extra_body=LONG
    )
    response_id = next(iter(stream)).response.id  # type: ignore[union-attr]
    stream.close()
    server.wait_until(lambda: client.responses.retrieve(response_id).status == "cancelled")
    server.wait_idle()


def test_cancel_of_a_response_in_progress_from_another_thread(server: RunningServer) -> None:
    client = _client(server)
    result: dict[str, Any] = {}
    worker = threading.Thread(
        target=lambda: result.update(
            response=client.responses.create(
                model=MODEL, input="Hi", max_output_tokens=3000, extra_body=LONG
            )
        )
    )
    worker.start()
    serving = _serving(server)
    server.wait_until(lambda: bool(serving.runs))
    [response_id] = list(serving.runs)
    assert client.responses.cancel(response_id).status == "cancelled"
    worker.join(30)
    assert result["response"].status == "cancelled"  # the waiting client gets it too
    server.wait_idle()


# -- the store: bounds and API keys ------------------------------------------------------------
def test_store_bounds_evict_the_oldest(server: RunningServer) -> None:
    client = _client(server)
    store = _serving(server).store
    max_entries = store.max_entries
    store.max_entries = 2
    try:
        ids = [
            client.responses.create(model=MODEL, input=f"Hi {i}", max_output_tokens=2).id
            for i in range(3)
        ]
        assert store.num_entries == 2
        with pytest.raises(openai.NotFoundError, match=ids[0]):
            client.responses.retrieve(ids[0])
        with pytest.raises(openai.NotFoundError) as gone:
            client.responses.create(model=MODEL, input="x", previous_response_id=ids[0])
        assert gone.value.body["param"] == "previous_response_id"  # type: ignore[index]
        assert client.responses.retrieve(ids[2]).id == ids[2]
    finally:
        store.max_entries = max_entries


def test_api_keys_never_see_each_others_responses(server: RunningServer) -> None:
    a, b = _client(server, KEY_A), _client(server, KEY_B)
    response = a.responses.create(model=MODEL, input="secret", max_output_tokens=2)
    for call in (b.responses.retrieve, b.responses.cancel, b.responses.delete):
        with pytest.raises(openai.NotFoundError, match=response.id):
            call(response.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.create(model=MODEL, input="more", previous_response_id=response.id)
    assert a.responses.retrieve(response.id).id == response.id  # still there for its key


# -- what is refused ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type"),
        ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[0].type"),
        ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].name"),
        ({"background": True, "store": False}, "background"),
        ({"background": True, "stream": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ({"include": ["message.output_text.logprobs"]}, "include[0]"),
        ({"input": []}, "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
        ),
        ({"text": {"format": {"type": "json_schema", "schema": WEATHER}}}, "text.format.name"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
            "text.format",
        ),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 5000}, "max_output_tokens"),  # over the context
        ({"truncation": "sometimes"}, "truncation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"max_tool_calls": 2}, "max_tool_calls"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"priority": 5}, "priority"),  # this server schedules fcfs
    ],
)
def test_unsupported_fields_are_400_naming_them(
    server: RunningServer, extra: dict[str, Any], param: str
) -> None:
    reply = _post(server, {"model": MODEL, "input": "Hi", **extra})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param, error


def test_accepted_no_ops_and_404s(server: RunningServer) -> None:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2}
    accepted = _post(
        server,
        {
            **body,
            "truncation": "auto",  # nothing is ever dropped; too long an input is a 400
            "reasoning": {"effort": None},
            "include": ["reasoning.encrypted_content"],  # no reasoning items are produced
            "service_tier": "auto",
        },
    )
    assert accepted.status_code == 200, accepted.text
    assert accepted.json()["truncation"] == "disabled"
    other_model = _post(server, {**body, "model": "gpt-4o"})
    assert other_model.status_code == 404 and other_model.json()["error"]["param"] == "model"
    unknown = _post(server, {**body, "previous_response_id": "resp_nope"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["param"] == "previous_response_id"
    assert "resp_nope" in unknown.json()["error"]["message"]
    server.wait_idle()
