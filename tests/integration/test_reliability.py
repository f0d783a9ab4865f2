"""One bad request never takes the engine or the server down (issue #18)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.entrypoints.openai.cli_args import ServerConfig
from infer8.sampling_params import SamplingParams
from tests.utils import (
    RunningServer,
    build_tiny_model,
    free_port,
    start_server,
    stop_server,
    wait_healthy,
)

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CMPL = "/v1/completions"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("reliable"), "llama")


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> LLMEngine:
    args = EngineArgs(model=str(model_dir), dtype="float32", kv_cache_memory_bytes=4 << 20)
    return LLMEngine(args)


def _engine(model_dir: Path) -> LLMEngine:
    args = EngineArgs(model=str(model_dir), dtype="float32", kv_cache_memory_bytes=4 << 20)
    return LLMEngine(args)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[RunningServer]:
    running = start_server(_engine(model_dir), ServerConfig(port=0, api_key=API_KEY))
    yield running
    stop_server(running)


# -- the whole sampling-parameter space, in one engine ----------------------------------------
_TINY = [1e-38, 1e-30, 1e-12, 1e-5]
_HUGE = [1e5, 1e30, 1e38, 3.4e38]


def _floats(low: float, high: float, extremes: list[float]) -> st.SearchStrategy[float]:
    picks = [x for x in extremes if low <= x <= high] + [low, high]
    return st.one_of(st.sampled_from(picks), st.floats(low, high, allow_nan=False))


@st.composite
def sampling_kwargs(draw: st.DrawFn) -> dict[str, Any]:
    """Any parameters a client could send, legal or not (illegal ones must be refused)."""
    return {
        "temperature": draw(_floats(0.0, 3.4e38, _TINY + _HUGE) | st.sampled_from([-1.0, -1e-9])),
        "top_p": draw(_floats(1e-38, 1.0, _TINY) | st.sampled_from([0.0, 1.0 + 1e-9])),
        "top_k": draw(st.sampled_from([-1, 0, 1, 2, 50, 10_000, -5])),
        "min_p": draw(_floats(0.0, 1.0, _TINY)),
        "repetition_penalty": draw(_floats(1e-38, 3.4e38, _TINY + _HUGE) | st.just(0.0)),
        "presence_penalty": draw(_floats(-2.0, 2.0, []) | st.sampled_from([-2.5, 1e30])),
        "frequency_penalty": draw(_floats(-2.0, 2.0, [])),
        "min_tokens": draw(st.sampled_from([0, 1, 3])),
        "max_tokens": draw(st.sampled_from([1, 3, 5])),
        "logprobs": draw(st.sampled_from([None, 0, 5, 20])),
        "seed": draw(st.sampled_from([None, 0, 2**63 - 1])),
        "ignore_eos": draw(st.booleans()),
    }


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batch=st.lists(sampling_kwargs(), min_size=1, max_size=6))
def test_any_sampling_parameters_complete_or_are_refused(
    engine: LLMEngine, batch: list[dict[str, Any]]
) -> None:
    """Extreme, tiny and huge values mixed with a normal request: the engine never dies."""
    batch = [*batch, {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}]
    expected: dict[str, int] = {}
    for i, kwargs in enumerate(batch):
        try:
            params = SamplingParams(**kwargs)
        except ValueError:
            continue  # refused at the edge: a 400 for a client
        expected[engine.add_request([5, 6, 7, 8 + i], params)] = params.max_tokens or 0
    finished: dict[str, Any] = {}
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert set(finished) == set(expected)
    for req_id, output in finished.items():
        completion = output.outputs[0]
        assert completion.finish_reason in ("stop", "length"), output.error
        assert 1 <= len(completion.token_ids) <= expected[req_id]
        assert all(0 <= t < engine.vocab_size for t in completion.token_ids)
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_a_request_failing_in_the_sampler_fails_alone(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    import infer8.worker.sampler as sampler_mod

    real = sampler_mod.apply_penalties

    def explode_for_penalty_3(
        logits: torch.Tensor, rows: list[int], states: list[Any], stop_ids: list[list[int]]
    ) -> dict[int, str]:
        if any(states[i].params.repetition_penalty == 3.0 for i in rows):
            raise RuntimeError("injected")
        return real(logits, rows, states, stop_ids)

    monkeypatch.setattr(sampler_mod, "apply_penalties", explode_for_penalty_3)
    bad = engine.add_request([5, 6, 7], SamplingParams(max_tokens=5, repetition_penalty=3.0))
    good = engine.add_request([5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0))
    outputs: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
    assert outputs[bad].outputs[0].finish_reason == "error" and outputs[bad].error
    assert outputs[good].outputs[0].finish_reason == "length"
    assert len(outputs[good].outputs[0].token_ids) == 5
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


# -- the server ----------------------------------------------------------------------------------
def test_the_engine_killer_request_is_served_and_others_go_on(server: RunningServer) -> None:
    killer = {
        "prompt": "The quick brown fox",
        "max_tokens": 4,
        "temperature": 1.0,
        "repetition_penalty": 1e-38,
    }
    normal = {"prompt": "hello", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    with ThreadPoolExecutor(4) as pool:
        futures = [
            pool.submit(httpx.post, f"{server.url}{CMPL}", json=body, headers=AUTH, timeout=30)
            for body in (killer, normal, killer, normal)
        ]
        responses = [f.result() for f in futures]
    assert [r.status_code for r in responses] == [200] * 4
    assert responses[1].json()["usage"]["completion_tokens"] == 6
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "reason": None}


def test_a_request_failing_alone_gets_500_and_the_others_complete(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import infer8.worker.sampler as sampler_mod

    real = sampler_mod.apply_penalties

    def explode(
        logits: torch.Tensor, rows: list[int], states: list[Any], stop_ids: list[list[int]]
    ) -> dict[int, str]:
        if any(states[i].params.repetition_penalty == 3.0 for i in rows):
            raise RuntimeError("injected /secret/path")
        return real(logits, rows, states, stop_ids)

    monkeypatch.setattr(sampler_mod, "apply_penalties", explode)
    bad = {"prompt": "hi", "max_tokens": 4, "repetition_penalty": 3.0}
    good = {"prompt": "hi", "max_tokens": 8, "ignore_eos": True, "stream": True}
    with ThreadPoolExecutor(2) as pool:
        stream = pool.submit(_stream_events, server.url, good)
        response = httpx.post(f"{server.url}{CMPL}", json=bad, headers=AUTH, timeout=30)
        events = stream.result(timeout=30)
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == "generation_failed" and "secret" not in error["message"]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert httpx.get(f"{server.url}/health").status_code == 200
    server.wait_idle()


def _stream_events(url: str, body: dict[str, Any], headers: dict[str, str] = AUTH) -> list[str]:
    events = []
    with httpx.stream("POST", f"{url}{CMPL}", json=body, headers=headers, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
    return events


def test_lone_surrogates_and_admin_endpoints(server: RunningServer) -> None:
    raw = '{"prompt": "hi \\ud800 there", "max_tokens": 2}'
    headers = {**AUTH, "Content-Type": "application/json"}
    response = httpx.post(f"{server.url}{CMPL}", content=raw, headers=headers)
    assert response.status_code == 400 and "surrogate" in response.json()["error"]["message"]
    chat = '{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}'
    response = httpx.post(f"{server.url}/v1/chat/completions", content=chat, headers=headers)
    assert response.status_code == 400
    # admin endpoints exist only in dev mode
    assert httpx.post(f"{server.url}/reset_prefix_cache", headers=AUTH).status_code == 404


def test_a_wedged_step_turns_health_503_fails_requests_and_asks_to_exit(model_dir: Path) -> None:
    engine = _engine(model_dir)
    step = engine.step
    release = threading.Event()

    def hanging_step() -> list[Any]:
        release.wait(30)  # a wedged kernel or collective
        return step()

    engine.step = hanging_step  # type: ignore[method-assign]
    fatal: list[str] = []
    config = ServerConfig(port=0, api_key=API_KEY, engine_step_timeout_s=1.0)
    running = start_server(engine, config)
    running.server.config.app.state.engine_client.on_fatal = fatal.append
    try:
        assert httpx.get(f"{running.url}/health").status_code == 200
        start = time.monotonic()
        response = httpx.post(
            f"{running.url}{CMPL}", json={"prompt": "hi", "max_tokens": 2}, headers=AUTH, timeout=30
        )
        assert response.status_code == 503 and time.monotonic() - start < 10
        health = httpx.get(f"{running.url}/health")
        assert health.status_code == 503 and "wedged" in health.json()["reason"]
        assert len(fatal) == 1 and "wedged" in fatal[0]
        ready = httpx.get(f"{running.url}/ready")
        assert ready.status_code == 503
    finally:
        release.set()
        stop_server(running)


def test_drain_refuses_new_work_at_once_and_ends_streams_with_a_final_event(
    model_dir: Path,
) -> None:
    engine = _engine(model_dir)
    step = engine.step

    def slow_step() -> list[Any]:
        time.sleep(0.05)
        return step()

    engine.step = slow_step  # type: ignore[method-assign]
    running = start_server(engine, ServerConfig(port=0, api_key=API_KEY))
    client = running.server.config.app.state.engine_client
    body = {"prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
    try:
        with ThreadPoolExecutor(1) as pool:
            stream = pool.submit(_stream_events, running.url, body)
            running.wait_until(lambda: running.metric("vllm:num_requests_running") == 1.0)
            client.start_drain(abort_after_s=0.5)
            start = time.monotonic()
            refused = httpx.post(f"{running.url}{CMPL}", json=body, headers=AUTH, timeout=5)
            assert refused.status_code == 503 and time.monotonic() - start < 0.5
            assert refused.json()["error"]["code"] == "server_shutting_down"
            assert httpx.get(f"{running.url}/ready").status_code == 503
            assert httpx.get(f"{running.url}/health").status_code == 200  # alive, not ready
            events = stream.result(timeout=30)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
        running.wait_idle()
    finally:
        stop_server(running)


def test_sigterm_ends_long_streams_with_a_final_event_and_exits_0(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    import os
    import signal
    import subprocess
    import sys

    long_dir = build_tiny_model(
        tmp_path_factory.mktemp("long"), "llama", max_position_embeddings=16384
    )
    port = free_port()
    argv = [sys.executable, "-m", "infer8.entrypoints.openai.api_server", f"--model={long_dir}"]
    argv += ["--dtype=float32", "--kv-cache-memory-bytes=67108864", f"--port={port}"]
    argv += ["--shutdown-grace-period-s=2", "--host=127.0.0.1"]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ}
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, timeout_s=60)
        body = {"prompt": "Hello", "max_tokens": 16000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}{CMPL}", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            events = [first] + [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "abort"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
