"""Per-request state is dropped when a request ends, however it ends: a server's memory stays
flat under steady traffic (docs/reliability.md, Memory)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.entrypoints.openai.cli_args import ServerConfig
from tests.utils import RunningServer, build_tiny_model, start_server, stop_server

MAX_NUM_SEQS = 4
NUM_REQUESTS = 48


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    model_dir = build_tiny_model(tmp_path_factory.mktemp("bounded"), "llama")
    args = EngineArgs(
        model=str(model_dir),
        dtype="float32",
        kv_cache_memory_bytes=4 << 20,
        max_num_seqs=MAX_NUM_SEQS,
    )
    running = start_server(LLMEngine(args), ServerConfig(port=0))
    yield running
    stop_server(running)


def _one(url: str, seed: int) -> str:
    """Send one soak-like request: streamed or not, finished, stopped early or cut off."""
    rng = random.Random(seed)
    words = " ".join(rng.choice(["a", "b", "cd", "efg", "hi"]) for _ in range(rng.randint(2, 60)))
    body = {"prompt": words, "max_tokens": rng.randint(1, 120), "temperature": 0.8}
    with httpx.Client(timeout=60) as client:
        if seed % 3 == 0:  # the client goes away mid-stream: the server aborts the request
            body.update(max_tokens=300, ignore_eos=True, stream=True)
            with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                for i, _ in enumerate(r.iter_lines()):
                    if i >= 2:
                        return "cancelled"
            return "finished"
        if seed % 3 == 1:
            body["stream"] = True
            with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                r.read()
            return "finished"
        r = client.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return "finished"


def test_per_request_state_is_dropped_after_finished_and_aborted_requests(
    server: RunningServer,
) -> None:
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda s: _one(server.url, s), range(NUM_REQUESTS)))
    assert outcomes.count("cancelled") >= NUM_REQUESTS // 4
    server.wait_until(
        lambda: server.metric("vllm:request_success_total", finished_reason="abort") > 0
    )
    server.wait_idle()
    engine = server.engine
    client = server.server.config.app.state.engine_client
    server.wait_until(lambda: not engine.req_states and not client._tracked)
    assert not client._groups
    assert not engine.scheduler.requests
    assert not engine.scheduler.waiting and not engine.scheduler.running
    kv = engine.kv_cache_manager
    assert not kv.req_to_block_ids and not kv.req_to_num_cached_blocks
    # The runner hears of the last step's finished requests with the next step: at most one
    # batch of them is left over.
    runner = engine.executor.driver_worker.runner
    assert len(runner.states) <= MAX_NUM_SEQS
    assert len(engine.scheduler._seen_by_runner) <= MAX_NUM_SEQS
