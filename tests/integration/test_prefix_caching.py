"""Automatic prefix caching end to end on a tiny float32 Llama: fewer tokens, same outputs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from infer8 import LLM, SamplingParams
from infer8.config import EngineArgs
from infer8.core.sched_output import SchedulerStats
from infer8.engine import LLMEngine
from infer8.entrypoints.openai.cli_args import ServerConfig
from tests.utils import RunningServer, start_server, stop_server

PREFIX = [5 + (i * 37) % 290 for i in range(64)]  # 4 blocks of 16
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# One block of the tiny Llama at block_size 8 in float32: layers * (k, v) * kv heads * dim * 4 * 8
BYTES_PER_BLOCK_8 = 2 * 2 * 2 * 16 * 4 * 8


def _llm(model_dir: Path, **kwargs: Any) -> LLM:
    options: dict[str, Any] = dict(dtype="float32", kv_cache_memory_bytes=1 << 22)
    options.update(kwargs)
    return LLM(str(model_dir), **options)


def _generate(
    llm: LLM, prompts: list[Any], params: SamplingParams = GREEDY
) -> tuple[list[list[int]], list[SchedulerStats]]:
    """Return the generated token ids and the stats of every step it took."""
    stats: list[SchedulerStats] = []
    llm.engine.stat_loggers.append(stats.append)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.stat_loggers.remove(stats.append)
    return [o.outputs[0].token_ids for o in outs], stats


def _hits(stats: list[SchedulerStats]) -> int:
    return sum(s.num_prefix_cache_hits for s in stats)


def test_shared_64_token_prefix_schedules_only_the_suffix(llama_dir: Path) -> None:
    first, second = PREFIX + [11, 12, 13], PREFIX + [21, 22, 23, 24, 25]
    results = {}
    for enable in (True, False):
        llm = _llm(llama_dir, enable_prefix_caching=enable)
        out_first, _ = _generate(llm, [first])
        out_second, stats = _generate(llm, [second])
        results[enable] = (out_first, out_second)
        # The step that admits the second request computes its suffix only.
        assert stats[0].admitted_req_ids and stats[0].num_scheduled_tokens == (5 if enable else 69)
        assert (stats[0].num_prefix_cache_queries, _hits(stats)) == ((69, 64) if enable else (0, 0))
        # The same 64-token prompt again, all cached and block-aligned: its last block is
        # recomputed into a fresh block so the shared one is never written.
        out_again, stats = _generate(llm, [PREFIX])
        assert stats[0].num_scheduled_tokens == (16 if enable else 64)
        results[enable] += (out_again,)
        assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.num_blocks
    assert results[True] == results[False]


def test_eviction_and_preemption_under_pressure_keep_outputs_exact(llama_dir: Path) -> None:
    # 12 blocks of 8 tokens: each round needs most of them, so cached prefixes get evicted and
    # requests preempted (they come back to the blocks they left in the cache).
    p1, p2 = PREFIX[:32], [300 - t for t in PREFIX[:32]]
    rounds = [
        [p1 + [11, 12, 13], p1 + [14, 15, 16]],
        [p2 + [17], p2 + [18, 19], p2 + [20, 21, 22]],
        [p1 + [23, 24]],
    ]
    results = {}
    hits_by_round = []
    preemptions = 0
    for enable in (True, False):
        llm = _llm(
            llama_dir,
            enable_prefix_caching=enable,
            block_size=8,
            kv_cache_memory_bytes=12 * BYTES_PER_BLOCK_8,
            max_model_len=96,
            max_num_seqs=4,
        )
        assert llm.engine.num_blocks == 12
        outs = []
        for prompts in rounds:
            tokens, stats = _generate(
                llm, prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
            )
            outs.append(tokens)
            if enable:
                hits_by_round.append(_hits(stats))
                preemptions += sum(s.num_preemptions for s in stats)
        results[enable] = outs
        assert llm.engine.kv_cache_manager.num_free_blocks == 12
    assert results[True] == results[False]
    assert hits_by_round[0] == 32 and hits_by_round[1] >= 32  # shared within a round
    assert hits_by_round[2] < 32  # round 2 evicted some of p1's blocks
    assert preemptions > 0


def test_different_cache_salts_never_share(llama_dir: Path) -> None:
    llm = _llm(llama_dir)
    prompt = PREFIX + [7, 8]

    def hits(salt: str | None) -> int:
        request: dict[str, Any] = {"prompt_token_ids": prompt}
        if salt is not None:
            request["cache_salt"] = salt
        return _hits(_generate(llm, [request])[1])

    assert hits("tenant-a") == 0
    assert hits("tenant-b") == 0
    assert hits(None) == 0
    assert hits("tenant-a") == 64 and hits("tenant-b") == 64 and hits(None) == 64
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": prompt, "cache_salt": ""}], GREEDY)


def test_fp8_cached_blocks_keep_their_values_and_scales(llama_dir: Path) -> None:
    results = {}
    for enable in (True, False):
        # Tail 0: with an exact tail, queries within W of a hit read the hit's last tokens
        # quantized (test_exact_tail.py pins outputs when >= W tokens follow the hit).
        llm = _llm(
            llama_dir,
            kv_cache_dtype="fp8_e4m3",
            enforce_eager=True,
            enable_prefix_caching=enable,
            kv_cache_exact_tail_tokens=0,
        )
        out_first, _ = _generate(llm, [PREFIX + [9]])
        pool = llm.engine.kv_cache_manager.block_pool
        cached = torch.tensor(sorted(pool.cached_block_hash_to_block.values()), dtype=torch.long)
        before = _cached_bits(llm, cached)
        out_second, stats = _generate(llm, [PREFIX + [10, 11]])
        results[enable] = (out_first, out_second)
        if enable:
            assert len(cached) >= 4 and _hits(stats) == 64
            assert all(torch.equal(a, b) for a, b in zip(_cached_bits(llm, cached), before))
    assert results[True] == results[False]


def _cached_bits(llm: LLM, block_ids: torch.Tensor) -> list[torch.Tensor]:
    """Return the raw bits of K, V and their FP8 scales in these blocks, for every layer."""
    out = []
    for cache in llm.engine.worker.kv_caches:
        for t in (cache.k, cache.v, cache.k_scale, cache.v_scale):
            assert t is not None
            blocks = t.index_select(1, block_ids)
            out.append(blocks.view(torch.uint8) if blocks.element_size() == 1 else blocks.clone())
    return out


def test_tensor_parallel_ranks_follow_the_schedulers_prefix_hits(llama_dir: Path) -> None:
    # The scheduler (rank 0) decides hits once; every rank reads the same block ids.
    first, second = PREFIX + [11, 12, 13], PREFIX + [21, 22, 23, 24, 25]
    reference = _llm(llama_dir, enable_prefix_caching=False)
    expected = [_generate(reference, [prompt])[0] for prompt in (first, second)]
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two processes on a small machine
    llm = _llm(llama_dir, tensor_parallel_size=2)
    try:
        out_first, _ = _generate(llm, [first])
        out_second, stats = _generate(llm, [second])
        assert _hits(stats) == 64 and stats[0].num_scheduled_tokens == 5
        assert [out_first, out_second] == expected
    finally:
        assert llm.engine.executor is not None
        llm.engine.executor.shutdown()
        torch.set_num_threads(num_threads)


def test_static_scheduler_ignores_prefix_caching(llama_dir: Path) -> None:
    llm = _llm(llama_dir, scheduler="static", enable_prefix_caching=True)
    assert not llm.engine.kv_cache_manager.enable_caching
    _generate(llm, [PREFIX + [1]])
    _, stats = _generate(llm, [PREFIX + [2]])
    assert _hits(stats) == 0 and stats[0].num_scheduled_tokens == 65


# -- the server --------------------------------------------------------------------------------
API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(llama_dir: Path) -> Iterator[RunningServer]:
    engine = LLMEngine(
        EngineArgs(
            model=str(llama_dir), dtype="float32", kv_cache_memory_bytes=4 << 20, max_model_len=512
        )
    )
    running = start_server(
        engine, ServerConfig(host="127.0.0.1", port=0, api_key=API_KEY, enable_server_dev_mode=True)
    )
    yield running
    stop_server(running)


def _complete(server: RunningServer, prompt: list[int], **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True, **extra}
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_reset_prefix_cache_while_a_request_runs(server: RunningServer) -> None:
    def counters() -> tuple[float, float]:
        return (
            server.metric("vllm:prefix_cache_queries_total"),
            server.metric("vllm:prefix_cache_hits_total"),
        )

    prompt = PREFIX + [3, 4, 5, 6, 7, 8]
    long_body = {"prompt": [9, 8, 7] * 20, "max_tokens": 400, "ignore_eos": True, "stream": True}
    url = f"{server.url}/v1/completions"
    with httpx.stream("POST", url, json=long_body, headers=AUTH, timeout=60) as running:
        lines = running.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        queries, hits = counters()
        first = _complete(server, prompt)
        assert counters() == (queries + 70, hits)
        second = _complete(server, prompt)
        assert counters() == (queries + 140, hits + 64)

        response = httpx.post(f"{server.url}/reset_prefix_cache", headers=AUTH)
        assert response.status_code == 200, response.text
        assert response.json()["num_dropped_blocks"] >= 4  # the prefix's blocks, nobody's now
        assert server.metric("vllm:num_requests_running") == 1.0  # the stream runs on
        pool = server.engine.kv_cache_manager.block_pool
        assert pool.num_cached_blocks > 0  # the running request's blocks stay cached

        third = _complete(server, prompt)
        assert counters() == (queries + 210, hits + 64)  # nothing of it was left
        assert first["choices"][0]["text"] == second["choices"][0]["text"]
        assert third["choices"][0]["text"] == first["choices"][0]["text"]
        # The stream was not disturbed: it keeps producing tokens after the reset.
        assert sum(1 for line in lines if line.startswith("data: ")) > 10
    assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 401  # API key guard
    server.wait_idle()
    assert server.engine.kv_cache_manager.num_free_blocks == server.engine.num_blocks


def test_cache_salt_in_the_api_isolates_tenants(server: RunningServer) -> None:
    prompt = PREFIX + [40, 41, 42]
    hits = server.metric("vllm:prefix_cache_hits_total")
    _complete(server, prompt, cache_salt="tenant-1")
    _complete(server, prompt, cache_salt="tenant-2")
    assert server.metric("vllm:prefix_cache_hits_total") == hits
    chat = {
        "messages": [{"role": "user", "content": "The quick brown fox " * 10}],
        "max_tokens": 2,
        "cache_salt": "tenant-1",
    }
    for _ in range(2):
        r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
    assert server.metric("vllm:prefix_cache_hits_total") > hits
    bad = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "hi", "cache_salt": ""}, headers=AUTH
    )
    assert bad.status_code == 400 and "cache_salt" in bad.json()["error"]["message"]
