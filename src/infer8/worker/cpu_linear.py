"""CPU linear layers over oneDNN-prepacked float32 or bf16 weights.

`F.linear` on CPU hands the weight to the BLAS in its plain [out, in] layout, and the BLAS
repacks it on every call. At decode sizes that repacking is a large part of the cost: on a
2-core AVX2 EPYC (`python benchmarks/cpu_linear.py`), the default model's projections at 32
rows ran 1.24-1.62x faster prepacked and its LM head 2.12x; at 4,096 rows (prefill) the two are
within noise (0.95-1.07x). Packing once at start-up, as inductor's freezing does, keeps the
same arithmetic in another order: results differ from `F.linear` by float32 rounding only.

bf16 is packed where oneDNN computes bf16 natively (`_is_mkldnn_bf16_supported`: CPUs with
bf16 units, where `--dtype auto` picks it): on a 2-core Zen 4 EPYC (`python
benchmarks/cpu_linear.py --dtype bfloat16`) the projections at 32-64 rows ran 1.11-1.49x faster
prepacked, the LM head 1.33-1.66x, and at 4,096 rows 1.00-1.14x.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from infer8.layers.parallel import ParallelLMHead, RowParallelLinear

logger = logging.getLogger(__name__)


_LINEAR_TYPES = (nn.Linear, RowParallelLinear, ParallelLMHead)  # exactly these, not subclasses

# Entries each of oneDNN's primitive cache and ideep's (torch's wrapper) keep; both default to
# 1,024. See bound_kernel_caches.
KERNEL_CACHE_CAPACITY = 128
_KERNEL_CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_kernel_caches(capacity: int = KERNEL_CACHE_CAPACITY) -> None:
    """Cap oneDNN's and ideep's caches of compiled matmul kernels (unless the environment
    already sets them); call before the process's first oneDNN op, which reads the settings.

    Both caches hold one JIT-compiled kernel per input shape, and a CPU step's matmuls take
    as many rows as the step has tokens, so mixed traffic keeps bringing new shapes: each
    cached shape holds ~0.6 MB whatever the weight's size, and a server's RSS grew by ~20 MB a
    minute until the default 1,024 entries were full. 128 keep the shapes of recent steps
    (five per step count for a Llama); an evicted shape is compiled again in ~1 ms.
    """
    for name in _KERNEL_CACHE_ENV:
        os.environ.setdefault(name, str(capacity))


def _packed_matmul(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """A linear layer whose weight lives only in oneDNN's packed layout (CPU, float32 / bf16).

    `after` is what the replaced layer did with its matmul's output under tensor parallelism
    (all-reduce, all-gather); None for a plain layer.
    """

    def __init__(
        self,
        linear: nn.Linear,
        batch_hint: int,
        after: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = linear.bias
        self.after = after

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """Return x @ weight.T (+ bias), before any tensor-parallel collective."""
        return _packed_matmul(x, self.packed_weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return y if self.after is None else self.after(y)


def linear_matmul(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Return a linear layer's matmul alone (packed or not, no collective): for timing."""
    if isinstance(module, PackedLinear):
        return module.matmul(x)
    if type(module) in _LINEAR_TYPES:
        return F.linear(x, module.weight, module.bias)
    return module(x)  # e.g. an FP8-weight layer: its own kernel


def packed_dtypes() -> tuple[torch.dtype, ...]:
    """Return the compute dtypes whose CPU linear weights are packed on this machine."""
    if not torch.backends.mkldnn.is_available():
        return ()
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return (torch.float32, torch.bfloat16)
    return (torch.float32,)


def packing_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Return whether CPU weight packing is used for this device and compute dtype."""
    return device.type == "cpu" and dtype in packed_dtypes()


def probe_packing(batch_hint: int, dtype: torch.dtype = torch.float32) -> str | None:
    """Return why packed linear layers cannot be used here, or None when they work and agree."""
    try:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(96, 64, generator=gen).to(dtype)
        x = torch.randn(5, 64, generator=gen).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        out = _packed_matmul(x, packed, None)
    except (RuntimeError, AttributeError) as e:
        return f"oneDNN packed linear is unavailable ({type(e).__name__}: {e})"
    ref = F.linear(x, weight)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's rounding
    if out.dtype != dtype or not torch.allclose(out, ref, rtol=tol, atol=tol):
        return (
            f"oneDNN packed linear disagrees with F.linear (max diff {(out - ref).abs().max():.2e})"
        )
    return None


def pack_linear_layers(
    model: nn.Module, batch_hint: int, dtype: torch.dtype = torch.float32
) -> int:
    """Replace the model's nn.Linear layers of `dtype` (TP ones included) with PackedLinear.

    The plain weights are dropped once packed, except a tied LM head's, which the embedding
    still reads (the packed copy is extra memory: vocab x hidden). Returns how many layers.
    """
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) not in _LINEAR_TYPES:
                continue
            if child.weight.dtype != dtype or child.weight.device.type != "cpu":
                continue
            after = (
                child.after_matmul
                if isinstance(child, RowParallelLinear | ParallelLMHead)
                else None
            )
            setattr(parent, name, PackedLinear(child, batch_hint, after))
            replaced += 1
    return replaced
