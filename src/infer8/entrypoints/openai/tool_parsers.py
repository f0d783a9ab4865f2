"""Tool-call parsers: Hermes `<tool_call>` tags, Llama 3 JSON, and JSON-array scanning."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from infer8.entrypoints.openai.protocol import FunctionCall, ToolCall

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def make_call(name: str, arguments: Any) -> ToolCall:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=call_id(), function=FunctionCall(name=name, arguments=args))


def parse_call_objects(objects: list[Any]) -> list[ToolCall]:
    """Return calls from decoded {"name", "arguments" | "parameters"} objects (others skipped)."""
    calls = []
    for obj in objects:
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            args = obj.get("arguments", obj.get("parameters", {}))
            calls.append(make_call(obj["name"], args))
    return calls


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """Return (content before the calls, calls) of `<tool_call>{json}</tool_call>` text."""
    objects = []
    for body in HERMES_CALL.findall(text):
        try:
            objects.append(json.loads(body))
        except ValueError:
            continue
    calls = parse_call_objects(objects)
    if not calls:
        return text, []
    content = text[: text.find(HERMES_START)].strip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    """Return (content, calls) of Llama 3 JSON calls: `{"name", "parameters"}` separated by `;`."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
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
    calls = parse_call_objects(objects)
    return (None, calls) if calls else (text, [])


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


def partial_suffix(text: str, tag: str) -> int:
    """Return the length of text's longest suffix that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def complete_array_items(text: str, start: int) -> tuple[list[Any], int]:
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
