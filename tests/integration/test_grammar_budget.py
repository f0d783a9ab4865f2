"""Grammars and tools are bounded before they cost: size limits answered 400 before any
compile, a compile past its time limit killed, the compiled-grammar cache bounded by bytes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.entrypoints.openai.cli_args import ServerConfig
from infer8.entrypoints.openai.protocol import APIError
from infer8.entrypoints.openai.tool_calls import ToolContext, resolve_tools
from infer8.structured_output.compile_pool import GrammarTimeoutError
from infer8.structured_output.manager import StructuredOutputManager
from infer8.structured_output.params import GrammarTooLargeError, StructuredOutputsParams
from infer8.tokenizer import Tokenizer
from tests.utils import RunningServer, build_tiny_model, start_server, stop_server

MODEL = "tiny"
HI = [{"role": "user", "content": "hi"}]
# 40 counted repetitions of any character: 400 characters that take ~5 s to compile even on
# a 300-token vocabulary (size limits cannot see this cost; the time limit does).
COSTLY_REGEX = "".join(f".{{0,{1000 + i}}}{chr(97 + i % 26)}" for i in range(40))
COMPILE_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    model_dir = build_tiny_model(tmp_path_factory.mktemp("grammar_budget"), "llama")
    engine = LLMEngine(
        EngineArgs(
            model=str(model_dir),
            dtype="float32",
            kv_cache_memory_bytes=8 << 20,
            served_model_name=MODEL,
        )
    )
    engine.structured_output.compile_timeout_s = COMPILE_TIMEOUT_S
    running = start_server(engine, ServerConfig(host="127.0.0.1", port=0))
    yield running
    stop_server(running)
    engine.structured_output.close()


def _tools(num_tools: int, num_props: int | None = None) -> list[dict[str, Any]]:
    function: dict[str, Any] = {}
    if num_props is not None:
        properties = {
            f"p{j}": {"type": "string", "description": "x" * 200} for j in range(num_props)
        }
        function["parameters"] = {"type": "object", "properties": properties}
    return [
        {"type": "function", "function": {"name": f"f{i}", **function}} for i in range(num_tools)
    ]


# The findings' sizes where the body guards let them through: each compiled for 20-140 s
# (and 10,000 tools blocked the event loop for seconds) before an answer without these limits.
OVER_LIMITS = {
    "guided_regex": ({"guided_regex": "|".join(f"w{i}" for i in range(100_000))}, "chat"),
    "guided_choice": ({"guided_choice": [f"c{i}" for i in range(60_000)]}, "chat"),
    "guided_grammar": ({"guided_grammar": 'root ::= "a"' + ' | "b"' * 20_000}, "chat"),
    "structured_outputs": ({"structured_outputs": {"regex": "a" * 70_000}}, "completions"),
    "response_format": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "big",
                    "schema": _tools(1, 1400)[0]["function"]["parameters"],
                },
            }
        },
        "chat",
    ),
    "tools": ({"tools": _tools(10_000), "tool_choice": "required"}, "chat"),
    "tools (schemas)": ({"tools": _tools(128, 12), "tool_choice": "required"}, "chat"),
}


@pytest.mark.parametrize("name", list(OVER_LIMITS))
def test_each_limit_is_a_fast_400_naming_its_param(server: RunningServer, name: str) -> None:
    extra, endpoint = OVER_LIMITS[name]
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, **extra}
    if endpoint == "chat":
        body["messages"] = HI
    else:
        body["prompt"] = "hi"
    num_compiles = server.engine.structured_output.stats.num_compiles
    t0 = time.monotonic()
    response = httpx.post(
        f"{server.url}/v1/{endpoint.replace('chat', 'chat/completions')}", json=body, timeout=60
    )
    elapsed_s = time.monotonic() - t0
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == name.split(" ")[0] and error["type"] == "invalid_request_error"
    assert "limit" in error["message"]
    assert elapsed_s < 2.0  # refused before any compile
    assert server.engine.structured_output.stats.num_compiles == num_compiles


def test_a_compile_past_its_time_limit_is_a_400_and_frees_the_compiler(
    server: RunningServer,
) -> None:
    url = f"{server.url}/v1/chat/completions"
    small = {"model": MODEL, "messages": HI, "max_tokens": 2, "guided_choice": ["yes", "no"]}
    assert httpx.post(url, json=small, timeout=120).status_code == 200  # the process is up
    t0 = time.monotonic()
    costly = {"model": MODEL, "messages": HI, "max_tokens": 2, "guided_regex": COSTLY_REGEX}
    response = httpx.post(url, json=costly, timeout=60)
    elapsed_s = time.monotonic() - t0
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "guided_regex" and error["code"] == "grammar_too_costly"
    assert COMPILE_TIMEOUT_S <= elapsed_s < COMPILE_TIMEOUT_S + 2
    # Refused again at once (the verdict is cached); other grammars compile in a new process.
    t0 = time.monotonic()
    assert httpx.post(url, json=costly, timeout=60).status_code == 400
    assert time.monotonic() - t0 < 0.5
    other = {**small, "guided_choice": ["left", "right"]}
    assert httpx.post(url, json=other, timeout=120).status_code == 200
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200


def test_tools_are_looked_up_by_name_in_constant_time() -> None:
    # Past resolve_tools' limit on purpose: a linear search per tool took seconds here.
    functions = [t["function"] for t in _tools(10_000)]
    t0 = time.monotonic()
    with pytest.raises(GrammarTooLargeError):  # after every tool's lookup
        ToolContext(functions, "required").constraint()
    named = ToolContext(functions, "named", named="f9999").constraint()
    assert time.monotonic() - t0 < 2.0  # 10,000 linear searches: 2.4-9 s
    assert named is not None and named.json == {"type": "object"}
    with pytest.raises(APIError) as refused:
        resolve_tools(
            [{"type": "function", "function": f} for f in functions], "required", None, None
        )
    assert refused.value.info.param == "tools" and "128" in refused.value.info.message


def _tiny_tokenizer(tmp_path: Path) -> Tokenizer:
    from tests.utils import build_tokenizer

    build_tokenizer(tmp_path, vocab_size=300)
    return Tokenizer.from_dir(tmp_path)


def test_the_grammar_cache_evicts_by_bytes(tmp_path: Path) -> None:
    tok = _tiny_tokenizer(tmp_path)
    probe = StructuredOutputManager(tok, 512, compile_timeout_s=None)
    regexes = [f"[a-z]{{{i}}}[0-9]{{1,{i + 1}}}" for i in range(1, 9)]
    sizes = [probe.cache_bytes]
    for regex in regexes:
        probe.compile(StructuredOutputsParams(regex=regex))
        sizes.append(probe.cache_bytes)
    per_grammar = max(b - a for a, b in zip(sizes, sizes[1:]))
    max_bytes = 3 * per_grammar
    manager = StructuredOutputManager(
        tok, 512, max_cached=1024, max_cache_bytes=max_bytes, compile_timeout_s=None
    )
    for regex in regexes:
        manager.compile(StructuredOutputsParams(regex=regex))
        assert manager.cache_bytes <= max_bytes
    assert 0 < len(manager._cache) <= 3  # the count limit (1,024) never came into play
    num_compiles = manager.stats.num_compiles
    manager.compile(StructuredOutputsParams(regex=regexes[-1]))  # recent: still cached
    assert manager.stats.num_compiles == num_compiles
    manager.compile(StructuredOutputsParams(regex=regexes[0]))  # evicted: compiled again
    assert manager.stats.num_compiles == num_compiles + 1


def test_a_costly_compile_is_killed_in_its_process(tmp_path: Path) -> None:
    manager = StructuredOutputManager(_tiny_tokenizer(tmp_path), 512, compile_timeout_s=0.5)
    try:
        manager.compile(StructuredOutputsParams(regex="[a-z]+"))  # starts the process
        t0 = time.monotonic()
        with pytest.raises(GrammarTimeoutError, match="0.5 s"):
            manager.compile(StructuredOutputsParams(regex=COSTLY_REGEX))
        assert time.monotonic() - t0 < 2.0
        assert manager.stats.num_timeouts == 1
        with pytest.raises(ValueError, match="invalid regex"):
            manager.compile(StructuredOutputsParams(regex="("))
        assert manager.compile(StructuredOutputsParams(regex="[0-9]+")) is not None
    finally:
        manager.close()
