"""KV cache events: the pool's records, --kv-events-config, vLLM's wire format, the ZMQ publisher."""

from __future__ import annotations

import random
import shlex
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from infer8.config import EngineArgs, KVEventsConfig
from infer8.core import kv_events as records
from infer8.core.block_pool import BlockPool, hash_block_tokens
from infer8.entrypoints.openai.cli_args import make_serve_parser, serve_args_from
from infer8.kv_events import (
    END_SEQ,
    KVEventEncoder,
    NullEventPublisher,
    ZmqEventPublisher,
    create_event_publisher,
)
from tests.vllm_kv_events import (
    DECODER,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    apply,
    low64,
)


# -- the block pool's records ----------------------------------------------------------------
def _chain(tokens: list[int], block_size: int) -> list[bytes]:
    hashes: list[bytes] = []
    for i in range(len(tokens) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, tokens[i * block_size : (i + 1) * block_size]))
    return hashes


@pytest.mark.parametrize("seed", range(6))
def test_replayed_pool_events_equal_the_cached_set(seed: int) -> None:
    rng = random.Random(seed)
    bs = 4
    pool = BlockPool(24, enable_kv_cache_events=True)
    index: set[bytes] = set()
    held: list[list[int]] = []
    prefixes = [[rng.randrange(50) for _ in range(bs * 6)] for _ in range(3)]
    num_removed = 0
    for _ in range(300):
        action = rng.random()
        if action < 0.55:
            tokens = rng.choice(prefixes)[: bs * rng.randint(1, 6)]
            tokens = tokens + [rng.randrange(50) for _ in range(bs * rng.randint(0, 2))]
            hashes = _chain(tokens, bs)
            hits = []
            for h in hashes:
                block_id = pool.get_cached_block(h)
                if block_id is None:
                    break
                hits.append(block_id)
            num_free_hits = sum(pool.is_free(b) for b in hits)
            num_new = len(hashes) - len(hits)
            if num_new + num_free_hits > pool.num_free_blocks:
                continue
            pool.touch(hits)
            block_ids = hits + pool.allocate(num_new)
            pool.cache_full_blocks(
                block_ids,
                hashes,
                block_token_ids=[tokens[i * bs : (i + 1) * bs] for i in range(len(hashes))],
            )
            held.append(block_ids)
        elif action < 0.95 and held:
            pool.free(held.pop(rng.randrange(len(held)))[::-1])
        else:
            pool.reset_prefix_cache()
        events = pool.take_events()
        num_removed += sum(isinstance(e, records.BlockRemoved) for e in events)
        apply(index, events)
        assert index == set(pool.cached_block_hash_to_block)
    assert num_removed > 0


def test_stored_events_carry_the_chain_and_tokens() -> None:
    bs = 2
    pool = BlockPool(8, enable_kv_cache_events=True)
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = _chain(tokens, bs)
    first = pool.allocate(3)
    pool.cache_full_blocks(first, hashes, block_token_ids=[[1, 2], [3, 4], [5, 6]])
    # The same prefix computed again by another request: only the block no one caches is new.
    other = pool.allocate(1)
    extra = hash_block_tokens(hashes[2], [7, 8])
    pool.cache_full_blocks(other, [extra], parent_block_hash=hashes[2], block_token_ids=[[7, 8]])
    stored = pool.take_events()
    assert stored == [
        records.BlockStored(hashes, None, tokens, bs, [None, None, None]),
        records.BlockStored([extra], hashes[2], [7, 8], bs, [None]),
    ]
    # A private duplicate in the middle splits the run: each part names its own parent.
    dup = pool.allocate(3)
    h2 = [hash_block_tokens(None, [9, 9])]
    h2 += [hashes[0]]  # stands in for a block whose hash another block holds
    h2 += [hash_block_tokens(h2[1], [8, 8])]
    pool.cache_full_blocks(dup, h2, block_token_ids=[[9, 9], [1, 2], [8, 8]])
    assert pool.take_events() == [
        records.BlockStored([h2[0]], None, [9, 9], bs, [None]),
        records.BlockStored([h2[2]], h2[1], [8, 8], bs, [None]),
    ]


def test_reset_sends_all_cleared_only_when_nothing_stays_cached() -> None:
    pool = BlockPool(4, enable_kv_cache_events=True)
    a, b = pool.allocate(2)
    ha, hb = hash_block_tokens(None, [1]), hash_block_tokens(None, [2])
    pool.cache_full_blocks([a], [ha], block_token_ids=[[1]])
    pool.cache_full_blocks([b], [hb], block_token_ids=[[2]])
    pool.free([a])
    pool.take_events()
    pool.reset_prefix_cache()  # b is still held: it stays cached
    assert pool.take_events() == [records.BlockRemoved([ha])]
    pool.free([b])
    pool.reset_prefix_cache()
    assert pool.take_events() == [records.AllBlocksCleared()]
    assert pool.reset_prefix_cache() == 0 and pool.take_events() == []


def test_events_off_records_nothing() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_full_blocks([a], [hash_block_tokens(None, [1])])
    pool.free([a])
    pool.allocate(2)
    assert pool.take_events() == []


