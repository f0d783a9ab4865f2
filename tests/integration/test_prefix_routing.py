"""Routing by KV events on one machine: two `infer8` servers behind a small prefix-aware picker
that reads their events (a test harness, not a product: in production llm-d's endpoint picker
does this), against round-robin on a multi-turn workload."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from infer8.config import EngineArgs
from infer8.core.block_pool import hash_block_tokens
from infer8.engine import LLMEngine
from infer8.entrypoints.openai.cli_args import ServerConfig
from tests.utils import RunningServer, build_tiny_model, start_server, stop_server
from tests.vllm_kv_events import DECODER, apply, low64

BLOCK_SIZE = 16
NUM_SESSIONS, NUM_TURNS = 7, 4  # odd: round-robin sends a session's turns to both replicas
PREFIX_TOKENS, TURN_TOKENS = 800, 48


class PrefixPicker:
    """Keeps each replica's cached block hashes from its events; routes to the longest match."""

    def __init__(self, endpoints: list[str]) -> None:
        self.ctx = zmq.Context()
        self.subs = []
        for endpoint in endpoints:
            sub = self.ctx.socket(zmq.SUB)
            sub.connect(endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            self.subs.append(sub)
        self.indexes: list[set[Any]] = [set() for _ in endpoints]
        self.num_routed = 0

    def drain(self, settle_s: float = 0.05) -> None:
        """Apply every event that has arrived, waiting until none came for settle_s."""
        poller = zmq.Poller()
        for sub in self.subs:
            poller.register(sub, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(int(settle_s * 1000)))
            if not ready:
                return
            for i, sub in enumerate(self.subs):
                while sub in ready and sub.poll(0):
                    _, _, payload = sub.recv_multipart()
                    apply(self.indexes[i], DECODER.decode(payload).events)

    def pick(self, token_ids: list[int]) -> int:
        """Return the replica holding the longest cached prefix (ties: round-robin)."""
        self.drain()
        hashes, parent = [], None
        for start in range(0, len(token_ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
            parent = hash_block_tokens(parent, token_ids[start : start + BLOCK_SIZE], None)
            hashes.append(low64(parent))
        matches = []
        for index in self.indexes:
            n = 0
            while n < len(hashes) and hashes[n] in index:
                n += 1
            matches.append(n)
        self.num_routed += 1
        best = max(matches)
        if best == 0:
            return self.num_routed % len(self.indexes)
        return matches.index(best)

    def close(self) -> None:
        for sub in self.subs:
            sub.close(linger=0)
        self.ctx.term()


@pytest.fixture()
def replicas(tmp_path: Path) -> Iterator[tuple[list[RunningServer], list[str]]]:
    # wide enough that a prompt's prefill, not the HTTP round trip, sets the time to first token
    model_dir = build_tiny_model(
        tmp_path / "model",
        "llama",
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        max_position_embeddings=1024,
    )
    endpoints = [f"ipc://{tmp_path}/events-{i}" for i in range(2)]
    servers = []
    for endpoint in endpoints:
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
        args = EngineArgs(
            model=str(model_dir),
            dtype="float32",
            kv_cache_memory_bytes=16 << 20,
            kv_events_config=json.dumps(config),
        )
        servers.append(start_server(LLMEngine(args), ServerConfig(port=0)))
    try:
        yield servers, endpoints
    finally:
        for server in servers:
            stop_server(server)


def _sessions(seed: int) -> list[list[list[int]]]:
    """Each session's prompts, turn by turn: each turn extends the last (history + a message)."""
    rng = random.Random(seed)
    sessions = []
    for _ in range(NUM_SESSIONS):
        prompt = [rng.randrange(5, 290) for _ in range(PREFIX_TOKENS)]
        turns = []
        for _ in range(NUM_TURNS):
            turns.append(list(prompt))
            prompt += [rng.randrange(5, 290) for _ in range(TURN_TOKENS)]
        sessions.append(turns)
    return sessions


def _run(servers: list[RunningServer], route: Any, seed: int) -> dict[str, float]:
    """Send every session's turns (turn by turn across sessions); return hits and latency."""

    def totals() -> tuple[float, float]:
        return (
            sum(s.metric("vllm:prefix_cache_hits_total") for s in servers),
            sum(s.metric("vllm:prefix_cache_queries_total") for s in servers),
        )

    hits0, queries0 = totals()
    latencies = []
    sessions = _sessions(seed)
    for turn in range(NUM_TURNS):
        for session in sessions:
            prompt = session[turn]
            server = servers[route(prompt)]
            body = {"prompt": prompt, "max_tokens": 1}
            start = time.perf_counter()
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            latencies.append(time.perf_counter() - start)
            assert response.status_code == 200, response.text
    hits, queries = totals()
    later = latencies[NUM_SESSIONS:]  # the turns after the first: those a cache can serve
    return {
        "hit_rate": (hits - hits0) / (queries - queries0),
        "mean_ttft_s": sum(later) / len(later),
    }


def test_prefix_aware_routing_beats_round_robin_on_multi_turn_chat(
    replicas: tuple[list[RunningServer], list[str]],
) -> None:
    servers, endpoints = replicas
    counter = iter(range(10**6))
    round_robin = _run(servers, lambda prompt: next(counter) % len(servers), seed=1)
    picker = PrefixPicker(endpoints)
    try:
        time.sleep(0.3)  # a SUB socket misses what is sent before its subscription arrives
        prefix_aware = _run(servers, picker.pick, seed=2)
        assert any(picker.indexes), "no events reached the picker"
    finally:
        picker.close()
    print(f"round-robin {round_robin}, prefix-aware {prefix_aware}")
    # Every later turn finds its whole history on the replica the picker chose.
    assert prefix_aware["hit_rate"] > round_robin["hit_rate"] + 0.15, (round_robin, prefix_aware)
    assert prefix_aware["hit_rate"] > 0.5
    assert prefix_aware["mean_ttft_s"] < round_robin["mean_ttft_s"]
