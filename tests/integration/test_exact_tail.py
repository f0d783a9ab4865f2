"""The FP8 cache's exact tail, sinks and Hadamard rotation, against transformers and schedules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infer8 import LLM, SamplingParams
from infer8.attention.kv_cache import KVCacheSpec
from infer8.config import EngineArgs
from infer8.core.sched_output import SchedulerStats
from infer8.engine import LLMEngine
from infer8.eval.scoring import score_tokens
from tests.integration.test_numerics import PROMPTS, _record_logits
from tests.utils import hf_greedy, hf_model

FP8 = dict(dtype="float32", kv_cache_dtype="fp8_e4m3", block_size=8)


def _fp8_block_bytes(num_tail_rows: int, tail: int, sinks: int = 4) -> tuple[int, int]:
    """Return (bytes per FP8 block, tail store bytes) of the tiny llama (2 layers, 2x16 KV)."""
    spec = KVCacheSpec(2, 2, 16, 8, torch.float8_e4m3fn, tail, sinks)
    return spec.bytes_per_block, spec.tail_bytes(num_tail_rows)


def test_a_tail_covering_everything_is_transformers_at_16_bit_precision(llama_dir: Path) -> None:
    # Every token stays in the window, so every K/V read is block value + E4M3 residual (~8
    # mantissa bits): transformers' greedy tokens (float32) and its logits within 1e-2 (plain
    # FP8 is off by ~0.1 here), through chunked prefill and preemption (12 blocks are too few),
    # with the Hadamard rotation on (it leaves scores and outputs unchanged).
    # Without prefix caching (a window of 128 cuts any hit here to nothing anyway).
    block_bytes, tail_bytes = _fp8_block_bytes(6, 128)
    llm = LLM(
        str(llama_dir),
        enable_prefix_caching=False,
        kv_cache_memory_bytes=tail_bytes + 12 * block_bytes,
        max_num_seqs=6,
        max_num_batched_tokens=24,
        max_model_len=96,
        kv_cache_exact_tail_tokens=128,
        kv_cache_hadamard=True,
        **FP8,
    )
    assert llm.engine.num_blocks == 12  # the rings came out of the budget first
    stats: list[SchedulerStats] = []
    llm.engine.stat_loggers.append(stats.append)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert sum(s.num_preemptions for s in stats) > 0
    ref = hf_model(llama_dir)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 20)

    seen = _record_logits(llm)
    prompt = PROMPTS[2]
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    generated = out[0].outputs[0].token_ids
    with torch.no_grad():
        ref_logits = ref(torch.tensor([prompt + generated[:-1]])).logits[0]
    for i, ours in enumerate(seen):
        err = (ours[0] - ref_logits[len(prompt) - 1 + i]).abs().max().item()
        assert err < 1e-2, f"step {i}: max abs logits error {err}"


def _score(engine: LLMEngine, tokens: list[int], chunk: int) -> torch.Tensor:
    return score_tokens(engine, tokens, chunk_tokens=chunk)


def test_tail_reads_the_same_whatever_the_chunking_and_beats_plain_fp8(llama_dir: Path) -> None:
    tokens = [(7 * i + 3) % 500 + 5 for i in range(80)]
    common = dict(model=str(llama_dir), kv_cache_memory_bytes=1 << 22, max_num_seqs=2, **FP8)
    ref = _score(LLMEngine(EngineArgs(**{**common, "kv_cache_dtype": "auto"})), tokens, 80)
    tail = LLMEngine(
        EngineArgs(
            kv_cache_exact_tail_tokens=6,
            kv_cache_exact_sink_tokens=0,
            kv_cache_hadamard=False,
            **common,
        )
    )
    by_chunk = [_score(tail, tokens, c) for c in (1, 5, 80)]
    for other in by_chunk[1:]:  # a query reads its segment [a // 6 * 6, a] exactly, however chunked
        assert (other - by_chunk[0]).abs().max().item() < 1e-4
    plain = LLMEngine(EngineArgs(kv_cache_exact_tail_tokens=0, kv_cache_hadamard=False, **common))
    plain_lp = _score(plain, tokens, 80)

    def kl(lp: torch.Tensor) -> float:
        return (ref.exp() * (ref - lp)).sum(-1).mean().item()

    assert 0 < kl(by_chunk[2]) < kl(plain_lp)
    # the first 6 positions read only tail K/V: the 32-bit cache's within the residual's
    # precision, at a small fraction of plain FP8's error there
    tail_err = (by_chunk[2][:6] - ref[:6]).abs().max().item()
    assert tail_err < 2e-3 and tail_err < (plain_lp[:6] - ref[:6]).abs().max().item() / 10


def _generate(llm: LLM, prompts: list[list[int]], n: int = 16) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_tail_greedy_tokens_survive_chunking_preemption_and_prefix_hits(llama_dir: Path) -> None:
    tail = dict(kv_cache_exact_tail_tokens=4, kv_cache_hadamard=True, max_model_len=96, **FP8)
    roomy = LLM(str(llama_dir), kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False, **tail)
    expected = _generate(roomy, PROMPTS)
    block_bytes, tail_bytes = _fp8_block_bytes(6, 4)
    tight = LLM(
        str(llama_dir),
        kv_cache_memory_bytes=tail_bytes + 12 * block_bytes,
        max_num_seqs=6,
        max_num_batched_tokens=24,
        enable_prefix_caching=False,
        **tail,
    )
    stats: list[SchedulerStats] = []
    tight.engine.stat_loggers.append(stats.append)
    assert _generate(tight, PROMPTS) == expected
    assert sum(s.num_preemptions for s in stats) > 0

    # A prefix hit (cut to a segment start: 32 of 40 shared tokens) gives the same tokens as
    # without the cache.
    shared = list(range(200, 240))  # five 8-token blocks
    prompts = [shared + [7, 8, 9, 10, 11], shared + [12, 13, 14, 15, 16, 17]]
    cached = LLM(str(llama_dir), kv_cache_memory_bytes=1 << 22, **tail)
    cached_stats: list[SchedulerStats] = []
    cached.engine.stat_loggers.append(cached_stats.append)
    got = [_generate(cached, [p])[0] for p in prompts]
    assert sum(s.num_prefix_cache_hits for s in cached_stats) == 32
    assert got == _generate(roomy, prompts)


def test_sinks_are_shared_by_prefix_hits_and_a_hit_without_them_is_recomputed(
    llama_dir: Path,
) -> None:
    # The first request computes the shared blocks and writes its sinks (positions 0-3) into
    # the slot keyed by its first block; a request that hits those blocks reads the same sinks,
    # so it computes what it would without the cache. Once other first blocks have taken every
    # sink slot (two: max_num_seqs 2), the prefix is no hit: it is computed again, and again
    # gives the same numbers.
    tail = dict(kv_cache_exact_tail_tokens=8, kv_cache_exact_sink_tokens=4, max_model_len=96)
    shared = list(range(200, 240))  # five 8-token blocks
    prompt = shared + [12, 13, 14, 15, 16, 17]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def logits(llm: LLM, seen: list[torch.Tensor]) -> torch.Tensor:
        """Return the logits of the prompt's sampled steps."""
        n = len(seen)
        llm.generate([prompt], params)
        return torch.cat(seen[n:])

    fresh = LLM(str(llama_dir), kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False,
                **tail, **FP8)  # fmt: skip
    want = logits(fresh, _record_logits(fresh))
    cached = LLM(str(llama_dir), kv_cache_memory_bytes=1 << 22, max_num_seqs=2, **tail, **FP8)
    seen = _record_logits(cached)
    stats: list[SchedulerStats] = []
    cached.engine.stat_loggers.append(stats.append)
    cached.generate([shared + [7, 8, 9, 10, 11]], params)
    hit = logits(cached, seen)
    assert sum(s.num_prefix_cache_hits for s in stats) == 32  # 40 cut to a segment (4 x 8)
    assert (hit - want).abs().max().item() < 1e-4
    for first in (300, 400):  # two other first blocks take both sink slots
        cached.generate([list(range(first, first + 20))], params)
    num_hits = sum(s.num_prefix_cache_hits for s in stats)
    again = logits(cached, seen)
    assert sum(s.num_prefix_cache_hits for s in stats) == num_hits  # no hit this time
    assert (again - want).abs().max().item() < 1e-4


