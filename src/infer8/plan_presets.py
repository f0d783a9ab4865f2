"""The shapes `infer8 plan` reads: model and device presets, config.json parsing, weight bytes.

Pure data and arithmetic (no torch): MODEL_PRESETS holds real Hugging Face config.json values,
DEVICE_PRESETS the memory the CUDA driver reports and the vendor's peak bandwidth.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GiB = 1 << 30
BF16_BYTES = 2
INT4_GROUP_SIZE = 128

# The real Hugging Face config.json values (the fields the planner reads).
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "qwen2-72b-instruct": {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 8192,
        "intermediate_size": 29568,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    "qwen2-7b-instruct": {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    },
    "llama-3-70b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    },
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
}


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: memory as the CUDA driver reports it, and peak memory bandwidth."""

    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    has_e4m3: bool = True  # FP8 E4M3 (sm_89+): the engine's FP8 exact tail is on by default
    # a CPU host whose engine packs its linear weights for oneDNN (worker/cpu_linear.py) keeps
    # a packed copy of a tied LM head beside the embedding it shares
    packed_tied_lm_head: bool = False


def _device(
    name: str, memory_gib: float, bandwidth_gbps: float, has_e4m3: bool = True
) -> DeviceSpec:
    return DeviceSpec(name, int(memory_gib * GiB), bandwidth_gbps * 1e9, has_e4m3)


# Memory: torch.cuda.get_device_properties().total_memory (what the engine sees), not the
# nameplate; bandwidth: the vendor's peak (SXM parts for H100 / A100).
DEVICE_PRESETS: dict[str, DeviceSpec] = {
    "h100-80gb": _device("h100-80gb", 79.11, 3350),
    "h200-141gb": _device("h200-141gb", 139.80, 4800),
    "a100-80gb": _device("a100-80gb", 79.21, 2039, has_e4m3=False),
    "l4-24gb": _device("l4-24gb", 22.03, 300),
}
WEIGHT_DTYPES = ("bf16", "fp8", "int4")


@dataclass(frozen=True)
class ModelShape:
    """The parts of a Llama-family config.json that decide memory."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str) -> ModelShape:
        """Parse a config.json dict (q/k/v biases default on for Qwen2, as the loader does)."""
        archs = cfg.get("architectures") or []
        is_qwen2 = cfg.get("model_type") == "qwen2" or "Qwen2ForCausalLM" in archs
        num_heads = cfg["num_attention_heads"]
        bias = cfg.get("attention_bias")
        return cls(
            name=name,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 if bias is None else bool(bias),
        )

    @property
    def num_linear_params(self) -> int:
        """Return the decoder's projection weights (what fp8 / int4 quantize)."""
        h, q_size = self.hidden_size, self.num_attention_heads * self.head_dim
        kv_size = self.num_key_value_heads * self.head_dim
        attn = h * (q_size + 2 * kv_size) + q_size * h
        mlp = 3 * h * self.intermediate_size
        return self.num_hidden_layers * (attn + mlp)

    @property
    def num_params(self) -> int:
        """Return all parameters: projections, q/k/v biases, norms, embedding and LM head."""
        q_size = self.num_attention_heads * self.head_dim
        kv_size = self.num_key_value_heads * self.head_dim
        biases = (q_size + 2 * kv_size) if self.attention_bias else 0
        norms = 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        per_layer_rest = biases + norms
        return (
            self.num_linear_params
            + self.num_hidden_layers * per_layer_rest
            + self.hidden_size  # final norm
            + embeddings
        )

    def weight_bytes(self, weight_dtype: str) -> int:
        """Return the bytes of all weights stored as `weight_dtype` (the rotary tables too)."""
        linear = self.num_linear_params
        # cos and sin, head_dim / 2 each, for every position: buffers in the model's dtype
        rope_bytes = self.max_position_embeddings * self.head_dim * BF16_BYTES
        rest_bytes = (self.num_params - linear) * BF16_BYTES + rope_bytes
        if weight_dtype == "bf16":
            return self.num_params * BF16_BYTES + rope_bytes
        if weight_dtype == "fp8":
            return linear + rest_bytes
        if weight_dtype == "int4":
            scales = math.ceil(linear / INT4_GROUP_SIZE) * BF16_BYTES
            return math.ceil(linear / 2) + scales + rest_bytes
        raise ValueError(f"unknown weight dtype {weight_dtype!r}; choose one of {WEIGHT_DTYPES}")


def load_model_shape(model: str) -> ModelShape:
    """Return the shape of a preset, named as a preset, a Hugging Face id or a plain name
    (`Qwen/Qwen2-72B-Instruct`, `qwen2-72b`), or read a config.json (or a directory holding one).
    """
    if model in MODEL_PRESETS:
        return ModelShape.from_hf_config(MODEL_PRESETS[model], model)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return ModelShape.from_hf_config(json.loads(path.read_text()), str(model))
    preset = model_preset_name(model)
    if preset is None:
        raise ValueError(
            f"model {model!r} is neither a preset ({', '.join(MODEL_PRESETS)}; Hugging Face ids "
            "and plain names of these work too) nor a config.json file or model directory"
        )
    return ModelShape.from_hf_config(MODEL_PRESETS[preset], preset)


def model_preset_name(model: str) -> str | None:
    """Return the preset a Hugging Face id or plain name stands for, or None.

    Case and the organisation are ignored, as are a `Meta-` prefix and an `-Instruct` suffix
    (the instruct and base models share one shape): `meta-llama/Meta-Llama-3-8B-Instruct` is
    llama-3-8b, `Qwen2-72B` is qwen2-72b-instruct.
    """
    name = model.strip().lower().rsplit("/", 1)[-1].removeprefix("meta-")
    base = name.removesuffix("-instruct")
    for candidate in (name, base, f"{base}-instruct"):
        if candidate in MODEL_PRESETS:
            return candidate
    return None


def device_preset_name(device: str) -> str | None:
    """Return the device preset a name stands for, in any case: `H100`, `h200-141gb`, `L4`."""
    name = device.strip().lower()
    if name in DEVICE_PRESETS:
        return name
    matches = [preset for preset in DEVICE_PRESETS if preset.split("-", 1)[0] == name]
    return matches[0] if len(matches) == 1 else None
