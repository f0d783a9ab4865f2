"""PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors): read and check them
against the base model's shapes, one line naming what is wrong."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from infer8.models.llama import LlamaArchConfig

# PEFT's module name -> (the fused projection it is part of, its place in the fusion)
TARGET_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.(lora_A|lora_B)\.weight$"
)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def module_shapes(arch: LlamaArchConfig) -> dict[str, tuple[int, int]]:
    """Return each target module's (in_features, out_features) in the base model."""
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    hidden, inter = arch.hidden_size, arch.intermediate_size
    return {
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
        "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }  # fmt: skip


@dataclass
class LoRAWeights:
    """One adapter's host tensors: per (layer, PEFT module) A [r, in] and B [out, r] already
    multiplied by the module's scaling (alpha / r, or alpha / sqrt(r) with rsLoRA)."""

    rank: int  # the largest module rank
    target_modules: list[str]
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _fail(path: Path, message: str) -> ValueError:
    return ValueError(f"LoRA adapter {str(path)!r}: {message}")


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise _fail(path, "no such directory")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise _fail(path, f"no {CONFIG_FILE} (a PEFT adapter directory holds it)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(path, f"{CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise _fail(path, f"{CONFIG_FILE} is not a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _fail(path, f"peft_type {peft_type} is not supported (only LORA)")
    if config.get("use_dora"):
        raise _fail(path, "DoRA (use_dora) is not supported")
    if config.get("bias", "none") != "none":
        raise _fail(path, f"trained biases (bias={config['bias']!r}) are not supported")
    if config.get("modules_to_save"):
        raise _fail(path, f"modules_to_save {config['modules_to_save']} are not supported")
    if config.get("alpha_pattern"):
        raise _fail(path, "per-module alpha_pattern is not supported")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha <= 0:
        raise _fail(path, f"lora_alpha must be a positive number, got {alpha!r}")
    return config


def read_adapter(
    path: str | Path,
    arch: LlamaArchConfig,
    max_lora_rank: int,
    dtype: torch.dtype | None = None,
) -> LoRAWeights:
    """Check an adapter against the base model and return its weights (dtype None: shapes
    are checked and no tensor is read, as at registration)."""
    path = Path(path)
    config = _read_config(path)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        other = (
            " (adapter_model.bin: convert it to safetensors)"
            if (path / "adapter_model.bin").exists()
            else ""
        )
        raise _fail(path, f"no {WEIGHTS_FILE}{other}")
    shapes = module_shapes(arch)
    alpha, use_rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora"))
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    try:
        handle = safe_open(str(weights_path), framework="pt")
    except Exception as e:  # safetensors raises its own error types for a corrupt header
        raise _fail(path, f"{WEIGHTS_FILE} is not a safetensors file ({e})") from None
    with handle as f:
        for key in f.keys():
            match = _KEY.match(key)
            if match is None:
                if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
                    raise _fail(path, f"embedding or LM-head targets are not supported ({key})")
                if "lora_magnitude_vector" in key:
                    raise _fail(path, "DoRA (use_dora) is not supported")
                raise _fail(path, f"unexpected tensor {key!r}")
            layer, module, which = int(match[1]), match[2], match[3]
            if module not in TARGET_MODULES:
                raise _fail(
                    path, f"target module {module!r} is not supported (supported: "
                    f"{', '.join(TARGET_MODULES)})",
                )  # fmt: skip
            if layer >= arch.num_hidden_layers:
                raise _fail(
                    path, f"{key} is for layer {layer}, but the base model has "
                    f"{arch.num_hidden_layers} layers (an adapter for another base model?)",
                )  # fmt: skip
            pairs.setdefault((layer, module), {})[which] = key
        if not pairs:
            raise _fail(path, f"{WEIGHTS_FILE} holds no LoRA weights")
        weights = LoRAWeights(0, sorted({m for _, m in pairs}, key=list(TARGET_MODULES).index))
        for (layer, module), keys in sorted(pairs.items()):
            if set(keys) != {"lora_A", "lora_B"}:
                raise _fail(
                    path,
                    f"layer {layer} {module} lacks its {'lora_B' if 'lora_A' in keys else 'lora_A'}",
                )
            a_shape = tuple(f.get_slice(keys["lora_A"]).get_shape())
            b_shape = tuple(f.get_slice(keys["lora_B"]).get_shape())
            in_features, out_features = shapes[module]
            rank = a_shape[0] if len(a_shape) == 2 else -1
            if a_shape != (rank, in_features) or b_shape != (out_features, rank):
                raise _fail(
                    path, f"layer {layer} {module}: lora_A {list(a_shape)} and lora_B "
                    f"{list(b_shape)} do not fit the base model's [{out_features}, {in_features}] "
                    "projection (an adapter for another base model?)",
                )  # fmt: skip
            if rank > max_lora_rank:
                raise _fail(path, f"rank {rank} is above --max-lora-rank {max_lora_rank}")
            weights.rank = max(weights.rank, rank)
            if dtype is None:
                continue
            scaling = alpha / (math.sqrt(rank) if use_rslora else rank)
            a = f.get_tensor(keys["lora_A"]).float()
            b = f.get_tensor(keys["lora_B"]).float() * scaling
            weights.modules[(layer, module)] = (a.to(dtype), b.to(dtype))
    return weights