@pytest.mark.slow
def test_eval_kv_variants_reports_every_row(llama_dir: Path) -> None:
    from infer8.eval.kv_variants import VARIANTS, format_variants, run_kv_variants

    r = run_kv_variants(
        EngineArgs(model=str(llama_dir), kv_cache_memory_bytes=1 << 22),
        num_tokens=48,
        dtypes=("float32",),
        greedy_tokens=8,
    )
    assert [(x["variant"], x["text"]) for x in r["rows"]] == [
        (v, t) for v in VARIANTS for t in ("areopagitica.txt", "hamlet_act1.txt")
    ]
    names = list(VARIANTS)
    before = r["rows"][0]
    default = r["rows"][2 * names.index("e4m3 default (tail + sinks + Hadamard)")]
    assert before["exact_tail_tokens"] == 0 and not before["hadamard"]
    assert default["exact_tail_tokens"] == 24 and default["exact_sink_tokens"] == 4
    assert default["hadamard"]
    for row in r["rows"]:
        assert 0 <= row["kl_mean"] < 0.5 and 0.5 < row["top1_agreement"] <= 1.0
    assert len(r["greedy"]) == 1 + len(VARIANTS)
    assert r["greedy"][0]["greedy_identical_prompts"] == 1.0  # a tiny fp32 model: no noise
    assert (
        "| e5m2 default (tail + sinks + Hadamard) | float32 | hamlet_act1.txt | 24 | 4 | yes |"
        in (format_variants(r))
    )
