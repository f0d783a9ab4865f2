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


SCALE_MODES = ("none", "dynamic", "static")


@dataclass(frozen=True)
class KVCacheFormat:
    """How a cache stores a token, decided once from the config; every backend reads it here.

    - dtype: bf16/fp16/fp32, or float8_e4m3fn / float8_e5m2 (one byte an element);
    - scale: "none" (16/32-bit), "dynamic" (an FP8 scale per token and KV head, stored beside
      the block) or "static" (one per KV head or channel for the whole cache, from a file);
    - exact tail (attention/exact_tail.py): each sequence's last W and first S tokens read as
      block value + an E4M3 residual kept in a per-seat store;
    - hadamard: K and V (and q, and the output back) rotated per head before quantizing.
    """

    dtype: torch.dtype
    scale: str = "none"
    exact_tail_tokens: int = 0
    exact_sink_tokens: int = 0
    hadamard: bool = False

    def __post_init__(self) -> None:
        is_fp8 = self.dtype in fp8.FP8_DTYPES
        if self.scale not in SCALE_MODES or (self.scale == "none") == is_fp8:
            raise ValueError(f"a {self.dtype} cache cannot use scale {self.scale!r}")
        if not is_fp8 and (self.exact_tail_tokens or self.exact_sink_tokens or self.hadamard):
            raise ValueError("the exact tail and the rotation apply to FP8 caches only")
        if self.exact_sink_tokens and not self.exact_tail_tokens:
            raise ValueError("exact sink tokens need an exact tail (they share its store)")
        if self.hadamard and self.scale == "static":
            raise ValueError("a rotated cache needs dynamic scales (static ones are calibrated "
                             "on unrotated K)")  # fmt: skip

    @property
    def is_fp8(self) -> bool:
        """Return whether elements are one byte with scales beside them."""
        return self.scale != "none"

    @property
    def has_tail(self) -> bool:
        """Return whether a per-seat residual store keeps the tail (and sinks) exact."""
        return self.exact_tail_tokens > 0

    @property
    def tail_store_tokens(self) -> int:
        """Return the residual positions one seat holds: a ring of W - 1 (its newest token is
        fresh) and S sinks."""
        if not self.exact_tail_tokens:
            return 0
        return self.exact_tail_tokens - 1 + self.exact_sink_tokens


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one layer's cache block and its format (KVCacheFormat's fields, flat)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # storage dtype: bf16/fp16/fp32, or float8_e4m3fn / float8_e5m2
    # FP8 exact tail (attention/exact_tail.py): window W and sinks S, held as E4M3 residuals.
    exact_tail_tokens: int = 0
    exact_sink_tokens: int = 0
    hadamard: bool = False
    kv_scale: str = "dynamic"  # FP8 only: dynamic or static

    def __post_init__(self) -> None:
        _ = self.format  # validates the format's fields

    @property
    def format(self) -> KVCacheFormat:
        """Return how a token is stored."""
        return KVCacheFormat(
            self.dtype,
            self.kv_scale if self.dtype in fp8.FP8_DTYPES else "none",
            self.exact_tail_tokens,
            self.exact_sink_tokens,
            self.hadamard,
        )

    @property
    def is_fp8(self) -> bool:
        """Return whether elements are one byte with scales beside them."""
        return self.dtype in fp8.FP8_DTYPES

    @property
    def bytes_per_token(self) -> int:
        """Return K+V bytes per token over all layers, scales included."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_layer = 2 * self.num_kv_heads * self.head_dim * elem
        if self.format.scale == "dynamic":
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
        """Return the residual positions one seat holds (KVCacheFormat.tail_store_tokens)."""
        return self.format.tail_store_tokens

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
    """One layer's cache: its format, K and V blocks, and what the format says comes with them.

    Which optional tensors are present follows from `format` alone (checked on construction):
    backends branch on the format, never on which fields are None.
    """

    format: KVCacheFormat
    # Head-major, so one KV head's gathered blocks are contiguous [tokens, head_dim] matrices.
    k: torch.Tensor  # [num_kv_heads, num_blocks, block_size, head_dim]
    v: torch.Tensor  # [num_kv_heads, num_blocks, block_size, head_dim]
    # scale "dynamic": per token and KV head, bf16 [num_kv_heads, num_blocks, block_size]
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    # scale "static": per KV head or per channel, float32 [num_kv_heads or 1, head_dim or 1]
    k_static_scale: torch.Tensor | None = None
    v_static_scale: torch.Tensor | None = None
    num_saturated: torch.Tensor | None = None  # [] int64, values clipped on write (static)
    # has_tail: E4M3 residuals [2 * num_kv_heads, seats, W-1+S, d] (K's heads, then V's) and
    # their bf16 scales [2 * num_kv_heads, seats, W-1+S]; None also when no seat was allocated
    tail_store: tuple[torch.Tensor, torch.Tensor] | None = None
    rotation: torch.Tensor | None = None  # hadamard: [head_dim, head_dim] float32, its own inverse
    # Calibration observers (set by `infer8 calibrate-kv`): per-channel running amax of K and V,
    # [num_kv_heads, head_dim], updated on every write.
    k_amax: torch.Tensor | None = None
    v_amax: torch.Tensor | None = None

    def __post_init__(self) -> None:
        f = self.format
        assert self.k.dtype == self.v.dtype == f.dtype
        assert (self.k_scale is not None) == (self.v_scale is not None) == (f.scale == "dynamic")
        static = self.k_static_scale is not None
        assert static == (self.v_static_scale is not None) == (f.scale == "static")
        assert (self.rotation is not None) == f.hadamard
        assert self.tail_store is None or f.has_tail

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
    spec: KVCacheSpec,
    num_blocks: int,
    device: torch.device,
    num_tail_rows: int = 0,
    static_scales: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
) -> list[LayerKVCache]:
    """Allocate zeroed cache tensors for every layer (zeros: masked slots must not hold NaN).

    static_scales: K's and V's static scales per layer, for a spec with kv_scale "static"; a
    cache whose values are never read through its own scales (a start-up profile's throwaway
    cache, the host tier's copies of blocks) may leave them out and holds ones.
    """
    fmt = spec.format
    shape = (spec.num_kv_heads, num_blocks, spec.block_size, spec.head_dim)
    tail_shape = (2 * spec.num_kv_heads, num_tail_rows, spec.tail_store_tokens, spec.head_dim)
    if fmt.scale == "static" and static_scales is None:
        ones = [torch.ones(spec.num_kv_heads, 1) for _ in range(spec.num_layers)]
        static_scales = (ones, ones)
    assert static_scales is None or fmt.scale == "static", "static scales need kv_scale static"

    def tail_store() -> tuple[torch.Tensor, torch.Tensor] | None:
        if not fmt.has_tail or num_tail_rows == 0:
            return None
        return (
            torch.zeros(tail_shape, dtype=RESIDUAL_DTYPE, device=device),
            torch.zeros(tail_shape[:-1], dtype=fp8.SCALE_DTYPE, device=device),
        )

    def scales() -> torch.Tensor | None:
        # scales of unwritten slots are 0: they scale zeros (never divided by)
        return _zeros(shape[:-1], fp8.SCALE_DTYPE, device) if fmt.scale == "dynamic" else None

    rotation = hadamard(spec.head_dim, device) if fmt.hadamard else None
    layers = []
    for i in range(spec.num_layers):
        static = None if static_scales is None else (static_scales[0][i], static_scales[1][i])
        layers.append(
            LayerKVCache(
                fmt,
                k=_zeros(shape, spec.dtype, device),
                v=_zeros(shape, spec.dtype, device),
                k_scale=scales(),
                v_scale=scales(),
                k_static_scale=None if static is None else static[0].float().to(device),
                v_static_scale=None if static is None else static[1].float().to(device),
                num_saturated=torch.zeros((), dtype=torch.int64, device=device),
                tail_store=tail_store(),
                rotation=rotation,
            )
        )
    return layers
