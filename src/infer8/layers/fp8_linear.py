"""Fp8Linear: an e4m3 weight with per-channel scales, and the FP8 matmul it runs.

Weights are stored one byte each with one fp32 scale per output channel; a per-tensor
checkpoint scale is expanded to its rows, which is exact and lets the fused QKV and gate/up
projections keep each shard's own scale. On Hopper (and Ada) the matmul is torch._scaled_mm
with the activations quantized per token on the fly (or with the checkpoint's static input
scale); elsewhere the weight is dequantized and multiplied in the model dtype (the reference).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from infer8.distributed.parallel_state import TensorParallelGroup
from infer8.quant import fp8

logger = logging.getLogger(__name__)
WEIGHT_DTYPE = torch.float8_e4m3fn
# Decoder linears that hold FP8 weights (embeddings, norms and the LM head stay 16-bit).
FP8_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


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
