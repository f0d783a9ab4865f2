"""The decoder's element-wise passes (RMSNorm with the residual add, RoPE, silu * up) as one
object the model is handed: plain torch here; the CPU backend's native passes have the same
methods (attention/cpu), and the worker picks one at start-up."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class ElementwiseOps(Protocol):
    """What a decoder layer computes between its matmuls."""

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, add: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Return weight * x / rms(x) over x's rows [n, h]; with `add`, x += add in place first."""
        ...

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Return x [n, heads, d] rotated by cos, sin [n, d / 2] (may rotate x in place)."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Return silu(gate) * up for gate_up [n, 2 * inter] (gate first): [n, inter]."""
        ...


class TorchElementwise:
    """ElementwiseOps in torch ops, computed as transformers computes them."""

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, add: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Normalize the last dim in float32; with `add`, first x += add (the residual stream)."""
        if add is not None:
            x.add_(add)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate halves of the head dim (transformers' rotate_half convention); a new tensor."""
        return apply_rope(x, cos[:, None], sin[:, None])

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Return silu(gate) * up."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves of the head dim (transformers' rotate_half convention).

    x: [num_tokens, heads, head_dim]; cos, sin: [num_tokens, 1, head_dim / 2] in x's dtype.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
