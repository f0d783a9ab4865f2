"""FP8 weights: Fp8Linear (e4m3 weight + per-channel scales), quantization of bf16 linears, and
loading FP8 checkpoints (compressed-tensors / vLLM "fp8" naming) into the Llama decoder.

Weights are stored one byte each with one fp32 scale per output channel; a per-tensor
checkpoint scale is expanded to its rows, which is exact and lets the fused QKV and gate/up
projections keep each shard's own scale. On Hopper (and Ada) the matmul is torch._scaled_mm
with the activations quantized per token on the fly (or with the checkpoint's static input
scale); elsewhere the weight is dequantized and multiplied in the model dtype (the reference).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from infer8.distributed.layers import RowParallelLinear
from infer8.distributed.parallel_state import TensorParallelGroup
from infer8.models.llama import LlamaArchConfig, LlamaForCausalLM
from infer8.quant import fp8

logger = logging.getLogger(__name__)
WEIGHT_DTYPE = torch.float8_e4m3fn
# Decoder linears that hold FP8 weights (embeddings, norms and the LM head stay 16-bit).
FP8_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_PROJ_WEIGHT_RE = re.compile(r"^model\.layers\.\d+\.(?:self_attn|mlp)\.\w+_proj\.weight$")
_FP8_NAME_RE = re.compile(
    r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|weight_scale|input_scale)$"
)


def scaled_mm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """Return torch._scaled_mm's product (older torch builds return (out, amax))."""
    out = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return out[0] if isinstance(out, tuple) else out


def supports_scaled_mm(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Probe once whether torch._scaled_mm runs FP8 here; log why not (the fallback dequantizes).

    Needs CUDA with compute capability 8.9+ (Ada, Hopper), and a torch build whose kernel runs
    what Fp8Linear's forward runs: row-wise scales ([M, 1] and [1, N], fp32) with output in the
    model dtype. A 16 x 16 product is tried and checked, so a build without that kernel falls
    back at start-up, not mid-request.
    """
    why = None
    if device.type != "cuda":
        why = f"no FP8 matmul on {device.type}"
    elif torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        why = f"sm_{major}{minor} has no FP8 tensor cores (needs sm_89+)"
    else:
        try:
            a = torch.ones((16, 16), device=device).to(WEIGHT_DTYPE)
            scale_a = torch.full((16, 1), 2.0, device=device)  # per row
            scale_b = torch.full((1, 16), 0.5, device=device)  # per output channel
            out = scaled_mm(a, a.t(), scale_a, scale_b, dtype)
            if out.dtype != dtype or not bool((out == 16.0).all()):
                why = f"torch._scaled_mm gave a wrong row-wise {dtype} product"
        except (RuntimeError, TypeError) as e:
            why = f"torch._scaled_mm failed ({type(e).__name__}: {str(e).splitlines()[0]})"
    if why is not None:
        logger.info("FP8 weights: dequantize then matmul in the compute dtype: %s", why)
        return False
    logger.info("FP8 weights: torch._scaled_mm (FP8 tensor cores)")
    return True


def quantize_weight(
    weight: torch.Tensor, per_channel: bool = True, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return an e4m3 weight [out, in] and its fp32 scales [out] (per-tensor: one value, repeated).

    `amax` ([out]) overrides the weight's own per-channel maxima (a row-parallel shard's).
    """
    if amax is None:
        amax = weight.abs().amax(dim=1).float()
    if not per_channel:
        amax = amax.amax()
    scale = (amax / fp8.fp8_max(WEIGHT_DTYPE)).clamp_min(1e-12)
    scale = scale.expand(weight.shape[0]).contiguous()  # [out]
    return fp8.quantize(weight, scale[:, None], WEIGHT_DTYPE), scale


class Fp8Linear(nn.Module):
    """Owns an e4m3 weight [out, in], its per-channel scales, an optional bias and input scale."""

    weight: torch.Tensor  # [out, in] float8_e4m3fn (a buffer: never cast by Module.to)
    weight_scale: torch.Tensor  # [out] fp32
    input_scale: torch.Tensor | None  # [] fp32 static activation scale; None: per token

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        static_input_scale: bool = False,
        use_scaled_mm: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.use_scaled_mm = use_scaled_mm
        # Row-parallel under TP: this rank's partial sums are all-reduced.
        self.group: TensorParallelGroup | None = None
        w = torch.empty((out_features, in_features), dtype=WEIGHT_DTYPE, device=device)
        self.register_buffer("weight", w)
        self.register_buffer("weight_scale", torch.ones(out_features, device=device))
        self.register_buffer(
            "input_scale", torch.ones((), device=device) if static_input_scale else None
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype), requires_grad=False)
            if bias
            else None
        )

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        per_channel: bool = True,
        use_scaled_mm: bool = False,
        amax: torch.Tensor | None = None,
    ) -> Fp8Linear:
        """Quantize a 16-bit nn.Linear (online FP8, like vLLM's --quantization fp8)."""
        weight = linear.weight
        layer = cls(
            linear.in_features, linear.out_features, linear.bias is not None,
            use_scaled_mm=use_scaled_mm, device=weight.device, dtype=weight.dtype,
        )  # fmt: skip
        layer.weight, layer.weight_scale = quantize_weight(weight.detach(), per_channel, amax)
        if linear.bias is not None:
            layer.bias = linear.bias
        return layer

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Fp8Linear:
        """Move like any module, but keep the e4m3 weight and fp32 scales through .to(dtype)."""
        dtypes = {name: b.dtype for name, b in self._buffers.items() if b is not None}
        super()._apply(fn, recurse)
        for name, dtype in dtypes.items():
            buf = self._buffers[name]
            if buf is not None and buf.dtype != dtype:
                self._buffers[name] = buf.to(dtype)  # fp8 -> 16-bit -> fp8 is exact
        return self

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """Return the weight [out, in] as dtype (what the reference path multiplies by)."""
        return (self.weight.to(torch.float32) * self.weight_scale[:, None]).to(dtype)

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return x [M, in] in e4m3 and its per-row fp32 scales [M, 1] (static or per token)."""
        if self.input_scale is not None:
            scale = self.input_scale.float().expand(x.shape[0], 1).contiguous()
        else:
            amax = x.abs().amax(dim=-1, keepdim=True).float()
            scale = (amax / fp8.fp8_max(WEIGHT_DTYPE)).clamp_min(1e-12)
        return fp8.quantize(x, scale, WEIGHT_DTYPE), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return x @ W.T (+ bias) for x [..., in] (summed over the ranks when row-parallel)."""
        y = self._matmul(x)
        return y if self.group is None else self.group.all_reduce(y)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_scaled_mm:
            return F.linear(x, self.dequantized_weight(x.dtype), self.bias)
        shape = x.shape
        xq, x_scale = self.quantize_input(x.reshape(-1, self.in_features))
        y = scaled_mm(
            xq,
            self.weight.t(),  # column-major [in, out], as cuBLASLt wants the second operand
            x_scale,  # [M, 1]
            self.weight_scale[None, :],  # [1, out]
            x.dtype,
        )
        if self.bias is not None:  # not fused: not every build takes a bias with row-wise scales
            y += self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        """Describe the layer in print(model)."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, static_input_scale={self.input_scale is not None}, "
            f"use_scaled_mm={self.use_scaled_mm}"
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


def set_use_scaled_mm(model: nn.Module, use_scaled_mm: bool) -> None:
    """Choose the FP8 matmul of every Fp8Linear once (at start-up, from the device)."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.use_scaled_mm = use_scaled_mm


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
