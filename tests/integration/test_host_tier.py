"""The host-memory KV tier (--kv-offloading-size) end to end on a tiny Llama: a prefix evicted
from the device cache comes back from host memory, bit for bit, instead of being recomputed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from infer8 import LLM, SamplingParams
from infer8.attention.kv_cache import KVCacheSpec
from infer8.config import KVCacheDType
from infer8.core.sched_output import SchedulerOutput, SchedulerStats
from infer8.worker.memory import GiB

PREFIX = [5 + (i * 37) % 290 for i in range(40)]  # 5 blocks of 8
FILLERS = [[300 - (i * 13 + k) % 280 for i in range(43)] for k in range(3)]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _bytes_per_block(kv_cache_dtype: str) -> int:
    """Return one block's bytes in the tiny Llama's cache at block_size 8 (scales included)."""
    dtype = KVCacheDType.parse(kv_cache_dtype).torch_dtype(torch.float32)
    return KVCacheSpec(2, 2, 16, 8, dtype).bytes_per_block


def _llm(model_dir: Path, kv_cache_dtype: str, num_blocks: int, **kwargs: Any) -> LLM:
    options: dict[str, Any] = dict(
        dtype="float32",
        block_size=8,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory_bytes=num_blocks * _bytes_per_block(kv_cache_dtype),
        max_model_len=96,
        max_num_seqs=4,
    )
    if kv_cache_dtype.startswith("fp8"):
        # whole 40-token hits: an exact tail would shorten them to its 24-token segments
        # (tests/integration/test_same_answer.py loads a prefix back with the tail on)
        options.update(kv_cache_exact_tail_tokens=0, kv_cache_hadamard=False)
    options.update(kwargs)
    return LLM(str(model_dir), **options)


def _run(llm: LLM) -> tuple[list[int], list[SchedulerStats], list[SchedulerOutput]]:
    """Serve PREFIX, three fillers one by one, then PREFIX again with another question; return
    the returning request's tokens, its steps' stats and the scheduler outputs of the run."""
    engine = llm.engine
    outputs: list[SchedulerOutput] = []
    schedule = engine.scheduler.schedule

    def record() -> SchedulerOutput:
        out = schedule()
        outputs.append(out)
        return out

    engine.scheduler.schedule = record  # type: ignore[method-assign]
    llm.generate([PREFIX + [11, 12, 13]], PARAMS, use_tqdm=False)
    for filler in FILLERS:
        llm.generate([filler], PARAMS, use_tqdm=False)
    stats: list[SchedulerStats] = []
    engine.stat_loggers.append(stats.append)
    out = llm.generate([PREFIX + [21, 22]], PARAMS, use_tqdm=False)
    engine.stat_loggers.remove(stats.append)
    return list(out[0].outputs[0].token_ids), stats, outputs


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8_e4m3"])
def test_an_evicted_prefix_returns_from_host_memory(llama_dir: Path, kv_cache_dtype: str) -> None:
    host_gib = 32 * _bytes_per_block(kv_cache_dtype) / GiB
    # 12 device blocks: each filler (7 blocks) evicts part of the prefix; three evict all of it.
    tiered = _llm(llama_dir, kv_cache_dtype, 12, kv_offloading_size=host_gib)
    assert tiered.engine.num_host_blocks == 32
    tokens, stats, outputs = _run(tiered)
    assert sum(len(o.host_save_block_ids) for o in outputs) >= 5  # the prefix went to host
    # The returning request's first step loads the prefix's 5 blocks and computes 2 tokens.
    assert stats[0].admitted_req_ids and stats[0].num_scheduled_tokens == 2
    assert (stats[0].num_prefix_cache_hits, stats[0].num_host_cache_hits) == (0, 40)
    assert stats[0].num_host_cache_queries == 42
    assert len(outputs[-len(stats)].host_load_slots) == 5

    # The same run with the prefix never evicted (a large device cache) hits the device
    # cache instead: the copies that came back from host are the K/V computed then.
    roomy = _llm(llama_dir, kv_cache_dtype, 64)
    roomy_tokens, roomy_stats, _ = _run(roomy)
    assert roomy_stats[0].num_prefix_cache_hits == 40
    assert tokens == roomy_tokens

    # Without the tier the small cache recomputes the whole prompt.
    plain = _llm(llama_dir, kv_cache_dtype, 12)
    assert plain.engine.num_host_blocks == 0
    plain_tokens, plain_stats, plain_outputs = _run(plain)
    assert plain_stats[0].num_scheduled_tokens == 42
    assert plain_stats[0].num_prefix_cache_hits == plain_stats[0].num_host_cache_queries == 0
    assert not any(o.host_save_block_ids or o.host_load_slots for o in plain_outputs)
    if kv_cache_dtype == "bfloat16":  # recomputing a bf16 cache gives the same values
        assert plain_tokens == tokens


def test_a_full_host_tier_keeps_the_most_recent_blocks(llama_dir: Path) -> None:
    # 4 host blocks: the prefix's 5 blocks and the fillers' compete, the latest evictions win.
    llm = _llm(llama_dir, "float32", 12, kv_offloading_size=4 * _bytes_per_block("float32") / GiB)
    tokens, stats, _ = _run(llm)
    tier = llm.engine.kv_cache_manager.host_tier
    assert tier is not None and tier.num_cached_blocks == 4
    assert tier.num_saved_blocks > 4
    assert stats[0].num_host_cache_hits < 40  # the prefix's first blocks were dropped
    roomy_tokens, _, _ = _run(_llm(llama_dir, "float32", 64))
    assert tokens == roomy_tokens


def test_reset_prefix_cache_empties_the_host_tier(llama_dir: Path) -> None:
    llm = _llm(llama_dir, "float32", 12, kv_offloading_size=32 * _bytes_per_block("float32") / GiB)
    _run(llm)
    tier = llm.engine.kv_cache_manager.host_tier
    assert tier is not None and tier.num_cached_blocks > 0
    llm.engine.reset_prefix_cache()
    assert tier.num_cached_blocks == 0
    stats: list[SchedulerStats] = []
    llm.engine.stat_loggers.append(stats.append)
    llm.generate([PREFIX + [31]], PARAMS, use_tqdm=False)
    assert stats[0].num_host_cache_hits == 0 and stats[0].num_scheduled_tokens == 41
