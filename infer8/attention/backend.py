"""The attention backend protocol: what a model layer needs from attention, and nothing more.

Each backend builds whatever per-step data it needs from the common `AttentionMetadata` (the
runner's plain description of the batch) and keeps no hidden per-step state of its own.
"""

from __future__ import annotations

from typing import Protocol

import torch

from infer8.attention.kv_cache import LayerKVCache
from infer8.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Store K/V into the paged cache, then attend over it."""

    def write_kv(
        self, cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None: ...

    def forward(
        self,
        q: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        k_new: torch.Tensor | None = None,
        v_new: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend; k_new / v_new (this step's K/V) are passed when the cache has an exact tail."""
        ...

    def write_and_attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """One layer: write_kv of k / v's real tokens, then forward (this step's K/V passed
        where the cache has an exact tail). A backend may fuse the two (a model calls this)."""
        ...


def write_then_attend(
    backend: AttentionBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerKVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """write_and_attend unfused: write_kv of the real tokens, then forward (this step's K/V
    passed where the cache has an exact tail)."""
    n = meta.num_real_tokens
    k_new, v_new = k[:n], v[:n]
    backend.write_kv(cache, k_new, v_new, meta.slot_mapping)
    if cache.kv_tail is None:
        return backend.forward(q, cache, meta, scale)
    return backend.forward(q, cache, meta, scale, k_new=k_new, v_new=v_new)
