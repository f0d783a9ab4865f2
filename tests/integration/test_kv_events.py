"""KV events end to end: a ZMQ subscriber's index of an engine's cache equals its block pool."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from infer8 import LLM, SamplingParams
from infer8.core.block_pool import hash_block_tokens
from infer8.kv_events import END_SEQ
from tests.vllm_kv_events import DECODER, apply, low64

# One block of the tiny Llama at block_size 8 in float32: layers * (k, v) * kv heads * dim * 4 * 8
BYTES_PER_BLOCK_8 = 2 * 2 * 2 * 16 * 4 * 8
PREFIX = [5 + (i * 37) % 290 for i in range(32)]
PARAMS = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def _replay_all(ctx: zmq.Context, endpoint: str) -> list[tuple[int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    got = []
    try:
        while True:
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return got
            got.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)


def _run_workload(llm: LLM) -> int:
    """Prefix hits, evictions, preemptions, salted prefixes, resets; return the preemptions."""
    engine = llm.engine
    preemptions = 0

    def count(stats: Any) -> None:
        nonlocal preemptions
        preemptions += stats.num_preemptions

    engine.stat_loggers.append(count)
    p1, p2 = PREFIX, [300 - t for t in PREFIX]
    llm.generate([p1 + [11, 12, 13], p1 + [14, 15, 16]], PARAMS, use_tqdm=False)
    llm.generate([p2 + [17], p2 + [18, 19], p2 + [20, 21, 22]], PARAMS, use_tqdm=False)
    llm.generate(
        [{"prompt_token_ids": p1 + [23, 24], "cache_salt": "tenant-a"}], PARAMS, use_tqdm=False
    )
    assert engine.reset_prefix_cache() > 0  # nothing running: every block dropped
    llm.generate([p1 + [25], p2 + [26]], PARAMS, use_tqdm=False)
    # A reset while a request runs keeps the blocks it holds cached.
    engine.add_request(p2 + [27, 28], PARAMS)
    for _ in range(3):
        engine.step()
    assert engine.reset_prefix_cache() > 0
    assert engine.kv_cache_manager.block_pool.num_cached_blocks > 0
    while engine.has_unfinished_requests():
        engine.step()
    llm.generate([p2 + [29]], PARAMS, use_tqdm=False)
    engine.reset()  # the in-process restart after a failed step: every cached block is gone
    llm.generate([p1 + [30, 31]], PARAMS, use_tqdm=False)
    engine.stat_loggers.remove(count)
    return preemptions


@pytest.mark.parametrize("use_int_block_hashes", [True, False])
def test_subscriber_index_equals_the_block_pool(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, use_int_block_hashes: bool
) -> None:
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", str(int(use_int_block_hashes)))
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{tmp_path}/kv-events",
        "replay_endpoint": f"ipc://{tmp_path}/kv-replay",
        "topic": "infer8",
    }
    llm = LLM(
        str(llama_dir),
        dtype="float32",
        block_size=8,
        kv_cache_memory_bytes=12 * BYTES_PER_BLOCK_8,
        max_model_len=96,
        max_num_seqs=4,
        kv_events_config=json.dumps(config),
    )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(config["endpoint"])
    sub.setsockopt(zmq.SUBSCRIBE, b"infer8")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        time.sleep(0.3)  # a PUB socket drops what it sends before the subscription arrives
        preemptions = _run_workload(llm)
        replayed = _replay_all(ctx, config["replay_endpoint"])
        live = [sub.recv_multipart() for _ in replayed]
    finally:
        llm.engine.shutdown()
        sub.close(linger=0)
        ctx.term()

    # Every batch arrived live, in order, as the replay buffer holds it.
    assert [int.from_bytes(m[1], "big") for m in live] == list(range(len(replayed)))
    assert [m[2] for m in live] == [payload for _, payload in replayed]
    batches = [DECODER.decode(m[2]) for m in live]
    events = [e for b in batches for e in b.events]
    kinds = {type(e).__name__: 0 for e in events}
    for e in events:
        kinds[type(e).__name__] += 1
    assert kinds.get("BlockRemoved", 0) > 1 and kinds.get("AllBlocksCleared") == 2
    assert preemptions > 0

    index: set[Any] = set()
    for batch in batches:
        apply(index, batch.events)
    pool = llm.engine.kv_cache_manager.block_pool
    cached = set(pool.cached_block_hash_to_block)
    assert cached
    assert index == ({low64(h) for h in cached} if use_int_block_hashes else cached)

    stored = [e for e in events if type(e).__name__ == "BlockStored"]
    assert all(len(e.token_ids) == 8 * len(e.block_hashes) for e in stored)
    assert any(e.extra_keys and e.extra_keys[0] == ("tenant-a",) for e in stored)
    if not use_int_block_hashes:
        # The chain checks out: each block's hash is that of its parent, tokens and salt.
        for e in stored:
            parent = e.parent_block_hash
            for i, block_hash in enumerate(e.block_hashes):
                extra = e.extra_keys[i]
                tokens = e.token_ids[i * 8 : (i + 1) * 8]
                expected = hash_block_tokens(parent, tokens, None if extra is None else extra)
                assert block_hash == expected
                parent = block_hash
    assert msgspec.msgpack.decode(live[0][2])[2] == 0  # data_parallel_rank


def test_host_tier_events_replay_to_the_host_tier(llama_dir: Path, tmp_path: Path) -> None:
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{tmp_path}/kv-events",
        "replay_endpoint": f"ipc://{tmp_path}/kv-replay",
    }
    llm = LLM(
        str(llama_dir),
        dtype="float32",
        block_size=8,
        kv_cache_memory_bytes=12 * BYTES_PER_BLOCK_8,
        max_model_len=96,
        max_num_seqs=4,
        kv_events_config=json.dumps(config),
        kv_offloading_size=10 * BYTES_PER_BLOCK_8 / (1 << 30),  # 10 blocks: its LRU drops some
    )
    ctx = zmq.Context()
    try:
        _run_workload(llm)
        # After the engine reset: two fillers push p2 out to host (and older blocks out of
        # it), then p2 comes back from host.
        p2 = [300 - t for t in PREFIX]
        fillers = [[7 + (i * 11 + k) % 280 for i in range(43)] for k in (1, 2)]
        for prompt in (p2 + [40], *fillers, p2 + [42]):
            llm.generate([prompt], PARAMS, use_tqdm=False)
        batches = [
            DECODER.decode(payload) for _, payload in _replay_all(ctx, config["replay_endpoint"])
        ]
    finally:
        llm.engine.shutdown()
        ctx.term()
    events = [e for b in batches for e in b.events]
    host_stored = [e for e in events if type(e).__name__ == "BlockStored" and e.medium == "CPU"]
    host_removed = [e for e in events if type(e).__name__ == "BlockRemoved" and e.medium == "CPU"]
    assert host_stored and host_removed
    assert all(len(e.token_ids) == 8 * len(e.block_hashes) for e in host_stored)
    device, host = set(), set()
    for batch in batches:
        apply(device, batch.events, "GPU")
        apply(host, batch.events, "CPU")
    manager = llm.engine.kv_cache_manager
    assert manager.host_tier is not None and manager.host_tier.num_cached_blocks == 10
    assert device == {low64(h) for h in manager.block_pool.cached_block_hash_to_block}
    assert host == {low64(h) for h in manager.host_tier.hash_to_slot}
    assert manager.host_tier.num_loaded_blocks > 0  # prefixes came back from host too
