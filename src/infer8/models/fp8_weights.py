"""FP8 weights of the Llama decoder: quantizing its 16-bit linears (at load or after), and
loading and saving FP8 checkpoints (compressed-tensors / vLLM "fp8" naming)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from infer8.layers.fp8_linear import (
    FP8_LINEARS,
    WEIGHT_DTYPE,
    Fp8Linear,
    quantize_weight,
    supports_scaled_mm,
)
from infer8.layers.parallel import RowParallelLinear
from infer8.models.llama import LlamaArchConfig, LlamaForCausalLM

logger = logging.getLogger(__name__)
_PROJ_WEIGHT_RE = re.compile(r"^model\.layers\.\d+\.(?:self_attn|mlp)\.\w+_proj\.weight$")
_FP8_NAME_RE = re.compile(
    r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|weight_scale|input_scale)$"
)


def _decoder_linears(model: LlamaForCausalLM) -> Iterator[tuple[nn.Module, str, nn.Module]]:
    """Yield (parent, attribute name, module) for every decoder linear that can be FP8."""
    for layer in model.layers:
        parents: tuple[nn.Module, ...] = (layer.self_attn, layer.mlp)  # type: ignore[assignment]
        for parent in parents:
            for name in FP8_LINEARS:
                if hasattr(parent, name):
                    yield parent, name, getattr(parent, name)


def _check_plain_linear(module: nn.Module, name: str) -> None:
    """Refuse to swap anything but a plain or row-parallel nn.Linear."""
    if type(module) not in (nn.Linear, RowParallelLinear):
        raise ValueError(
            f"FP8 weights replace plain nn.Linear layers; {name} is a {type(module).__name__}"
        )


def quantize_model_weights(
    model: LlamaForCausalLM, per_channel: bool = True, use_scaled_mm: bool = False
) -> None:
    """Replace every decoder nn.Linear by an Fp8Linear quantized from its weights, in place.

    Under tensor parallelism the column-parallel shards (qkv, gate_up) quantize on their own
    (their output channels are whole); a row-parallel shard (o_proj, down_proj) holds a slice
    of each output channel's inputs, so its per-channel scales take the amax over every rank:
    the dequantized weights equal TP=1's, and each rank's partial sum is all-reduced.
    """
    for parent, name, linear in list(_decoder_linears(model)):
        _check_plain_linear(linear, name)
        group = linear.group if isinstance(linear, RowParallelLinear) else None
        amax = None
        if group is not None:
            local = linear.weight.detach().abs().amax(dim=1).float()  # [out]
            amax = group.all_gather(local[:, None]).amax(dim=-1)  # [out], over every rank
        layer = Fp8Linear.from_linear(linear, per_channel, use_scaled_mm, amax=amax)
        layer.group = group
        setattr(parent, name, layer)


def quantize_weights_on_load(
    weights: Iterator[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
    per_channel: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield each 16-bit decoder projection weight as e4m3 plus its `weight_scale` [out], the
    rest as is (online FP8, like vLLM's --quantization fp8), one tensor at a time.

    Each weight is cast to the model dtype on the device and quantized there, so the device
    never holds more than one 16-bit projection; the values equal quantize_model_weights' on
    the 16-bit model (per-channel scales are per row, so a fused or sharded module's rows
    quantize alone; a row-parallel shard takes its row's amax over the whole row here).
    """
    for name, tensor in weights:
        if _PROJ_WEIGHT_RE.match(name) and tensor.dtype != WEIGHT_DTYPE:
            weight, scale = quantize_weight(tensor.to(device=device, dtype=dtype), per_channel)
            yield name, weight
            yield f"{name}_scale", scale
        else:
            yield name, tensor


# -- checkpoints -----------------------------------------------------------------------------


