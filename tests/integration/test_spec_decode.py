"""Speculative decoding (n-gram drafts verified in the batch) changes no output: greedy tokens
equal those without it, for every cache dtype, with penalties, min_tokens, stop strings, EOS,
preemption and the FP8 tail's ring; the server takes vLLM's flag and counts its metrics.

The prompts repeat phrases, so drafts are proposed and many accepted (each test checks that
they were: a test where nothing is drafted would prove nothing).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from infer8 import LLM, SamplingParams
from infer8.config import EngineArgs
from infer8.core.sched_output import SchedulerStats
from infer8.engine import LLMEngine
from infer8.entrypoints.openai.cli_args import ServerConfig
from infer8.spec_decode.speculator import SpecDecodeStats, StepCostModel
from infer8.worker import spec_decode
from tests.utils import build_tiny_model, start_server, stop_server

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}  # fmt: skip
SUFFIX = {"method": "suffix"}  # vLLM's defaults: up to 24 drafts (22 with the default tail)
# long drafts whatever their odds: many accepted and many rejected tokens to roll back
EAGER_SUFFIX = {"method": "suffix", "suffix_decoding_max_spec_factor": 4.0,
                "suffix_decoding_min_token_prob": 0.0}  # fmt: skip
METHODS = {"ngram": NGRAM, "suffix": SUFFIX}


def _prompts(n: int) -> list[list[int]]:
    """Prompts that repeat a phrase (so the model's continuation often repeats too)."""
    out = []
    for k in range(n):
        phrase = [20 + (7 * k + 3 * i) % 250 for i in range(3 + k % 5)]
        filler = [30 + (11 * k + 5 * i) % 240 for i in range(5 + k % 7)]
        out.append(filler + phrase * (2 + k % 3) + filler[:3] + phrase[:2])
    return out


@pytest.fixture(autouse=True)
def free_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts look free to the cost model (it sees no step): every request drafts what it can,
    whatever this machine's speed, so each run verifies many drafts (tests/unit covers the
    model that stops them)."""
    monkeypatch.setattr(StepCostModel, "observe", lambda *args: None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("spec") / "llama")


def _generate(
    model_dir: Path, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams,
    spec: dict[str, Any] | None, **engine: Any,
) -> tuple[list[list[int]], list[str], SpecDecodeStats, int]:  # fmt: skip
    """Return each prompt's token ids and text, the run's speculation counters, preemptions."""
    engine.setdefault("kv_cache_memory_bytes", 1 << 24)
    llm = LLM(model=str(model_dir), dtype="float32", speculative_config=spec and json.dumps(spec),
              **engine)  # fmt: skip
    total, preemptions = SpecDecodeStats(), [0]

    def count(stats: SchedulerStats) -> None:
        preemptions[0] += stats.num_preemptions
        if stats.spec_decode is not None:
            total.num_drafts += stats.spec_decode.num_drafts
            total.num_draft_tokens += stats.spec_decode.num_draft_tokens
            total.num_accepted_tokens += stats.spec_decode.num_accepted_tokens

    llm.engine.stat_loggers.append(count)
    outs = llm.generate([list(p) for p in prompts], params, use_tqdm=False)
    ids, texts = [o.outputs[0].token_ids for o in outs], [o.outputs[0].text for o in outs]
    return ids, texts, total, preemptions[0]


@pytest.mark.parametrize(
    "kv_cache_dtype, extra",
    [
        ("auto", {}),
        ("bfloat16", {}),
        ("fp8_e4m3", {}),  # the exact tail's ring, sinks and rotation
        ("fp8_e5m2", {"kv_cache_exact_tail_tokens": 8, "kv_cache_exact_sink_tokens": 0}),
    ],
)
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_output_is_the_same_with_drafts(
    model_dir: Path, kv_cache_dtype: str, extra: dict[str, Any], method: str
) -> None:
    prompts = _prompts(50)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = dict(extra, kv_cache_dtype=kv_cache_dtype)
    plain, *_ = _generate(model_dir, prompts, params, None, **engine)
    spec = dict(NGRAM if method == "ngram" else EAGER_SUFFIX)
    if method == "ngram" and extra:
        spec["num_speculative_tokens"] = 6  # the most a tail of 8 allows
    drafted, _, stats, _ = _generate(model_dir, prompts, params, spec, **engine)
    # drafts made, many accepted, some rejected
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 100
    assert drafted == plain


def test_rejected_drafts_must_leave_the_tail_ring(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ring restore is what keeps FP8 outputs equal: without it the same run differs."""
    prompts = _prompts(50)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain, *_ = _generate(model_dir, prompts, params, None, kv_cache_dtype="fp8_e4m3")
    monkeypatch.setattr(spec_decode.TailRingBackup, "restore", lambda *a, **k: None)
    broken, *_ = _generate(model_dir, prompts, params, NGRAM, kv_cache_dtype="fp8_e4m3")
    assert broken != plain


