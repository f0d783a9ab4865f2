"""What one API key, a Prometheus scraper or a rebound web page can reach on a running server:
/metrics, the engine view's event stream, /reset_prefix_cache, Host names and request heads."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.entrypoints.openai.cli_args import ServerConfig
from tests.utils import RunningServer, start_server, stop_server

KEY_A, KEY_B = "key-a", "key-b"
AUTH_A = {"Authorization": f"Bearer {KEY_A}"}
AUTH_B = {"Authorization": f"Bearer {KEY_B}"}


def _engine(model_dir: Path, step_delay_s: float = 0.0) -> LLMEngine:
    engine = LLMEngine(
        EngineArgs(model=str(model_dir), dtype="float32", kv_cache_memory_bytes=8 << 20)
    )
    if step_delay_s:
        step = engine.step

        def slow_step() -> list[Any]:
            time.sleep(step_delay_s)
            return step()

        engine.step = slow_step  # type: ignore[method-assign]
    return engine


@pytest.fixture(scope="module")
def server(llama_dir: Path) -> Iterator[RunningServer]:
    """Two tenants, dev mode on, bound to loopback, steps slow enough to watch a request run."""
    config = ServerConfig(
        host="127.0.0.1", port=0, api_key=(KEY_A, KEY_B), enable_server_dev_mode=True
    )
    running = start_server(_engine(llama_dir, step_delay_s=0.02), config)
    yield running
    stop_server(running)


def test_metrics_need_a_key_by_default_when_keys_are_set(server: RunningServer) -> None:
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    assert httpx.get(f"{server.url}/metrics", headers=AUTH_B).status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes stay open


def test_one_key_of_several_cannot_reset_the_shared_prefix_cache(server: RunningServer) -> None:
    response = httpx.post(f"{server.url}/reset_prefix_cache", headers=AUTH_A)
    assert response.status_code == 403, response.text
    assert response.json()["error"]["code"] == "permission_denied"


def test_a_rebound_host_name_gets_421_on_a_loopback_server(server: RunningServer) -> None:
    for host in ("attacker.example", "attacker.example:8000"):
        response = httpx.get(f"{server.url}/v1/models", headers={**AUTH_A, "Host": host})
        assert response.status_code == 421, response.text
        assert httpx.get(f"{server.url}/health", headers={"Host": host}).status_code == 421
    port = server.url.rsplit(":", 1)[1]
    response = httpx.get(f"{server.url}/v1/models", headers={**AUTH_A, "Host": f"localhost:{port}"})
    assert response.status_code == 200


def test_oversized_request_heads_get_431(server: RunningServer) -> None:
    many = {f"x-h{i}": "1" for i in range(1_000)}
    response = httpx.get(f"{server.url}/v1/models", headers={**AUTH_A, **many}, timeout=30)
    assert response.status_code == 431, response.text
    big = {"x-big": "a" * 100_000}
    response = httpx.get(f"{server.url}/v1/models", headers={**AUTH_A, **big}, timeout=30)
    assert response.status_code == 431, response.text
    assert httpx.get(f"{server.url}/v1/models", headers=AUTH_A).status_code == 200


def _first_step(url: str, headers: dict[str, str]) -> dict[str, Any]:
    """Return the first step record of the engine view's event stream."""
    with httpx.stream("GET", f"{url}/console/api/events", headers=headers, timeout=10) as r:
        assert r.status_code == 200
        is_step = False
        for line in r.iter_lines():
            if line == "event: step":
                is_step = True
            elif is_step and line.startswith("data: "):
                return json.loads(line[len("data: ") :])
    raise AssertionError("the stream ended without a step record")


def test_the_engine_view_shows_other_keys_requests_without_their_ids(
    server: RunningServer,
) -> None:
    body = {"model": server.engine.served_model_name, "prompt": "hello there", "stream": True,
            "max_tokens": 400, "ignore_eos": True}  # fmt: skip
    ids: list[str] = []
    stop = threading.Event()

    def run_a() -> None:
        url = f"{server.url}/v1/completions"
        with httpx.stream("POST", url, json=body, headers=AUTH_A, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and not ids:
                    ids.append(json.loads(line[len("data: ") :])["id"])
                if stop.is_set():
                    return  # closing the stream aborts the request

    thread = threading.Thread(target=run_a, daemon=True)
    thread.start()
    try:
        server.wait_until(lambda: bool(ids) and server.metric("vllm:num_requests_running") == 1)
        (request_id,) = ids
        seen_by_b = _first_step(server.url, AUTH_B)
        seen_by_a = _first_step(server.url, AUTH_A)
    finally:
        stop.set()
        thread.join(30)
    assert request_id not in json.dumps(seen_by_b)
    ((_, label, prompt_tokens, output_tokens, num_blocks),) = seen_by_b["reqs"]
    assert label == "other keys (1)" and prompt_tokens is None and output_tokens is None
    assert num_blocks >= 1
    ((_, own_id, *_),) = seen_by_a["reqs"]
    assert own_id.startswith(request_id)
    server.wait_idle()


def test_one_key_may_reset_and_metrics_can_be_opened_for_scrapers(llama_dir: Path) -> None:
    config = ServerConfig(
        host="127.0.0.1",
        port=0,
        api_key=KEY_A,
        enable_server_dev_mode=True,
        metrics_require_api_key=False,
    )
    running = start_server(_engine(llama_dir), config)
    try:
        assert httpx.get(f"{running.url}/metrics").status_code == 200
        response = httpx.post(f"{running.url}/reset_prefix_cache", headers=AUTH_A)
        assert response.status_code == 200, response.text
    finally:
        stop_server(running)
