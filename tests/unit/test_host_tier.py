"""The host KV tier's bookkeeping, its flag, and the copies of whole blocks (CPU, no weights)."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import generate_latest

from infer8.attention.kv_cache import KVCacheSpec, allocate_kv_cache
from infer8.config import CacheConfig, EngineArgs
from infer8.core.host_tier import BlockContent, HostKVTier
from infer8.core.kv_cache_manager import KVCacheManager
from infer8.core.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from infer8.core.sched_output import SchedulerStats
from infer8.entrypoints.openai.cli_args import make_serve_parser, serve_args_from
from infer8.metrics import EngineMetrics
from infer8.request import Request
from infer8.sampling_params import SamplingParams
from infer8.worker.kv_offload import HostKVCache, num_host_blocks_for
from infer8.worker.memory import GiB


def _content(i: int) -> BlockContent:
    return BlockContent(None, [i] * 4, None)


def test_the_flag_is_parsed_as_vllm_takes_it_and_validated(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args, _ = serve_args_from(make_serve_parser().parse_args(["--kv-offloading-size", "2.5"]))
    assert args.kv_offloading_size == 2.5
    assert args.create_configs("m")[1].kv_offloading_size == 2.5
    assert EngineArgs().kv_offloading_size is None  # off by default, as in vLLM
    with pytest.raises(ValueError, match=r"kv_offloading_size .* must be >= 0, got -1"):
        CacheConfig(kv_offloading_size=-1)
    with pytest.raises(ValueError, match="kv_offloading_size"):
        EngineArgs(kv_offloading_size=float("nan")).create_configs("m")
    make_serve_parser().parse_args(["--kv-offloading-backend", "native"])  # what infer8 does
    with pytest.raises(SystemExit):
        make_serve_parser().parse_args(["--kv-offloading-backend", "lmcache"])
    err = capsys.readouterr().err
    assert "--kv-offloading-backend lmcache is not supported" in err


def test_size_in_gib_becomes_blocks_shared_by_ranks() -> None:
    spec = KVCacheSpec(30, 3, 64, 16, torch.bfloat16)  # the default model: 368,640 B a block
    assert num_host_blocks_for(None, spec) == num_host_blocks_for(0, spec) == 0
    assert num_host_blocks_for(1, spec) == GiB // spec.bytes_per_block == 2912
    assert num_host_blocks_for(1, spec, world_size=2) == GiB // 2 // spec.bytes_per_block


def test_lru_slots_pins_and_events() -> None:
    events: list[KVCacheEvent] = []
    tier = HostKVTier(2, events.append)
    tier.save(10, b"a", _content(1))
    tier.save(11, b"b", _content(2))
    first = tier.take_transfers()
    assert (first.save_block_ids, first.save_slots) == ([10, 11], [0, 1])
    assert tier.lookup([b"a", b"b", b"c"]) == [0, 1]
    assert tier.lookup([b"b", b"a"]) == [1, 0] and tier.lookup([b"x", b"a"]) == []
    # "a" is loaded this step: pinned, so the save that needs a slot drops "b", not "a".
    tier.pin([0])
    tier.save(12, b"c", _content(3))
    tier.load([0], [7])
    second = tier.take_transfers()
    assert (second.save_block_ids, second.save_slots) == ([12], [1])
    assert (second.load_slots, second.load_block_ids) == ([0], [7])
    assert tier.lookup([b"b"]) == [] and tier.lookup([b"a"]) == [0]
    # Both slots touched in one step: a further block is not kept (no slot is read twice).
    tier.save(13, b"d", _content(4))
    tier.save(14, b"e", _content(5))
    tier.save(15, b"f", _content(6))
    assert tier.take_transfers().save_block_ids == [13, 14]
    assert set(tier.hash_to_slot) == {b"d", b"e"}
    # An evicted block already held here is not copied again.
    tier.save(16, b"e", _content(5))
    assert tier.take_transfers().save_block_ids == []
    assert tier.clear() == 2 and tier.num_cached_blocks == 0
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [e.block_hashes[0] for e in stored] == [b"a", b"b", b"c", b"d", b"e"]
    assert all(e.medium == "CPU" and e.token_ids == e.token_ids[:1] * 4 for e in stored)
    # the load made "a" the most recent: "c" went before it
    assert [e.block_hashes for e in removed] == [[b"b"], [b"c"], [b"a"], [b"d", b"e"]]
    assert all(e.medium == "CPU" for e in removed)


def test_the_manager_saves_evicted_blocks_and_loads_host_hits() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, num_host_blocks=8)
    params = SamplingParams(max_tokens=1)
    a = Request("a", list(range(1, 13)), params, [])  # 3 full blocks
    assert kv.allocate_slots(a, 12) == [0, 1, 2]
    kv.free("a")
    b = Request("b", list(range(50, 66)), params, [])  # needs all 4 blocks: evicts a's
    assert kv.allocate_slots(b, 16) is not None
    saves = kv.take_host_transfers()
    assert sorted(saves.save_block_ids) == [0, 1, 2] and not saves.load_slots
    kv.free("b")
    c = Request("c", list(range(1, 13)) + [99], params, [])
    device_hits, _ = kv.get_computed_blocks(c)
    slots = kv.get_host_hits(c, len(device_hits))
    assert device_hits == [] and len(slots) == 3
    block_ids = kv.allocate_slots(c, 13, device_hits, slots)
    assert block_ids is not None
    loads = kv.take_host_transfers()
    assert loads.load_slots == slots and loads.load_block_ids == block_ids[:3]
    # b's blocks, evicted for c's, were saved in the same step (their copies run first).
    assert len(loads.save_block_ids) == 4
    assert kv.get_computed_blocks(c)[0] == block_ids[:3]  # back in the device cache


def test_block_copies_carry_fp8_scales_both_ways() -> None:
    spec = KVCacheSpec(2, 2, 4, 4, torch.float8_e4m3fn)
    device = allocate_kv_cache(spec, 6, torch.device("cpu"))
    for layer in device:
        layer.k.view(torch.uint8).copy_(torch.randint(0, 120, layer.k.shape, dtype=torch.uint8))
        layer.v.view(torch.uint8).copy_(torch.randint(0, 120, layer.v.shape, dtype=torch.uint8))
        assert layer.k_scale is not None and layer.v_scale is not None
        layer.k_scale.copy_(torch.rand(layer.k_scale.shape))
        layer.v_scale.copy_(torch.rand(layer.v_scale.shape))
    host = HostKVCache.allocate(spec, 3, torch.device("cpu"))
    host.save(device, [4, 1], [2, 0])
    host.load(device, [0, 2], [3, 5])
    for layer in device:
        for t in (layer.k.view(torch.uint8), layer.v.view(torch.uint8), layer.k_scale):
            assert t is not None
            assert torch.equal(t[:, 3], t[:, 1]) and torch.equal(t[:, 5], t[:, 4])


def test_host_hits_are_counted_as_vllm_counts_external_prefix_cache_hits() -> None:
    metrics = EngineMetrics("m", CacheConfig(), 16)
    metrics.on_step(
        SchedulerStats(
            num_prefix_cache_queries=42,
            num_prefix_cache_hits=8,
            num_host_cache_queries=34,
            num_host_cache_hits=32,
        )
    )
    text = generate_latest(metrics.registry).decode()
    assert 'vllm:prefix_cache_hits_total{model_name="m"} 8.0' in text
    assert 'vllm:external_prefix_cache_queries_total{model_name="m"} 34.0' in text
    assert 'vllm:external_prefix_cache_hits_total{model_name="m"} 32.0' in text