def test_penalties_min_tokens_eos_and_stop_strings_keep_their_meaning(model_dir: Path) -> None:
    prompts = _prompts(24)
    base = dict(max_tokens=20, temperature=0.0)
    params = [
        SamplingParams(**base, repetition_penalty=1.3),
        SamplingParams(**base, frequency_penalty=0.8, presence_penalty=0.4),
        SamplingParams(**base, min_tokens=12),  # EOS (id 4) masked for 12 tokens, then honoured
        SamplingParams(**base, stop_token_ids=[100, 101, 102]),
    ] * 6
    plain_ids, plain_text, *_ = _generate(model_dir, prompts, params, None)
    drafted_ids, drafted_text, stats, _ = _generate(model_dir, prompts, params, NGRAM)
    assert stats.num_accepted_tokens > 20
    assert drafted_ids == plain_ids and drafted_text == plain_text
    # stop strings: cut out of each plain output's middle, then asked for
    stops = [text[len(text) // 2 : len(text) // 2 + 2] for text in plain_text]
    stop_params = [
        SamplingParams(
            max_tokens=20, temperature=0.0, ignore_eos=True, stop=[s] if s.strip() else []
        )
        for s in stops
    ]
    plain_ids, plain_text, *_ = _generate(model_dir, prompts, stop_params, None)
    drafted_ids, drafted_text, *_ = _generate(model_dir, prompts, stop_params, NGRAM)
    assert drafted_text == plain_text and drafted_ids == plain_ids


def test_preemption_with_drafts_changes_nothing(model_dir: Path) -> None:
    prompts = _prompts(16)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    # a cache of a few hundred tokens (the tail's seats take their share) for 16 requests of
    # ~70 tokens: they preempt one another
    small = dict(kv_cache_memory_bytes=80_000, max_model_len=128, kv_cache_dtype="fp8_e4m3")
    plain, *_ = _generate(model_dir, prompts, params, None, **small)
    drafted, _, stats, num_preemptions = _generate(model_dir, prompts, params, NGRAM, **small)
    assert num_preemptions > 0 and stats.num_accepted_tokens > 0
    assert drafted == plain


def test_the_tail_caps_the_draft_length(model_dir: Path) -> None:
    args = dict(kv_cache_dtype="fp8_e4m3", kv_cache_exact_tail_tokens=8)
    with pytest.raises(ValueError, match="at most 6 with this FP8 cache's exact tail"):
        _generate(model_dir, [[5, 6, 7]], SamplingParams(max_tokens=2),
                  dict(NGRAM, num_speculative_tokens=7), **args)  # fmt: skip


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_server_takes_the_flag_and_counts_vllm_metrics(model_dir: Path, method: str) -> None:
    args = EngineArgs(model=str(model_dir), dtype="float32", kv_cache_memory_bytes=1 << 24,
                      speculative_config=json.dumps(METHODS[method]))  # fmt: skip
    running = start_server(LLMEngine(args), ServerConfig())
    try:
        prompt = _prompts(3)[2]
        body = {"model": str(model_dir), "prompt": prompt, "max_tokens": 30, "temperature": 0}
        r = httpx.post(f"{running.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 30
        metrics = httpx.get(f"{running.url}/metrics", timeout=10).text
        values = {
            line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("vllm:spec_decode") and "_created" not in line
        }
        assert values["vllm:spec_decode_num_drafts_total"] >= 1
        drafts = values["vllm:spec_decode_num_draft_tokens_total"]
        assert 0 < values["vllm:spec_decode_num_accepted_tokens_total"] <= drafts
        assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in values
    finally:
        stop_server(running)


@pytest.mark.slow
@pytest.mark.real_model
def test_default_model_gives_the_same_greedy_tokens_in_float32() -> None:
    """50 input-grounded chats (the benchmark's) on SmolLM2-135M in float32, all at once."""
    from infer8.bench.spec_decode import METHODS, grounded_conversations
    from infer8.models.default_model import pull_default_model

    model = str(pull_default_model())
    params = SamplingParams(max_tokens=32, temperature=0.0)
    outputs, counts = [], []
    for spec in (None, METHODS["ngram"]):
        llm = LLM(model=model, dtype="float32", speculative_config=spec and json.dumps(spec))
        stats = SpecDecodeStats()

        def count(s: SchedulerStats, stats: SpecDecodeStats = stats) -> None:
            if s.spec_decode is not None:
                stats.num_accepted_tokens += s.spec_decode.num_accepted_tokens

        llm.engine.stat_loggers.append(count)
        chats = grounded_conversations(50)
        outs = llm.generate([llm.engine.tokenizer.encode_chat(c) for c in chats], params,
                            use_tqdm=False)  # fmt: skip
        outputs.append([o.outputs[0].token_ids for o in outs])
        counts.append(stats.num_accepted_tokens)
    assert counts[1] > 200  # the drafts were used
    assert outputs[1] == outputs[0]


def test_prefix_hits_after_drafts_give_the_same_tokens(model_dir: Path) -> None:
    """Blocks filled with accepted drafts are cached (only over accepted tokens): the same
    prompts again hit them and continue as without speculation."""
    # long enough for hits: an exact tail cuts them to multiples of 96 tokens
    prompts = [p * 3 for p in _prompts(12)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, *_ = _generate(model_dir, prompts, params, None, kv_cache_dtype="fp8_e4m3")
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_dtype="fp8_e4m3",
              kv_cache_memory_bytes=1 << 24, speculative_config=json.dumps(NGRAM))  # fmt: skip
    hits = [0]
    llm.engine.stat_loggers.append(lambda s: hits.__setitem__(0, hits[0] + s.num_prefix_cache_hits))
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    # each prompt extended by its own output: the prefix cache holds blocks of drafted tokens
    longer = [p + out[:24] for p, out in zip(prompts, first)]
    again = [o.outputs[0].token_ids for o in llm.generate(longer, params, use_tqdm=False)]
    assert first == plain
    assert hits[0] > 0
    plain_longer, *_ = _generate(model_dir, longer, params, None, kv_cache_dtype="fp8_e4m3")
    assert again == plain_longer


def test_requests_that_are_not_drafted_keep_logprobs_and_grammars(model_dir: Path) -> None:
    from infer8.structured_output import StructuredOutputsParams

    prompts = _prompts(6)
    params = [
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=16, temperature=0.0,
                       structured_outputs=StructuredOutputsParams(regex="[a-z ]{4,12}")),
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),  # drafted
    ] * 2  # fmt: skip
    llm_plain = LLM(model=str(model_dir), dtype="float32", kv_cache_memory_bytes=1 << 24)
    llm_spec = LLM(model=str(model_dir), dtype="float32", kv_cache_memory_bytes=1 << 24,
                   speculative_config=json.dumps(NGRAM))  # fmt: skip
    plain = llm_plain.generate(prompts, params, use_tqdm=False)
    drafted = llm_spec.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, drafted):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        if a.outputs[0].logprobs is not None:
            assert b.outputs[0].logprobs is not None
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert x.keys() == y.keys()
                assert all(abs(x[t] - y[t]) < 1e-4 for t in x)


def test_an_abort_mid_draft_leaves_the_others_unchanged(model_dir: Path) -> None:
    prompts = _prompts(8)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain, *_ = _generate(model_dir, prompts, params, None, kv_cache_dtype="fp8_e4m3")
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_dtype="fp8_e4m3",
              kv_cache_memory_bytes=1 << 24, speculative_config=json.dumps(NGRAM))  # fmt: skip
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    outputs: dict[str, list[int]] = {}
    for step in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outputs[out.request_id] = list(out.outputs[0].token_ids)
        if step == 3:  # after drafts were verified: abort every other request
            engine.abort_request(ids[::2])
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0
    for i in range(1, len(prompts), 2):
        assert outputs[ids[i]] == plain[i]
