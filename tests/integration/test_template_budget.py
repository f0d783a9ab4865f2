"""A model's chat template cannot wedge or kill the server: a runaway template is a 400 that
names the template within its budget, /health keeps answering, and a pool whose every thread
is stuck turns /health 503."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.entrypoints.openai import serving
from infer8.entrypoints.openai.cli_args import ServerConfig
from tests.utils import start_server, stop_server

HI = [{"role": "user", "content": "hi"}]
# On main before the budget: the first never answers (and wedges the one pool thread), the
# second is a 500, the third aborts the process inside the tokenizer.
RUNAWAYS = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}",
    "a recursive macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "a huge string": "{{ 'x' * 300000000 }}",
}


def _engine_with_template(llama_dir: Path, tmp_path: Path, template: str | None) -> LLMEngine:
    model_dir = tmp_path / "model"
    shutil.copytree(llama_dir, model_dir)
    if template is not None:
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = template
        config_path.write_text(json.dumps(config))
    return LLMEngine(
        EngineArgs(model=str(model_dir), dtype="float32", kv_cache_memory_bytes=8 << 20)
    )


@pytest.mark.parametrize("name", list(RUNAWAYS))
def test_a_runaway_template_is_a_400_naming_it_while_health_answers(
    llama_dir: Path, tmp_path: Path, name: str
) -> None:
    engine = _engine_with_template(llama_dir, tmp_path, RUNAWAYS[name])
    running = start_server(engine, ServerConfig(port=0))
    try:
        model = engine.served_model_name
        body = {"model": model, "messages": HI, "max_tokens": 2}
        health_latencies_s: list[float] = []
        stop = threading.Event()

        def probe() -> None:
            with httpx.Client(timeout=30) as client:
                while not stop.is_set():
                    start = time.perf_counter()
                    assert client.get(f"{running.url}/health").status_code == 200
                    health_latencies_s.append(time.perf_counter() - start)
                    time.sleep(0.02)

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        while not health_latencies_s:  # a baseline before the request
            time.sleep(0.01)
        start = time.perf_counter()
        response = httpx.post(f"{running.url}/v1/chat/completions", json=body, timeout=60)
        elapsed_s = time.perf_counter() - start
        stop.set()
        prober.join(10)
        assert response.status_code == 400, response.text
        assert "chat template" in response.json()["error"]["message"]
        assert elapsed_s < 30  # the budget is 5 s of rendering
        assert health_latencies_s and max(health_latencies_s) < 2.0, health_latencies_s
        # The thread that rendered it is free: the next request is served.
        completion = {"model": model, "prompt": "hi", "max_tokens": 2}
        ok = httpx.post(f"{running.url}/v1/completions", json=completion, timeout=60)
        assert ok.status_code == 200, ok.text
    finally:
        stop_server(running)


def test_a_wedged_tokenizer_pool_turns_health_503(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Something in the pool that never returns (a tokenizer, a detokenizer) blocks every
    request behind it: /health says so instead of answering 200 forever."""
    real_pool = serving.WorkPool
    monkeypatch.setattr(
        serving, "WorkPool", lambda: real_pool(max_workers=1, wedged_after_s=0.5), raising=True
    )
    from infer8.entrypoints.openai import server as server_module

    monkeypatch.setattr(server_module, "WorkPool", serving.WorkPool)
    engine = _engine_with_template(llama_dir, tmp_path, None)
    release = threading.Event()
    real_encode = engine.tokenizer.encode

    def stuck_encode(*args: object, **kwargs: object) -> list[int]:
        release.wait(30)
        return real_encode(*args, **kwargs)  # type: ignore[arg-type]

    running = start_server(engine, ServerConfig(port=0))
    try:
        assert httpx.get(f"{running.url}/health").status_code == 200
        engine.tokenizer.encode = stuck_encode  # type: ignore[method-assign]
        body = {"model": engine.served_model_name, "prompt": "hi", "max_tokens": 2}
        sender = threading.Thread(
            target=lambda: httpx.post(f"{running.url}/v1/completions", json=body, timeout=60),
            daemon=True,
        )
        sender.start()
        deadline = time.monotonic() + 10
        health = httpx.get(f"{running.url}/health")
        while health.status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
            health = httpx.get(f"{running.url}/health")
        assert health.status_code == 503, health.text
        assert "tokenizer pool is wedged" in health.json()["reason"]
        release.set()
        engine.tokenizer.encode = real_encode  # type: ignore[method-assign]
        sender.join(30)
        assert httpx.get(f"{running.url}/health").status_code == 200
    finally:
        release.set()
        stop_server(running)
