"""The OpenAI-compatible server as clients see it: the openai package, raw HTTP, /metrics."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.entrypoints.openai.cli_args import ServerConfig
from tests.utils import RunningServer, build_tiny_model, start_server, stop_server, wait_healthy

API_KEY = "test-key"
MODEL = "tiny-llama"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_BODY_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def long_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Long context, so a request can run long enough to be disconnected mid-way.
    return build_tiny_model(
        tmp_path_factory.mktemp("long_llama"), "llama", max_position_embeddings=4096
    )


def _engine(model_dir: Path, **kwargs: Any) -> LLMEngine:
    args = dict(
        model=str(model_dir),
        dtype="float32",
        kv_cache_memory_bytes=8 << 20,
        max_model_len=4096,
        served_model_name=MODEL,
    )
    args.update(kwargs)
    return LLMEngine(EngineArgs(**args))


@pytest.fixture(scope="module")
def server(long_llama_dir: Path) -> Iterator[RunningServer]:
    config = ServerConfig(
        host="127.0.0.1", port=0, api_key=API_KEY, max_request_body_bytes=MAX_BODY_BYTES
    )
    running = start_server(_engine(long_llama_dir, max_num_seqs=32), config)
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def small_server(long_llama_dir: Path) -> Iterator[RunningServer]:
    """One seat and room for one waiting request: overload is easy to reach."""
    config = ServerConfig(host="127.0.0.1", port=0, api_key=API_KEY, max_waiting_requests=1)
    running = start_server(_engine(long_llama_dir, max_num_seqs=1), config)
    yield running
    stop_server(running)


# -- happy paths -------------------------------------------------------------------------------
def test_models_health_version_tokenize(server: RunningServer) -> None:
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}, headers=AUTH).json()
    assert tok["tokens"] == server.engine.tokenizer.encode("Hello world")
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 4096
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}, headers=AUTH)
    assert detok.json()["prompt"] == "Hello world"
    messages = [{"role": "user", "content": "Hi"}]
    chat_tok = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, headers=AUTH)
    assert chat_tok.json()["tokens"] == server.engine.tokenizer.encode_chat(messages)


def test_completion_streamed_equals_non_streamed_with_usage(server: RunningServer) -> None:
    client = server.client()
    prompt = "The quick brown fox"
    kwargs: dict[str, Any] = dict(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True}
    )
    full = client.completions.create(**kwargs)
    num_prompt_tokens = len(server.engine.tokenizer.encode(prompt))
    assert full.usage is not None
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (num_prompt_tokens, 12)
    assert full.usage.total_tokens == num_prompt_tokens + 12
    assert full.choices[0].finish_reason == "length" and full.choices[0].text

    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_chat_streamed_equals_non_streamed_with_usage(server: RunningServer) -> None:
    client = server.client()
    messages = [{"role": "user", "content": "Paris is the capital of"}]
    kwargs: dict[str, Any] = dict(
        model=MODEL, messages=messages, max_completion_tokens=10, temperature=0.0, seed=1
    )
    full = client.chat.completions.create(**kwargs)
    num_prompt_tokens = len(server.engine.tokenizer.encode_chat(messages))
    assert full.usage is not None and full.usage.prompt_tokens == num_prompt_tokens
    message = full.choices[0].message
    assert message.role == "assistant"
    num_tokens = full.usage.completion_tokens
    assert 1 <= num_tokens <= 10
    assert full.choices[0].finish_reason == ("length" if num_tokens == 10 else "stop")

    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    assert chunks[-1].usage == full.usage


def test_stop_string_cuts_text_streamed_and_not(server: RunningServer) -> None:
    client = server.client()
    base = dict(model=MODEL, prompt="one two three", temperature=0.0, max_tokens=24)
    text = client.completions.create(**base, extra_body={"ignore_eos": True}).choices[0].text
    assert len(text) > 6
    stop = text[4:6]
    expected = text[: text.index(stop)]
    cut = client.completions.create(**base, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == expected
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        **base, stop=[stop], stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_n_choices_with_seed_are_reproducible(server: RunningServer) -> None:
    client = server.client()
    kwargs: dict[str, Any] = dict(
        model=MODEL, prompt="Hello", n=3, max_tokens=8, temperature=1.0, seed=7
    )
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1  # seed + i per choice, not one seed for all
    assert first.usage is not None and first.usage.prompt_tokens == len(
        server.engine.tokenizer.encode("Hello")
    )


def test_logprobs_streamed_equal_non_streamed(server: RunningServer) -> None:
    client = server.client()
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kwargs)
    content = full.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0.0
        # greedy: the sampled token is the most likely one
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    chunks = client.chat.completions.create(stream=True, **kwargs)
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    # Equal up to float rounding: the second request reuses the first's cached prompt blocks,
    # so its logits come from a differently shaped (suffix-only) computation.
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)

    completion = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=5, temperature=0.0, logprobs=2
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and len(logprobs.tokens) == completion.usage.completion_tokens
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert logprobs.text_offset[0] == 0


def test_32_concurrent_requests_share_steps(server: RunningServer) -> None:
    batch_sizes: list[int] = []
    server.engine.stat_loggers.append(lambda stats: batch_sizes.append(stats.num_running))

    async def run_all() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        calls = []
        for i in range(32):
            if i % 2:
                calls.append(
                    client.completions.create(
                        model=MODEL,
                        prompt=f"Hello {i}",
                        max_tokens=32,
                        temperature=0.0,
                        extra_body={"ignore_eos": True},
                    )
                )
            else:
                calls.append(
                    client.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": f"Hi {i}"}],
                        max_tokens=32,
                        temperature=0.0,
                        extra_body={"ignore_eos": True},
                    )
                )
        try:
            return await asyncio.gather(*calls)
        finally:
            await client.close()

    try:
        results = asyncio.run(run_all())
    finally:
        server.engine.stat_loggers.clear()
    assert len(results) == 32
    assert all(r.usage.completion_tokens == 32 for r in results)
    assert all(r.choices[0].finish_reason == "length" for r in results)
    assert max(batch_sizes) >= 8  # requests really ran together
    server.wait_idle()


# -- bad input ---------------------------------------------------------------------------------
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]
BAD_REQUESTS: list[tuple[str, str, Any, dict[str, str], int, str | None]] = [
    # (id, path, body (dict -> JSON, bytes -> raw), extra headers, status, error code)
    ("invalid-json", CMPL, b'{"prompt": "hi",', {}, 400, None),
    ("nan", CMPL, b'{"prompt": "hi", "temperature": NaN}', {}, 400, None),
    ("not-an-object", CMPL, [], {}, 400, None),
    ("missing-prompt", CMPL, {"max_tokens": 3}, {}, 400, None),
    ("missing-messages", CHAT, {"model": MODEL}, {}, 400, None),
    ("empty-messages", CHAT, {"messages": []}, {}, 400, None),
    ("string-max-tokens", CMPL, {"prompt": "hi", "max_tokens": "8"}, {}, 400, None),
    ("string-temperature", CMPL, {"prompt": "hi", "temperature": "hot"}, {}, 400, None),
    ("negative-temperature", CMPL, {"prompt": "hi", "temperature": -1.0}, {}, 400, None),
    ("top-p-zero", CMPL, {"prompt": "hi", "top_p": 0.0}, {}, 400, None),
    ("top-p-above-one", CHAT, {"messages": HI, "top_p": 1.5}, {}, 400, None),
    ("top-k-negative", CMPL, {"prompt": "hi", "top_k": -5}, {}, 400, None),
    ("min-p-above-one", CMPL, {"prompt": "hi", "min_p": 2.0}, {}, 400, None),
    ("presence-penalty", CMPL, {"prompt": "hi", "presence_penalty": 5.0}, {}, 400, None),
    ("repetition-penalty", CMPL, {"prompt": "hi", "repetition_penalty": 0.0}, {}, 400, None),
    ("n-zero", CMPL, {"prompt": "hi", "n": 0}, {}, 400, None),
    ("n-huge", CMPL, {"prompt": "hi", "n": 100000}, {}, 400, None),
    ("fan-out-too-large", CMPL, {"prompt": ["a"] * 20, "n": 100}, {}, 400, None),
    ("max-tokens-zero", CMPL, {"prompt": "hi", "max_tokens": 0}, {}, 400, None),
    ("max-tokens-negative", CHAT, {"messages": HI, "max_tokens": -1}, {}, 400, None),
    (
        "min-tokens-above-max",
        CMPL,
        {"prompt": "hi", "max_tokens": 2, "min_tokens": 5},
        {},
        400,
        None,
    ),
    ("logprobs-too-many", CMPL, {"prompt": "hi", "logprobs": 50}, {}, 400, None),
    (
        "top-logprobs-too-many",
        CHAT,
        {"messages": HI, "logprobs": True, "top_logprobs": 30},
        {},
        400,
        None,
    ),
    ("top-logprobs-without-logprobs", CHAT, {"messages": HI, "top_logprobs": 2}, {}, 400, None),
    ("seed-beyond-int64", CMPL, {"prompt": "hi", "seed": 2**70}, {}, 400, None),
    ("stop-token-out-of-vocab", CMPL, {"prompt": "hi", "stop_token_ids": [10**9]}, {}, 400, None),
    ("prompt-ids-out-of-vocab", CMPL, {"prompt": [1, 99999]}, {}, 400, None),
    ("empty-prompt", CMPL, {"prompt": ""}, {}, 400, None),
    ("empty-prompt-list", CMPL, {"prompt": []}, {}, 400, None),
    (
        "prompt-plus-max-tokens-too-long",
        CMPL,
        {"prompt": "hi", "max_tokens": 5000},
        {},
        400,
        "context_length_exceeded",
    ),
    (
        "prompt-too-long",
        CMPL,
        {"prompt": [5] * 4096, "max_tokens": 1},
        {},
        400,
        "context_length_exceeded",
    ),
    (
        "chat-too-long",
        CHAT,
        {"messages": HI, "max_completion_tokens": 4090},
        {},
        400,
        "context_length_exceeded",
    ),
    ("stream-options-without-stream", CMPL, {"prompt": "hi", "stream_options": {}}, {}, 400, None),
    ("logit-bias", CMPL, {"prompt": "hi", "logit_bias": {"5": 1.0}}, {}, 400, None),
    ("tools", CHAT, {"messages": HI, "tools": [{"type": "function"}]}, {}, 400, None),
    (
        "image-part",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {},
        400,
        None,
    ),
    ("message-without-content", CHAT, {"messages": [{"role": "user"}]}, {}, 400, None),
    ("detokenize-out-of-vocab", "/detokenize", {"tokens": [-1]}, {}, 400, None),
    ("unknown-model", CMPL, {"prompt": "hi", "model": "gpt-4"}, {}, 404, "model_not_found"),
    ("unknown-model-chat", CHAT, {"messages": HI, "model": "nope"}, {}, 404, "model_not_found"),
    ("unknown-route", "/v1/nothing", {}, {}, 404, None),
    ("no-api-key", CMPL, {"prompt": "hi"}, {"Authorization": ""}, 401, "invalid_api_key"),
    (
        "wrong-api-key",
        CMPL,
        {"prompt": "hi"},
        {"Authorization": "Bearer nope"},
        401,
        "invalid_api_key",
    ),
    ("body-too-large", CMPL, {"prompt": "x" * MAX_BODY_BYTES}, {}, 413, "request_too_large"),
]


@pytest.mark.parametrize(
    "path, body, headers, status, code",
    [r[1:] for r in BAD_REQUESTS],
    ids=[r[0] for r in BAD_REQUESTS],
)
def test_bad_request_gets_openai_error_and_server_still_serves(
    server: RunningServer,
    path: str,
    body: Any,
    headers: dict[str, str],
    status: int,
    code: str | None,
) -> None:
    all_headers = {**AUTH, "Content-Type": "application/json", **headers}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.url}{path}", content=content, headers=all_headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == code
    good = server.client().completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert good.usage is not None and good.usage.completion_tokens >= 1


def test_chunked_body_over_limit_is_413(server: RunningServer) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    response = httpx.post(f"{server.url}{CMPL}", content=chunks(), headers=AUTH)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    def small() -> Iterator[bytes]:
        yield b'{"prompt": "hi", '
        yield b'"max_tokens": 3, "ignore_eos": true}'

    headers = {**AUTH, "Content-Type": "application/json"}
    response = httpx.post(f"{server.url}{CMPL}", content=small(), headers=headers)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


def test_bad_requests_leak_no_blocks(server: RunningServer) -> None:
    server.wait_idle()
    assert server.engine.kv_cache_manager.num_free_blocks == server.engine.num_blocks


# -- disconnects and overload -----------------------------------------------------------------
def _long_request(stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": "Hello",
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": stream,
    }


def test_disconnect_mid_stream_aborts_and_frees_blocks(server: RunningServer) -> None:
    server.wait_idle()
    aborted = server.metric("vllm:request_success_total", finished_reason="abort")
    length = server.metric("vllm:request_success_total", finished_reason="length")
    with httpx.stream("POST", f"{server.url}{CMPL}", json=_long_request(True), headers=AUTH) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        server.wait_until(
            lambda: (
                server.metric("vllm:kv_cache_usage_perc") > 0.0
                and server.metric("vllm:num_requests_running") == 1.0
            )
        )
    server.wait_until(lambda: server.metric("vllm:kv_cache_usage_perc") == 0.0, timeout_s=5)
    assert server.metric("vllm:request_success_total", finished_reason="abort") == aborted + 1
    assert server.metric("vllm:request_success_total", finished_reason="length") == length
    assert server.engine.kv_cache_manager.num_free_blocks == server.engine.num_blocks


def test_disconnect_while_waiting_for_full_response_aborts(server: RunningServer) -> None:
    server.wait_idle()
    aborted = server.metric("vllm:request_success_total", finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}{CMPL}", json=_long_request(False), headers=AUTH, timeout=0.3)
    server.wait_until(lambda: server.metric("vllm:kv_cache_usage_perc") == 0.0, timeout_s=5)
    assert server.metric("vllm:request_success_total", finished_reason="abort") == aborted + 1


def test_overload_gets_503_and_accepted_requests_complete(small_server: RunningServer) -> None:
    url, client = small_server.url, small_server.client()
    with httpx.stream("POST", f"{url}{CMPL}", json=_long_request(True), headers=AUTH) as running:
        running_lines = running.iter_lines()  # keep it: a closed iterator closes the stream
        next(line for line in running_lines if line.startswith("data: "))  # it has the seat
        queued_body = {
            "model": MODEL,
            "prompt": "Hi",
            "max_tokens": 5,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{url}{CMPL}", json=queued_body, headers=AUTH) as queued:
            assert queued.status_code == 200  # accepted: it waits for the seat
            with pytest.raises(openai.APIStatusError) as refused:
                client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            assert refused.value.status_code == 503
            assert refused.value.response.headers["Retry-After"] == "1"
            assert refused.value.response.json()["error"]["code"] == "server_overloaded"
            running.close()  # frees the seat: the queued request now runs to its end
            events = [line[6:] for line in queued.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][-1]["finish_reason"] == "length"
    assert small_server.metric("infer8:requests_rejected_total") >= 1

    # A burst: every request is either refused with 503 or answered in full.
    async def burst() -> list[Any]:
        async with httpx.AsyncClient(headers=AUTH, timeout=60) as http:
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 6, "ignore_eos": True}
            return await asyncio.gather(*[http.post(f"{url}{CMPL}", json=body) for _ in range(12)])

    responses = asyncio.run(burst())
    assert {r.status_code for r in responses} <= {200, 503}
    done = [r.json() for r in responses if r.status_code == 200]
    assert done and all(d["usage"]["completion_tokens"] == 6 for d in done)
    small_server.wait_idle()


def test_slow_step_does_not_block_the_http_loop(long_llama_dir: Path) -> None:
    engine = _engine(long_llama_dir)
    step = engine.step

    def slow_step() -> list[Any]:
        time.sleep(1.0)
        return step()

    engine.step = slow_step  # type: ignore[method-assign]
    running = start_server(engine, ServerConfig(host="127.0.0.1", port=0, api_key=API_KEY))
    try:
        body = {"prompt": "hi", "max_tokens": 2, "ignore_eos": True}
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(httpx.post, f"{running.url}{CMPL}", json=body, headers=AUTH)
            running.wait_until(lambda: running.metric("vllm:num_requests_running") == 1.0)
            start = time.monotonic()
            assert httpx.get(f"{running.url}/health").status_code == 200
            assert httpx.get(f"{running.url}/v1/models", headers=AUTH).status_code == 200
            assert time.monotonic() - start < 0.3  # answered while a 1 s step runs
            assert slow.result(timeout=30).json()["usage"]["completion_tokens"] == 2
    finally:
        stop_server(running)


def test_engine_failure_is_503_then_restart_then_exit(long_llama_dir: Path) -> None:
    engine = _engine(long_llama_dir)
    step = engine.step
    num_failures = [2]  # the next two steps fail, then the device "comes back"

    def flaky_step() -> list[Any]:
        if num_failures[0] > 0:
            num_failures[0] -= 1
            raise RuntimeError("device lost")
        return step()

    engine.step = flaky_step  # type: ignore[method-assign]
    fatal: list[str] = []
    config = ServerConfig(host="127.0.0.1", port=0, api_key=API_KEY, max_engine_restarts=2)
    running = start_server(engine, config)
    running.server.config.app.state.engine_client.on_fatal = fatal.append
    url = f"{running.url}{CMPL}"
    body = {"prompt": "hi", "max_tokens": 3}
    try:
        for _ in range(2):  # each failed step fails its request alone, and the engine restarts
            response = httpx.post(url, json=body, headers=AUTH, timeout=10)
            assert response.status_code == 503
            error = response.json()["error"]
            assert error["type"] == "server_error" and "restart" in error["message"]
            assert httpx.get(f"{running.url}/health").status_code == 200
        response = httpx.post(url, json=body, headers=AUTH, timeout=10)
        assert response.status_code == 200  # serving again, state rebuilt in-process
        assert response.json()["usage"]["completion_tokens"] == 3
        assert running.metric("infer8:engine_restarts_total") == 2.0
        assert fatal == []
        num_failures[0] = 1  # a third failure within the window: give up, exit non-zero
        assert httpx.post(url, json=body, headers=AUTH, timeout=10).status_code == 503
        health = httpx.get(f"{running.url}/health")
        assert health.status_code == 503 and "failed 3 times" in health.json()["reason"]
        assert len(fatal) == 1
        assert httpx.post(url, json=body, headers=AUTH, timeout=10).status_code == 503
    finally:
        stop_server(running)


# -- metrics ------------------------------------------------------------------------------------
def test_metrics_parse_and_move_with_requests(server: RunningServer) -> None:
    server.wait_idle()
    before = server.metrics()
    names = {name for name, _ in before}
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_count",
        "vllm:cache_config_info",
        "infer8:kv_cache_capacity_tokens",
        "infer8:kv_cache_fp8_saturated_total",
        "infer8:padded_tokens_total",
    ]:
        assert name in names, name
    info = next(dict(labels) for name, labels in before if name == "vllm:cache_config_info")
    assert info["block_size"] == "16" and info["cache_dtype"] == "auto"
    assert server.metric("infer8:kv_cache_capacity_tokens", model_name=MODEL) == (
        server.engine.num_blocks * 16
    )

    def delta(name: str, **labels: str) -> float:
        return server.metric(name, model_name=MODEL, **labels) - sum(
            v for (n, ls), v in before.items() if n == name and set(labels.items()) <= set(ls)
        )

    out = server.client().completions.create(
        model=MODEL,
        prompt="Hello world",
        max_tokens=7,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage is not None
    assert delta("vllm:prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("vllm:generation_tokens_total") == 7
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 6
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:request_queue_time_seconds_count") == 1


# -- the command line, as a separate process ---------------------------------------------------
SEED_FLAGS = [
    "--kv-cache-dtype=fp8_e4m3",
    "--gpu-memory-utilization=0.94",
    "--max-num-seqs=512",
    "--max-num-batched-tokens=16384",
    "--enforce-eager",
]
# The seed's command line sizes the KV cache from the device's memory; pretend the machine has
# 256 MiB so the test does not take 94% of this one's RAM.
_LAUNCH = (
    "import runpy, sys, infer8.engine as e; e._device_memory_bytes = lambda device: 256 << 20; "
    "sys.argv[0] = 'api_server'; "
    "runpy.run_module('infer8.entrypoints.openai.api_server', run_name='__main__')"
)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_seed_command_line_serves_and_sigterm_drains_in_flight(llama_dir: Path) -> None:
    port = _free_port()
    argv = [sys.executable, "-c", _LAUNCH, f"--model={llama_dir}", *SEED_FLAGS, f"--port={port}"]
    argv.append("--shutdown-grace-period-s=10")
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, timeout_s=60)
        metrics = httpx.get(f"{url}/metrics").text
        assert 'cache_dtype="fp8_e4m3"' in metrics
        body = {"prompt": "Hello", "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            # the listener stays up for the grace period: new work gets 503 + Connection: close
            deadline = time.monotonic() + 3
            while httpx.get(f"{url}/ready", timeout=2).status_code != 503:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            refused = httpx.post(f"{url}/v1/completions", json=body, timeout=5)
            assert refused.status_code == 503 and refused.headers["connection"] == "close"
            assert refused.json()["error"]["code"] == "server_shutting_down"
            events = [first] + [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2][6:])
        assert last["choices"][0]["finish_reason"] == "length"  # drained, not cut off
        assert httpx.get(f"{url}/health", timeout=2).status_code == 200  # alive until the end
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - signalled >= 9.5  # the whole grace period
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_prompt_far_over_the_context_is_refused_without_tokenizing(
    small_server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = small_server  # no body-size limit below the prompts sent here
    tokenizer = server.engine.tokenizer
    limit_chars = 2 * tokenizer.max_token_chars * server.engine.max_model_len
    calls: list[int] = []
    encode = tokenizer.encode
    monkeypatch.setattr(
        tokenizer, "encode", lambda text, *a, **k: calls.append(1) or encode(text, *a, **k)
    )
    for path, body in [
        ("/v1/completions", {"model": MODEL, "prompt": "a" * limit_chars, "max_tokens": 1}),
        ("/v1/chat/completions", {"model": MODEL, "max_tokens": 1,
                                  "messages": [{"role": "user", "content": "a" * limit_chars}]}),
    ]:  # fmt: skip
        response = httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert f"maximum context length is {server.engine.max_model_len}" in error["message"]
    assert calls == []  # refused on its length alone
    # just under the bound is tokenized as usual (and refused by its token count)
    body = {"model": MODEL, "prompt": "a b " * (limit_chars // 8), "max_tokens": 1}
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=30)
    assert calls and response.status_code in (200, 400)
