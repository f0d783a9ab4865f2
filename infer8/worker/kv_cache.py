"""Paged KV-cache tensors (and FP8 scales), allocated from a KVCacheSpec."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from infer8.quant import fp8


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one layer's cache block and what an element is stored as."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # storage dtype: bf16/fp16/fp32, or float8_e4m3fn / float8_e5m2

    @property
    def is_fp8(self) -> bool:
        """Return whether elements are one byte with scales beside them."""
        return self.dtype in fp8.FP8_DTYPES

    @property
    def bytes_per_token(self) -> int:
        """Return K+V bytes per token over all layers, scales included."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_layer = 2 * self.num_kv_heads * self.head_dim * elem
        if self.is_fp8:
            # one dynamic scale per token and KV head, for K and for V
            per_layer += (
                2 * self.num_kv_heads * torch.empty((), dtype=fp8.SCALE_DTYPE).element_size()
            )
        return per_layer * self.num_layers

    @property
    def bytes_per_block(self) -> int:
        """Return bytes of one block over all layers."""
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, memory_bytes: int) -> int:
        """Return how many blocks fit a memory budget."""
        return memory_bytes // self.bytes_per_block


@dataclass
class LayerKVCache:
    """One layer's cache: K and V blocks, plus per-token-head scales when stored as FP8."""

    # Head-major, so one KV head's gathered blocks are contiguous [tokens, head_dim] matrices.
    k: torch.Tensor  # [num_kv_heads, num_blocks, block_size, head_dim]
    v: torch.Tensor  # [num_kv_heads, num_blocks, block_size, head_dim]
    k_scale: torch.Tensor | None  # [num_kv_heads, num_blocks, block_size] (fp8 only)
    v_scale: torch.Tensor | None
    # Static scales (per KV head or per channel, broadcast over tokens); None means dynamic.
    k_static_scale: torch.Tensor | None = None
    v_static_scale: torch.Tensor | None = None
    num_saturated: torch.Tensor | None = None  # [] int64, values clipped on write
    # Calibration observers: per-channel running amax of K and V, [num_kv_heads, head_dim].
    k_amax: torch.Tensor | None = None
    v_amax: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        """Return tokens per block."""
        return self.k.shape[2]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Return a zeroed tensor; on CPU its pages are mapped lazily (RSS grows as blocks fill).

    numpy's zeros comes from calloc, which for large sizes maps fresh zero pages that cost no
    memory until written, whereas torch.zeros writes (and so commits) every byte up front.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(math.prod(shape) * itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


def allocate_kv_cache(
    spec: KVCacheSpec, num_blocks: int, device: torch.device
) -> list[LayerKVCache]:
    """Allocate zeroed cache tensors for every layer (zeros: masked slots must not hold NaN)."""
    shape = (spec.num_kv_heads, num_blocks, spec.block_size, spec.head_dim)
    layers = []
    for _ in range(spec.num_layers):
        scale_shape = shape[:-1]
        layers.append(
            LayerKVCache(
                k=_zeros(shape, spec.dtype, device),
                v=_zeros(shape, spec.dtype, device),
                # scales of unwritten slots are 0: they scale zeros (never divided by)
                k_scale=_zeros(scale_shape, fp8.SCALE_DTYPE, device) if spec.is_fp8 else None,
                v_scale=_zeros(scale_shape, fp8.SCALE_DTYPE, device) if spec.is_fp8 else None,
                num_saturated=torch.zeros((), dtype=torch.int64, device=device),
            )
        )
    return layers
