"""Keys less a constant per channel: exact for attention, and what lets an FP8 cache hold
Qwen2's keys, whose k_proj bias puts offsets of 100-200 in a few slowly rotating channels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.eval.scoring import score_tokens
from tests.utils import build_tiny_model

TOKENS = [(7 * i + 3) % 300 for i in range(200)]


@pytest.fixture(scope="module")
def biased_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 whose k bias, like Qwen2.5's, is huge in RoPE's slowest pairs."""
    model_dir = build_tiny_model(
        tmp_path_factory.mktemp("key_offsets"), "qwen2", rope_theta=1_000_000.0
    )
    path = model_dir / "model.safetensors"
    weights = load_file(path)
    head_dim = 16
    for name, bias in weights.items():
        if name.endswith("k_proj.bias"):
            heads = bias.view(-1, head_dim)
            heads[:, head_dim // 2 - 1] += 150.0  # the slowest pair: channels 7 and 15
            heads[:, head_dim - 1] -= 200.0
    save_file(weights, path, metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    assert (config.get("rope_parameters") or config)["rope_theta"] == 1_000_000.0
    return model_dir


def _engine(model_dir: Path, kv_cache_dtype: str) -> LLMEngine:
    return LLMEngine(
        EngineArgs(
            model=str(model_dir),
            dtype="float32",
            kv_cache_dtype=kv_cache_dtype,
            kv_cache_memory_bytes=8 << 20,
            enable_prefix_caching=False,
        )
    )


def _clear_offsets(engine: LLMEngine) -> None:
    for layer in engine.worker.model.layers:
        layer.self_attn.k_offset = None


def _kl(ref: torch.Tensor, test: torch.Tensor) -> float:
    return (ref.exp() * (ref - test)).sum(-1).mean().item()


def test_offsets_leave_a_float32_cache_s_answers_unchanged(biased_dir: Path) -> None:
    engine = _engine(biased_dir, "float32")
    assert all(layer.self_attn.k_offset is None for layer in engine.worker.model.layers)
    plain = score_tokens(engine, TOKENS)
    assert engine.worker.model.set_key_offsets(engine.max_model_len) == 2
    offset = engine.worker.model.layers[0].self_attn.k_offset
    assert offset is not None and offset.abs().max() > 100  # the bias's offsets, rotated
    shifted = score_tokens(engine, TOKENS)
    # Only float32 rounding differs: keys of ~200 lose ~200 * 2^-24 each, and q.c cancels
    # in the softmax up to the rounding of scores of that size.
    assert (shifted - plain).abs().max() < 1e-3


def test_an_fp8_cache_quantizes_keys_less_their_offsets(biased_dir: Path) -> None:
    reference = score_tokens(_engine(biased_dir, "float32"), TOKENS)
    engine = _engine(biased_dir, "fp8_e4m3")
    assert all(layer.self_attn.k_offset is not None for layer in engine.worker.model.layers)
    with_offsets = _kl(reference, score_tokens(engine, TOKENS))
    _clear_offsets(engine)
    without = _kl(reference, score_tokens(engine, TOKENS))
    assert with_offsets < without / 4, (with_offsets, without)