def fp8_checkpoint_scheme(hf_config: dict[str, Any]) -> dict[str, Any] | None:
    """Return {"static_input_scale": bool} for an FP8-weight checkpoint, None if not FP8.

    Understands compressed-tensors (float, 8 bits, strategy tensor or channel) and the vLLM /
    AutoFP8 "fp8" method; refuses block-wise scales (weight_block_size) with a clear error.
    """
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise ValueError(
                "block-wise FP8 checkpoints (weight_block_size, weight_scale_inv) are not "
                "supported; use a per-tensor or per-channel FP8 checkpoint"
            )
        return {"static_input_scale": qc.get("activation_scheme", "dynamic") == "static"}
    if method == "compressed-tensors":
        groups = list((qc.get("config_groups") or {}).values())
        if not groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        weights = groups[0].get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ValueError(
                f"unsupported compressed-tensors weights {weights}; infer8 loads FP8 "
                "(type float, num_bits 8) weights only"
            )
        if weights.get("strategy") not in ("tensor", "channel"):
            raise ValueError(
                f"unsupported FP8 weight strategy {weights.get('strategy')!r} "
                "(supported: tensor, channel)"
            )
        acts = groups[0].get("input_activations") or {}
        return {"static_input_scale": bool(acts) and not acts.get("dynamic", True)}
    raise ValueError(
        f"unsupported quantization method {method!r} (infer8 loads FP8 weights from "
        "compressed-tensors or vLLM fp8 checkpoints)"
    )


def replace_linears_for_checkpoint(
    model: LlamaForCausalLM, static_input_scale: bool, use_scaled_mm: bool
) -> None:
    """Swap decoder linears for empty Fp8Linear modules (call on the meta-device model)."""
    for parent, name, linear in list(_decoder_linears(model)):
        _check_plain_linear(linear, name)
        device = linear.weight.device
        layer = Fp8Linear(
            linear.in_features, linear.out_features, linear.bias is not None,
            static_input_scale, use_scaled_mm, device, linear.weight.dtype,
        )  # fmt: skip
        # row-parallel under TP: this rank's partial sums are all-reduced
        layer.group = linear.group if isinstance(linear, RowParallelLinear) else None
        setattr(parent, name, layer)


class Fp8CheckpointLoader:
    """Routes an FP8 checkpoint's decoder weights and scales into a model's Fp8Linear modules.

    Owns the bookkeeping of which rows of which module have a weight and a scale, so `finish`
    can refuse a checkpoint with missing pieces.
    """

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self._loaded: dict[tuple[int, str, str], int] = {}  # (layer, module, kind) -> rows
        self._has_input_scale: set[tuple[int, str, str]] = set()

    def _rows(self, fused: str, proj: str, module: str) -> slice:
        """Return the rows of fused module `fused` that checkpoint projection `proj` fills."""
        cfg: LlamaArchConfig = self.model.config
        if fused == proj:
            return slice(None)
        if module == "self_attn":
            q = cfg.num_attention_heads * cfg.head_dim
            kv = cfg.num_key_value_heads * cfg.head_dim
            bounds = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
        else:
            i = cfg.intermediate_size
            bounds = {"gate_proj": (0, i), "up_proj": (i, 2 * i)}
        return slice(*bounds[proj])

    def load(self, name: str, tensor: torch.Tensor) -> bool:
        """Take one checkpoint tensor if it is an FP8 weight or scale; return whether taken."""
        m = _FP8_NAME_RE.match(name)
        if m is None:
            return False
        layer_idx, module, proj, kind = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if kind == "weight" and tensor.dtype != WEIGHT_DTYPE:
            return False  # a 16-bit weight: the plain loader's business (or an error there)
        fused = {
            "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
            "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
        }.get(proj, proj)  # fmt: skip
        parent = getattr(self.model.layers[layer_idx], module)
        target = getattr(parent, fused, None)
        if not isinstance(target, Fp8Linear):
            raise ValueError(f"{name}: the model has no FP8 linear {module}.{fused} there")
        rows = self._rows(fused, proj, module)
        if kind == "weight":
            dest = target.weight[rows]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            n = dest.shape[0]
        elif kind == "weight_scale":
            dest = target.weight_scale[rows]
            if tensor.numel() not in (1, dest.numel()):
                raise ValueError(
                    f"{name} has {tensor.numel()} values; expected 1 (per tensor) or "
                    f"{dest.numel()} (per channel)"
                )
            scale = tensor.float().reshape(-1)
            if not torch.isfinite(scale).all() or (scale <= 0).any():
                raise ValueError(f"{name} must be finite and positive")
            dest.copy_(scale.expand(dest.numel()))
            n = dest.numel()
        else:  # input_scale: one per module input; fused shards share it, keep the largest
            if target.input_scale is None:
                raise ValueError(
                    f"{name}: the checkpoint has static input scales but its config says dynamic"
                )
            value = tensor.float().reshape(-1).max()
            seen = (layer_idx, module, fused)
            if seen in self._has_input_scale:
                value = torch.maximum(target.input_scale, value)
            target.input_scale.copy_(value)
            self._has_input_scale.add(seen)
            n = 1
        key = (layer_idx, module, f"{fused}.{kind}")
        self._loaded[key] = self._loaded.get(key, 0) + n
        return True

    def finish(self) -> None:
        """Raise ValueError if any Fp8Linear lacks weight rows, scales or its input scale."""
        for i, layer in enumerate(self.model.layers):
            for module in ("self_attn", "mlp"):
                parent = getattr(layer, module)
                for fused in FP8_LINEARS:
                    target = getattr(parent, fused, None)
                    if not isinstance(target, Fp8Linear):
                        continue
                    kinds = ["weight", "weight_scale"]
                    if target.input_scale is not None:
                        kinds.append("input_scale")
                    for kind in kinds:
                        # fused shards each bring their input scale; one is enough
                        want = 1 if kind == "input_scale" else target.out_features
                        got = self._loaded.get((i, module, f"{fused}.{kind}"), 0)
                        if got < want:
                            raise ValueError(
                                f"FP8 checkpoint is missing {kind} for "
                                f"model.layers.{i}.{module}.{fused}"
                            )


