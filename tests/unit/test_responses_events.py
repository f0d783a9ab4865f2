"""Responses output items and their events built from deltas, and input items -> chat messages."""

from __future__ import annotations

from infer8.entrypoints.openai.protocol import DeltaFunctionCall, DeltaToolCall
from infer8.entrypoints.openai.responses_events import ResponseEvents, sse_event
from infer8.entrypoints.openai.responses_input import input_messages


def _call(index: int, name: str | None, arguments: str, with_id: bool) -> DeltaToolCall:
    return DeltaToolCall(
        index=index,
        id=f"chatcmpl-tool-{index}" if with_id else None,
        function=DeltaFunctionCall(name=name, arguments=arguments),
    )


def test_text_then_calls_close_each_item_before_the_next() -> None:
    builder = ResponseEvents()
    events = [
        *builder.text("Let me "),
        *builder.text("check."),
        *builder.calls([_call(0, "get_weather", '{"city": ', True)]),
        *builder.calls([_call(0, None, '"Paris"}', False)]),
        *builder.calls([_call(1, "get_time", "{}", True)]),
        *builder.close("completed"),
    ]
    assert [(e["type"], e.get("output_index")) for e in events] == [
        ("response.output_item.added", 0),
        ("response.content_part.added", 0),
        ("response.output_text.delta", 0),
        ("response.output_text.delta", 0),
        ("response.output_text.done", 0),
        ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.done", 1),
        ("response.output_item.done", 1),
        ("response.output_item.added", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.done", 2),
        ("response.output_item.done", 2),
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    message, weather, time = (item.model_dump() for item in builder.items)
    assert message["content"][0]["text"] == "Let me check." and message["status"] == "completed"
    assert weather["arguments"] == '{"city": "Paris"}' and weather["name"] == "get_weather"
    assert weather["call_id"].startswith("call_") and weather["id"].startswith("fc_")
    assert time["name"] == "get_time"
    assert events[4]["text"] == "Let me check."
    assert events[10]["arguments"] == weather["arguments"]
    assert sse_event(events[0]).startswith("event: response.output_item.added\ndata: {")


def test_an_answer_cut_short_leaves_its_item_incomplete() -> None:
    builder = ResponseEvents()
    assert builder.text("") == [] and builder.close("incomplete") == []  # nothing open
    builder.text("partial")
    done = builder.close("incomplete")
    assert done[-1]["item"]["status"] == "incomplete"
    assert builder.message()[0]["output_index"] == 1  # a new message item, if asked for


def test_output_items_become_the_chat_turns_they_continue() -> None:
    builder = ResponseEvents()
    builder.text("Checking.")
    builder.calls([_call(0, "get_weather", "{}", True), _call(1, "get_time", "{}", True)])
    builder.close("completed")
    items = [item.model_dump() for item in builder.items]
    [assistant] = input_messages(items)  # one assistant turn: its text and both calls
    assert assistant["role"] == "assistant" and assistant["content"] == "Checking."
    assert [c["function"]["name"] for c in assistant["tool_calls"]] == ["get_weather", "get_time"]
    call_id = items[1]["call_id"]
    output = {"type": "function_call_output", "call_id": call_id, "output": "sunny"}
    developer = {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]}
    assert input_messages([developer, output]) == [
        {"role": "system", "content": "Be brief."},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
    ]
