"""Numerics against Hugging Face transformers on tiny random-weight Llama and Qwen2 models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infer8 import LLM, SamplingParams
from infer8.core.sched_output import SchedulerStats
from infer8.layers.elementwise import TorchElementwise
from tests.utils import hf_greedy, hf_model

PROMPTS = [
    [5, 6, 7, 8, 9, 10],
    [11, 12, 13],
    list(range(20, 77)),  # longer than the token budget: prefilled in chunks
    [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311],
    [42],
    list(range(100, 131)),
]


def _record_logits(llm: LLM) -> list[torch.Tensor]:
    """Wrap compute_logits to keep every step's logits."""
    model = llm.engine.worker.model
    seen: list[torch.Tensor] = []
    orig = model.compute_logits

    def wrapped(hidden: torch.Tensor) -> torch.Tensor:
        out = orig(hidden)
        seen.append(out.clone())
        return out

    model.compute_logits = wrapped  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_match_transformers_at_every_step(arch: str, request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(f"{arch}_dir")
    llm = LLM(
        str(model_dir),
        dtype="float32",
        kv_cache_memory_bytes=1 << 22,
        max_num_seqs=1,
        max_num_batched_tokens=16,
    )
    seen = _record_logits(llm)
    # float32 on CPU: RMSNorm, RoPE and silu * up run natively (csrc/elementwise.c)
    assert not isinstance(llm.engine.worker.model.ops, TorchElementwise)
    prompt = PROMPTS[2]
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    generated = out.outputs[0].token_ids
    assert len(generated) == 8 and len(seen) == 8  # one sampled row per step (prefill chunks skip)
    ref = hf_model(model_dir)
    with torch.no_grad():
        full = torch.tensor([prompt + generated[:-1]])
        ref_logits = ref(full).logits[0]  # [len, vocab]
    for i, ours in enumerate(seen):
        pos = len(prompt) - 1 + i
        err = (ours[0] - ref_logits[pos]).abs().max().item()
        assert err < 1e-4, f"step {i}: max abs logits error {err}"


@pytest.mark.parametrize(
    ("arch", "dtype", "kv_cache_dtype"),
    [("llama", "float32", "auto"), ("qwen2", "float32", "fp8_e4m3"), ("llama", "bfloat16", "auto")],
)
def test_native_elementwise_ops_match_the_torch_ops(
    arch: str, dtype: str, kv_cache_dtype: str, request: pytest.FixtureRequest
) -> None:
    """On CPU the worker hands the model the native passes (csrc/elementwise.c); the torch ops
    compute the same layers: every step's logits (prefill chunks, mixed and all-decode batches)
    agree closely, and greedy tokens are the same."""
    model_dir: Path = request.getfixturevalue(f"{arch}_dir")
    llm = LLM(
        str(model_dir),
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory_bytes=1 << 22,
        max_num_seqs=4,
        max_num_batched_tokens=24,
        enable_prefix_caching=False,
    )
    model = llm.engine.worker.model
    assert not isinstance(model.ops, TorchElementwise)  # the native passes on CPU
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    seen = _record_logits(llm)
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    native_logits, seen[:] = list(seen), []
    model.set_elementwise_ops(TorchElementwise())
    second = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    if dtype == "float32":
        assert second == first
    assert len(seen) == len(native_logits) > 0
    # bf16 rounds each pass's output; float32 differs by summation order (~1e-7), which an FP8
    # cache can turn into a K or V element rounded one E4M3 step (1/8) the other way
    tol = 0.25 if dtype != "float32" else 5e-4 if kv_cache_dtype.startswith("fp8") else 1e-4
    for ours, theirs in zip(native_logits, seen):
        assert (ours - theirs).abs().max().item() < tol


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_batch_with_chunking_and_preemption_matches_transformers(
    arch: str, request: pytest.FixtureRequest
) -> None:
    model_dir: Path = request.getfixturevalue(f"{arch}_dir")
    # 12 blocks x 8 tokens: far less than the batch needs, so requests get preempted.
    cfg = llm_cfg = dict(dtype="float32", block_size=8, max_num_seqs=6, max_num_batched_tokens=24)
    bytes_per_block = 2 * 2 * 2 * 16 * 4 * 8  # layers * (k,v) * kv_heads * head_dim * fp32 * tokens
    llm = LLM(str(model_dir), kv_cache_memory_bytes=12 * bytes_per_block, max_model_len=96, **cfg)
    assert llm.engine.num_blocks == 12 and llm_cfg is cfg
    stats: list[SchedulerStats] = []
    llm.engine.stat_loggers.append(stats.append)
    max_tokens = 20
    outs = llm.generate(
        PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    )
    assert sum(s.num_preemptions for s in stats) > 0, "the tiny cache should force preemption"
    assert max(s.num_scheduled_tokens for s in stats) <= 24
    ref = hf_model(model_dir)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, max_tokens)
        assert out.outputs[0].finish_reason == "length"
    assert llm.engine.kv_cache_manager.num_free_blocks == 12


def test_static_baseline_matches_continuous_and_reports_padding(llama_dir: Path) -> None:
    prompts = PROMPTS[:4]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 12, 7, 5)]
    results = {}
    padded = {}
    for policy in ("continuous", "static"):
        llm = LLM(
            str(llama_dir),
            dtype="float32",
            kv_cache_memory_bytes=1 << 22,
            scheduler=policy,
            max_num_seqs=4,
        )
        stats: list[SchedulerStats] = []
        llm.engine.stat_loggers.append(stats.append)
        outs = llm.generate(prompts, params)
        results[policy] = [o.outputs[0].token_ids for o in outs]
        padded[policy] = sum(s.num_padded_tokens for s in stats)
    assert results["static"] == results["continuous"]
    lens = [len(p) for p in prompts]
    # prefill padded to the longest prompt, then one padding token per finished seat per step
    expected = sum(max(lens) - n for n in lens) + sum(12 - n for n in (3, 12, 7, 5))
    assert padded["static"] == expected
    assert padded["continuous"] == 0


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "linear", "factor": 2.0},
    ],
)
def test_rope_scaling_matches_transformers(rope_scaling: dict, tmp_path: Path) -> None:
    from tests.utils import build_tiny_model

    model_dir = build_tiny_model(
        tmp_path / "m", "llama", rope_scaling=rope_scaling, rope_theta=10000.0
    )
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory_bytes=1 << 22)
    seen = _record_logits(llm)
    prompt = list(range(20, 120))  # past original_max_position_embeddings
    generated = (
        llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
    )
    ref = hf_model(model_dir)
    assert ref.config.rope_parameters["rope_type"] == rope_scaling["rope_type"]
    with torch.no_grad():
        ref_logits = ref(torch.tensor([prompt + generated[:-1]])).logits[0]
    for i, ours in enumerate(seen):
        err = (ours[0] - ref_logits[len(prompt) - 1 + i]).abs().max().item()
        assert err < 1e-4, err


def test_mistral_sliding_window_caps_the_context(tmp_path: Path) -> None:
    import json

    from tests.utils import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "m", "llama")
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=128)
    (model_dir / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory_bytes=1 << 22)
    assert llm.engine.max_model_len == 128