def load_fp8_model(
    model_path: str | Path, dtype: torch.dtype, device: torch.device
) -> tuple[LlamaForCausalLM, dict[str, Any], dict[int, dict[str, torch.Tensor]]]:
    """Load an FP8-weight Hugging Face directory (loader.load_model's FP8 path).

    The decoder linears are swapped for Fp8Linear on the meta device, so the 16-bit weights
    are never allocated: a 72B model's linears take ~68 GB instead of ~136.
    """
    from infer8.models.loader import iter_safetensors, load_weights, read_hf_config

    path = Path(model_path)
    hf_config = read_hf_config(path)
    scheme = fp8_checkpoint_scheme(hf_config)
    if scheme is None:
        raise ValueError(f"{path} is not an FP8 checkpoint (no quantization_config)")
    cfg = LlamaArchConfig.from_hf_config(hf_config)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(dtype)
        replace_linears_for_checkpoint(
            model, scheme["static_input_scale"], supports_scaled_mm(device, dtype)
        )
    model = model.to_empty(device=device)
    model.init_rope_tables()  # to_empty left the rotary tables uninitialised
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    fp8_loader = Fp8CheckpointLoader(model)
    with torch.no_grad():
        rest = ((n, t) for n, t in iter_safetensors(path) if not fp8_loader.load(n, t))
        kv_scales = load_weights(model, rest)
    fp8_loader.finish()
    model.eval()
    return model, hf_config, kv_scales


def save_fp8_checkpoint(
    model_dir: str | Path, out_dir: str | Path, per_channel: bool = True
) -> None:
    """Write an FP8 (compressed-tensors naming) copy of a 16-bit Hugging Face directory."""
    from safetensors.torch import save_file

    from infer8.models.loader import iter_safetensors

    src, dst = Path(model_dir), Path(out_dir)
    dst.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    proj_re = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")
    for name, tensor in iter_safetensors(src):
        if proj_re.match(name):
            w, scale = quantize_weight(tensor, per_channel)
            tensors[name] = w.contiguous()
            base = name.removesuffix(".weight")
            tensors[f"{base}.weight_scale"] = (scale[:, None] if per_channel else scale[:1]).clone()
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "channel" if per_channel else "tensor",
                    "symmetric": True,
                    "dynamic": False,
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "token",
                    "dynamic": True,
                },  # fmt: skip
            }
        },
        "ignore": ["lm_head"],
    }
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    for extra in src.iterdir():
        if extra.name not in ("config.json",) and extra.suffix != ".safetensors":
            (dst / extra.name).write_bytes(extra.read_bytes())
