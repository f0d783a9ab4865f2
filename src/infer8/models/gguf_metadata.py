"""A GGUF file's header as Hugging Face config: the reader opened with clear errors, the key/value
metadata as plain values, the config.json dict it implies and the weight shapes that config
needs (gguf_loader.py loads the weights, gguf_tokenizer.py rebuilds the tokenizer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType, ReaderTensor

from infer8.models.config_check import check_hf_config_fields

GGUF_MAGIC = b"GGUF"

# GGUF `general.architecture` -> (Hugging Face architecture class, model_type).
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
}


def open_reader(path: Path) -> GGUFReader:
    """Open a GGUF file, turning any parse failure into a ValueError that names the file."""
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(
            f"{path} is not a GGUF file: it starts with {magic!r}, not the magic bytes {GGUF_MAGIC!r}"
        )
    try:
        return GGUFReader(path)
    except Exception as e:  # gguf raises ValueError, IndexError, KeyError... on a bad file
        raise ValueError(
            f"{path} is a corrupt or truncated GGUF file ({path.stat().st_size} bytes): "
            f"{type(e).__name__}: {e}"
        ) from e


def read_metadata(reader: GGUFReader, path: Path) -> dict[str, Any]:
    """Return the key/value metadata as plain Python values."""
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            value = field.contents()
        except (UnicodeDecodeError, IndexError, ValueError) as e:
            raise ValueError(f"{path} has corrupt metadata under {key!r}: {e}") from e
        if field.types and field.types[0] == GGUFValueType.BOOL:
            value = bool(value)
        metadata[key] = value
    return metadata


def require(metadata: dict[str, Any], key: str, path: Path) -> Any:
    """Return a metadata value that must be present."""
    if key not in metadata:
        raise ValueError(f"{path} lacks the metadata key {key!r}")
    return metadata[key]


def _float32_to_float(value: float) -> float:
    """Return the shortest decimal that rounds to the same float32 (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def build_hf_config(
    metadata: dict[str, Any], tensors: dict[str, ReaderTensor], path: Path, dtype: torch.dtype
) -> dict[str, Any]:
    """Return a Hugging Face config.json dict from the `<arch>.*` metadata."""
    arch = require(metadata, "general.architecture", path)
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{path} has architecture {arch!r}, which infer8 cannot load; "
            f"supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    hf_architecture, model_type = ARCHITECTURES[arch]
    hidden_size = int(require(metadata, f"{arch}.embedding_length", path))
    num_heads = int(require(metadata, f"{arch}.attention.head_count", path))
    if num_heads < 1:
        raise ValueError(f"{path}: {arch}.attention.head_count must be positive, got {num_heads}")
    num_kv_heads = metadata.get(f"{arch}.attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        if len(set(num_kv_heads)) != 1:
            raise ValueError(f"{path} has a per-layer KV head count {num_kv_heads}; unsupported")
        num_kv_heads = num_kv_heads[0]
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden_size // num_heads))
    rotary_dim = int(metadata.get(f"{arch}.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ValueError(
            f"{path} applies rotary embeddings to {rotary_dim} of {head_dim} head dims; "
            "partial rotary embeddings are unsupported"
        )
    if "rope_freqs.weight" in tensors:
        raise ValueError(
            f"{path} carries per-frequency rope factors (rope_freqs.weight, Llama 3.1-style rope "
            "scaling), which infer8 cannot load from GGUF"
        )
    vocab_size = metadata.get(f"{arch}.vocab_size")
    if vocab_size is None and "token_embd.weight" in tensors:
        vocab_size = int(tensors["token_embd.weight"].shape[-1])
    if vocab_size is None:
        vocab_size = len(require(metadata, "tokenizer.ggml.tokens", path))
    config: dict[str, Any] = {
        "architectures": [hf_architecture],
        "model_type": model_type,
        "vocab_size": int(vocab_size),
        "hidden_size": hidden_size,
        "intermediate_size": int(require(metadata, f"{arch}.feed_forward_length", path)),
        "num_hidden_layers": int(require(metadata, f"{arch}.block_count", path)),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _float32_to_float(
            require(metadata, f"{arch}.attention.layer_norm_rms_epsilon", path)
        ),
        "rope_theta": _float32_to_float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(require(metadata, f"{arch}.context_length", path)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if "tokenizer.ggml.padding_token_id" in metadata:
        config["pad_token_id"] = metadata["tokenizer.ggml.padding_token_id"]
    rope_scaling = _rope_scaling(metadata, arch, path)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    if model_type == "qwen2":
        config["attention_bias"] = True
        config["use_sliding_window"] = False
    try:
        check_hf_config_fields(config)
    except ValueError as e:
        raise ValueError(f"{path}: {e} (from its {arch}.* metadata)") from None
    return config


def _rope_scaling(metadata: dict[str, Any], arch: str, path: Path) -> dict[str, Any] | None:
    """Return Hugging Face `rope_scaling` for the supported GGUF rope scaling types."""
    scaling_type = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = metadata.get(f"{arch}.rope.scaling.factor", 1.0)
    if scaling_type == "none" or factor == 1.0:
        return None
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": _float32_to_float(factor)}
    raise ValueError(f"{path} uses rope scaling {scaling_type!r}; only 'linear' is supported")


def expected_shapes(hf_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Return every Hugging Face parameter name this config needs, with its shape."""
    hidden = hf_config["hidden_size"]
    q_size = hf_config["num_attention_heads"] * hf_config["head_dim"]
    kv_size = hf_config["num_key_value_heads"] * hf_config["head_dim"]
    inter = hf_config["intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (hf_config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    if not hf_config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (hf_config["vocab_size"], hidden)
    for layer in range(hf_config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        shapes[prefix + "input_layernorm.weight"] = (hidden,)
        shapes[prefix + "post_attention_layernorm.weight"] = (hidden,)
        shapes[prefix + "self_attn.q_proj.weight"] = (q_size, hidden)
        shapes[prefix + "self_attn.k_proj.weight"] = (kv_size, hidden)
        shapes[prefix + "self_attn.v_proj.weight"] = (kv_size, hidden)
        shapes[prefix + "self_attn.o_proj.weight"] = (hidden, q_size)
        shapes[prefix + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[prefix + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[prefix + "mlp.down_proj.weight"] = (hidden, inter)
        if hf_config.get("attention_bias"):
            shapes[prefix + "self_attn.q_proj.bias"] = (q_size,)
            shapes[prefix + "self_attn.k_proj.bias"] = (kv_size,)
            shapes[prefix + "self_attn.v_proj.bias"] = (kv_size,)
    return shapes
