"""The paged KV cache: its spec (shape and format of a block) and each layer's tensors, allocated
from the spec. The attention backends read and write it; the worker sizes and allocates it."""

from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass

import torch

from infer8.attention.exact_tail import RESIDUAL_DTYPE, hadamard
from infer8.quant import fp8

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one layer's cache block and what an element is stored as."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # storage dtype: bf16/fp16/fp32, or float8_e4m3fn / float8_e5m2
    # FP8 exact tail (attention/exact_tail.py): window W and sinks S, held as E4M3 residuals.
    exact_tail_tokens: int = 0
    exact_sink_tokens: int = 0
    hadamard: bool = False

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

    @property
    def tail_store_tokens(self) -> int:
        """Return the residual positions one seat holds: a ring of W - 1 (its newest token is
        fresh) and S sinks."""
        if not self.exact_tail_tokens:
            return 0
        return self.exact_tail_tokens - 1 + self.exact_sink_tokens

    def tail_bytes(self, num_rows: int) -> int:
        """Return the tail stores' bytes over all layers for num_rows seats.

        A residual position costs what an FP8 token does: one byte per element plus a scale
        per KV head, for K and for V.
        """
        scale = torch.empty((), dtype=fp8.SCALE_DTYPE).element_size()
        per_token = 2 * self.num_kv_heads * (self.head_dim + scale) * self.num_layers
        return num_rows * self.tail_store_tokens * per_token

    def num_blocks_for(self, memory_bytes: int, num_tail_rows: int = 0) -> int:
        """Return how many blocks fit a memory budget after the exact tail's rings."""
        return max(0, memory_bytes - self.tail_bytes(num_tail_rows)) // self.bytes_per_block


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
    # Exact tail store (attention/exact_tail.py): E4M3 residuals [2 * num_kv_heads, rows, W-1+S,
    # d] (K's heads, then V's) and their scales [2 * num_kv_heads, rows, W-1+S].
    kv_tail: tuple[torch.Tensor, torch.Tensor] | None = None
    k_rotation: torch.Tensor | None = None  # [head_dim, head_dim] float32 Hadamard, K and q
    rotate_values: bool = False

    @property
    def block_size(self) -> int:
        """Return tokens per block."""
        return self.k.shape[2]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Return a zeroed tensor; on CPU its pages are mapped lazily (RSS grows as blocks fill).

    An anonymous mapping costs no memory until written, whereas torch.zeros writes (and so
    commits) every byte up front. It asks for 4 KB pages: numpy's zeros asks for transparent
    huge pages, whose first write cost ~10x more here (192 MB in 480-1,270 ms against
    56-74 ms, a `/tmp` measurement), paid inside the steps that first fill each block.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    # the tensor holds the mapping: unmapped when the last view goes
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


def allocate_kv_cache(
    spec: KVCacheSpec, num_blocks: int, device: torch.device, num_tail_rows: int = 0
) -> list[LayerKVCache]:
    """Allocate zeroed cache tensors for every layer (zeros: masked slots must not hold NaN)."""
    shape = (spec.num_kv_heads, num_blocks, spec.block_size, spec.head_dim)
    tail_shape = (2 * spec.num_kv_heads, num_tail_rows, spec.tail_store_tokens, spec.head_dim)
    has_tail = spec.exact_tail_tokens > 0 and num_tail_rows > 0

    def tail_store() -> tuple[torch.Tensor, torch.Tensor] | None:
        if not has_tail:
            return None
        return (
            torch.zeros(tail_shape, dtype=RESIDUAL_DTYPE, device=device),
            torch.zeros(tail_shape[:-1], dtype=fp8.SCALE_DTYPE, device=device),
        )

    rotation = hadamard(spec.head_dim, device) if spec.hadamard else None
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
                kv_tail=tail_store(),
                k_rotation=rotation,
                rotate_values=spec.hadamard,
            )
        )
    return layers
