"""One response's output items built from text and tool-call deltas, with the typed events that
stream them in OpenAI's order: an item is added, its text or arguments grow by deltas, and it is
done before the next item is added."""

from __future__ import annotations

import json
from typing import Any

from infer8.entrypoints.openai.protocol import DeltaToolCall
from infer8.entrypoints.openai.responses_protocol import (
    FunctionCallItem,
    ItemStatus,
    OutputItem,
    OutputMessage,
    OutputText,
)

Event = dict[str, Any]


class ResponseEvents:
    """Owns a response's output items, the one item still open, and the events' numbering."""

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self.sequence_number = 0
        self._open: OutputItem | None = None

    def event(self, type_: str, **fields: Any) -> Event:
        """Return the next event of the stream (numbered from 0)."""
        event = {"type": type_, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def text(self, delta: str) -> list[Event]:
        """Return the events adding text to the output (opening a message item if needed)."""
        if not delta:
            return []
        events = self.message()
        message = self._open
        assert isinstance(message, OutputMessage)
        message.content[0].text += delta
        events.append(
            self.event(
                "response.output_text.delta",
                **self._where(message),
                content_index=0,
                delta=delta,
                logprobs=[],
            )
        )
        return events

    def message(self) -> list[Event]:
        """Return the events opening a message item with one empty text part, unless open."""
        if isinstance(self._open, OutputMessage):
            return []
        events = self.close("completed")
        message = OutputMessage()
        events.append(self._add(message))
        part = OutputText(text="")
        message.content.append(part)
        events.append(
            self.event(
                "response.content_part.added",
                **self._where(message),
                content_index=0,
                part=part.model_dump(),
            )
        )
        return events

    def calls(self, deltas: list[DeltaToolCall]) -> list[Event]:
        """Return the events of tool-call deltas (a delta with an id starts a new call)."""
        events: list[Event] = []
        for delta in deltas:
            function = delta.function
            call = self._open
            if delta.id is not None or not isinstance(call, FunctionCallItem):
                events += self.close("completed")
                call = FunctionCallItem(name=(function.name if function else None) or "")
                events.append(self._add(call))
            arguments = function.arguments if function else None
            if arguments:
                call.arguments += arguments
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        **self._where(call),
                        delta=arguments,
                    )
                )
        return events

    def close(self, status: ItemStatus) -> list[Event]:
        """Return the events that finish the open item, if any, with this status."""
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        where = self._where(item)
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events = [
                self.event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=part.text,
                    logprobs=[],
                ),
                self.event(
                    "response.content_part.done", **where, content_index=0, part=part.model_dump()
                ),
            ]
        else:
            events = [
                self.event(
                    "response.function_call_arguments.done", **where, arguments=item.arguments
                )
            ]
        events.append(
            self.event(
                "response.output_item.done",
                output_index=where["output_index"],
                item=item.model_dump(),
            )
        )
        return events

    def _add(self, item: OutputItem) -> Event:
        self.items.append(item)
        self._open = item
        return self.event(
            "response.output_item.added", output_index=len(self.items) - 1, item=item.model_dump()
        )

    def _where(self, item: OutputItem) -> dict[str, Any]:
        assert item is self.items[-1]  # only the newest item is ever open
        return {"item_id": item.id, "output_index": len(self.items) - 1}


def sse_event(event: Event) -> str:
    """Return one server-sent event: its type as the SSE event name, the JSON as data."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
