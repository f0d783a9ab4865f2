"""--scheduling-policy priority end to end on a tiny random model: a priority-0 request overtakes
earlier priority-10 ones under a full KV cache; LLM.generate(priority=...); the server's 400."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from infer8 import LLM, SamplingParams
from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.entrypoints.openai.cli_args import ServerConfig
from tests.utils import RunningServer, start_server, stop_server

# Eight 16-token blocks (float32 K and V of the tiny Llama: 8 KiB a block), 64-token requests.
SMALL_CACHE = dict(dtype="float32", kv_cache_memory_bytes=8 * 8192, max_model_len=64)


def _engine(model_dir: Path, policy: str, **kwargs: Any) -> LLMEngine:
    args = dict(model=str(model_dir), scheduling_policy=policy, enforce_eager=True, **SMALL_CACHE)
    args.update(kwargs)
    return LLMEngine(EngineArgs(**args))


def _prompt(i: int) -> list[int]:
    return list(range(10 + 30 * i, 30 + 30 * i))  # 20 tokens, shared with no other prompt


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_priority_0_request_finishes_before_earlier_priority_10_requests_in_a_full_cache(
    llama_dir: Path, policy: str
) -> None:
    engine = _engine(llama_dir, policy)
    assert engine.num_blocks == 8 and engine.cache_config.block_size == 16
    low_priority = 10 if policy == "priority" else 0
    long = SamplingParams(max_tokens=44, temperature=0.0, ignore_eos=True)  # 64 tokens, 4 blocks
    for i in range(2):
        engine.add_request(_prompt(i), long, f"low{i}", priority=low_priority)
    finish_steps: dict[str, int] = {}
    step = 0
    while engine.kv_cache_manager.num_free_blocks > 0:  # both grow until the cache is full
        assert not [o for o in engine.step() if o.finished]
        step += 1
    assert engine.last_stats.num_running == 2
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request(_prompt(2), short, "high", priority=0)
    arrival_step = step
    num_preemptions = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finish_steps[out.request_id] = step
        num_preemptions += engine.last_stats.num_preemptions
        step += 1
    assert set(finish_steps) == {"low0", "low1", "high"}
    if policy == "priority":
        # low1 (the later of the two) made room at once; high ran its 4 tokens straight away.
        assert finish_steps["high"] < min(finish_steps["low0"], finish_steps["low1"])
        assert finish_steps["high"] - arrival_step == 3
        assert num_preemptions >= 1 and finish_steps["low0"] < finish_steps["low1"]
    else:  # FCFS: high waits for blocks until the earlier requests are done
        assert finish_steps["high"] > max(finish_steps["low0"], finish_steps["low1"])
        assert num_preemptions == 0
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0


def test_fcfs_engine_refuses_a_nonzero_priority(llama_dir: Path) -> None:
    engine = _engine(llama_dir, "fcfs")
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=1), priority=1)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=1), priority=0)
    assert engine.scheduler.num_unfinished_requests == 1


def test_llm_generate_takes_one_priority_per_prompt(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), scheduling_policy="priority", max_num_seqs=1, **SMALL_CACHE)
    admitted: list[str] = []
    llm.engine.stat_loggers.append(lambda stats: admitted.extend(stats.admitted_req_ids))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    outs = llm.generate([_prompt(i) for i in range(3)], params, priority=[5, 0, 3])
    assert [o.request_id for o in outs] == ["req-0", "req-1", "req-2"]  # in prompt order
    assert admitted == ["req-1", "req-2", "req-0"]  # run in priority order
    with pytest.raises(ValueError, match="2 priorities"):
        llm.generate([_prompt(0)], params, priority=[0, 1])


# -- the server --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fcfs_server(llama_dir: Path) -> Iterator[RunningServer]:
    running = start_server(_engine(llama_dir, "fcfs"), ServerConfig(host="127.0.0.1", port=0))
    yield running
    stop_server(running)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        ),
    ],
)
def test_fcfs_server_answers_400_for_a_nonzero_priority(
    fcfs_server: RunningServer, path: str, body: dict[str, Any], stream: bool
) -> None:
    url = fcfs_server.url + path
    response = httpx.post(url, json={**body, "priority": -1, "stream": stream}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]
    assert error["type"] == "invalid_request_error"
    response = httpx.post(url, json={**body, "priority": 0, "stream": stream}, timeout=30)
    assert response.status_code == 200, response.text
    fcfs_server.wait_idle()
    assert fcfs_server.metric("infer8:num_requests_waiting_by_priority", priority="0") == 0.0


def test_priority_server_hands_the_request_priority_to_the_engine(llama_dir: Path) -> None:
    engine = _engine(llama_dir, "priority")
    priorities: list[int] = []
    add_request = engine.add_request

    def recording_add_request(*args: Any, **kwargs: Any) -> str:
        priorities.append(kwargs.get("priority", 0))
        return add_request(*args, **kwargs)

    engine.add_request = recording_add_request  # type: ignore[method-assign]
    running = start_server(engine, ServerConfig(host="127.0.0.1", port=0))
    try:
        for path, body in [
            ("/v1/completions", {"prompt": "Hello"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ]:
            response = httpx.post(
                running.url + path, json={**body, "max_tokens": 2, "priority": 7}, timeout=30
            )
            assert response.status_code == 200, response.text
    finally:
        stop_server(running)
    assert priorities == [7, 7]