# -- --kv-events-config ----------------------------------------------------------------------
def test_kv_events_config_parses_vllms_json() -> None:
    config = EngineArgs(
        kv_events_config='{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", '
        '"replay_endpoint": "tcp://*:6001", "topic": "kv", "buffer_steps": 5, "hwm": 7}'
    ).create_kv_events_config()
    assert config == KVEventsConfig(
        True, "zmq", "tcp://*:6000", "tcp://*:6001", 5, 7, 100_000, "kv"
    )
    assert config.is_enabled
    assert EngineArgs().create_kv_events_config() == KVEventsConfig()
    # vLLM's default publisher follows enable_kv_cache_events.
    assert KVEventsConfig.from_json("{}").publisher == "null"
    assert not KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "publisher": "null"}'
    ).is_enabled
    assert isinstance(create_event_publisher(KVEventsConfig()), NullEventPublisher)


def test_serve_takes_vllms_kv_events_flag() -> None:
    line = (
        "/models/m --kv-events-config "
        '\'{"enable_kv_cache_events":true,"publisher":"zmq",'
        '"endpoint":"tcp://epp.llm-d.svc:5557","topic":"kv@10.0.0.7@m"}\''
    )
    ns = make_serve_parser().parse_args(shlex.split(line))
    engine_args, _ = serve_args_from(ns)
    config = engine_args.create_kv_events_config()
    assert config.is_enabled and config.endpoint == "tcp://epp.llm-d.svc:5557"
    assert config.topic == "kv@10.0.0.7@m" and config.replay_endpoint is None


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "not valid JSON"),
        ("[1]", "JSON object"),
        ('{"enable_kv_events": true}', "unknown key"),
        ('{"publisher": "kafka"}', "zmq or null"),
        ('{"buffer_steps": 0}', "buffer_steps"),
        ('{"max_queue_size": "big"}', "max_queue_size"),
    ],
)
def test_bad_kv_events_config_fails_before_loading(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model="unused", kv_events_config=text).create_configs("unused")


# -- the wire format ------------------------------------------------------------------------
def test_payload_decodes_with_vllms_structs() -> None:
    h1, h2 = bytes(range(32)), bytes(range(100, 132))
    events = [
        records.BlockStored([h1, h2], None, [1, 2, 3, 4], 2, [("salt",), None]),
        records.BlockRemoved([h1]),
        records.AllBlocksCleared(),
    ]
    payload = KVEventEncoder().encode(events, ts=12.5)
    batch = DECODER.decode(payload)
    assert batch.ts == 12.5 and batch.data_parallel_rank == 0
    stored, removed, cleared = batch.events
    assert stored == BlockStored(
        block_hashes=[low64(h1), low64(h2)],
        parent_block_hash=None,
        token_ids=[1, 2, 3, 4],
        block_size=2,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[("salt",), None],
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )
    assert removed == BlockRemoved(block_hashes=[low64(h1)], medium="GPU", group_idx=0)
    assert isinstance(cleared, AllBlocksCleared)
    # The raw shape routers parse: a positional batch, events as maps tagged by class name.
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and len(raw) == 3
    assert [e["type"] for e in raw[1]] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert list(raw[1][0])[:8] == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]
    # The largest 64-bit hash goes out unsigned; bytes mode sends the whole digest.
    top = b"\x00" * 24 + b"\xff" * 8
    assert DECODER.decode(KVEventEncoder().encode([records.BlockRemoved([top])], 0.0)).events[
        0
    ].block_hashes == [2**64 - 1]
    as_bytes = KVEventEncoder(use_int_block_hashes=False).encode([records.BlockRemoved([h2])], 0)
    assert DECODER.decode(as_bytes).events[0].block_hashes == [h2]


# -- the ZMQ publisher ----------------------------------------------------------------------
def _config(tmp_path: Path, **overrides: Any) -> KVEventsConfig:
    values: dict[str, Any] = dict(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        topic="kv@test",
    )
    values.update(overrides)
    return KVEventsConfig(**values)


def _replay(ctx: zmq.Context, endpoint: str, start_seq: int) -> list[tuple[int, bytes]]:
    """Ask the replay socket for batches from start_seq on (a DEALER: many replies per ask)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
    got = []
    try:
        while True:
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                return got
            got.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)


def test_publisher_sends_topic_seq_payload_and_replays(tmp_path: Path) -> None:
    config = _config(tmp_path, buffer_steps=3)
    publisher = ZmqEventPublisher(config)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(config.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@test")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        time.sleep(0.3)  # a PUB socket drops what it sends before the subscription arrives
        hashes = [bytes([i]) * 32 for i in range(5)]
        for h in hashes:
            publisher.publish([records.BlockRemoved([h])], ts=1.0)
        received = [sub.recv_multipart() for _ in hashes]
        assert [m[0] for m in received] == [b"kv@test"] * 5
        assert [int.from_bytes(m[1], "big") for m in received] == [0, 1, 2, 3, 4]
        decoded = [DECODER.decode(m[2]).events[0].block_hashes for m in received]
        assert decoded == [[low64(h)] for h in hashes]
        # Only the last buffer_steps batches are kept; a replay starts where it is asked to.
        replayed = _replay(ctx, config.replay_endpoint or "", 0)
        assert [seq for seq, _ in replayed] == [2, 3, 4]
        assert [p for _, p in replayed] == [m[2] for m in received[2:]]
        assert [seq for seq, _ in _replay(ctx, config.replay_endpoint or "", 4)] == [4]
    finally:
        publisher.shutdown()
        sub.close(linger=0)
        ctx.term()
    publisher.publish([records.AllBlocksCleared()], ts=2.0)  # after shutdown: dropped


def test_publisher_refuses_an_endpoint_it_cannot_open(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot open"):
        ZmqEventPublisher(_config(tmp_path, endpoint="tcp://*:notaport", replay_endpoint=None))
