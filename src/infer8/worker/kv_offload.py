"""The host-memory KV tier's tensors and its block copies (`--kv-offloading-size`).

A host pool mirrors the device cache's layout with `num_host_blocks` blocks per layer: K and V,
and for an FP8 cache the per-token scales, so a block comes back exactly as it left. On CUDA
the pool is pinned; on CPU it is one more lazily mapped tensor pool. Which blocks move where
is decided by core/host_tier.py and arrives as plain lists in the SchedulerOutput.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer8.attention.kv_cache import KVCacheSpec, LayerKVCache, allocate_kv_cache
from infer8.worker.memory import GiB


def num_host_blocks_for(size_gib: float | None, spec: KVCacheSpec, world_size: int = 1) -> int:
    """Return how many blocks `size_gib` of host memory holds (the size covers all ranks)."""
    if not size_gib:
        return 0
    return int(size_gib * GiB) // world_size // spec.bytes_per_block


def _block_tensors(cache: LayerKVCache) -> list[torch.Tensor]:
    """Return a layer's per-block tensors (block index in dim 1), FP8 viewed as bytes."""
    tensors = [t for t in (cache.k, cache.v, cache.k_scale, cache.v_scale) if t is not None]
    # index_copy_ has no FP8 kernel on CPU; the bytes are the same
    return [t.view(torch.uint8) if t.element_size() == 1 else t for t in tensors]


@dataclass
class HostKVCache:
    """Owns the host pool's per-layer tensors and copies whole blocks to and from the device."""

    layers: list[LayerKVCache]
    device: torch.device

    @classmethod
    def allocate(cls, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> HostKVCache:
        """Allocate a zeroed host pool of `num_blocks` blocks (pinned when the device is CUDA)."""
        layers = allocate_kv_cache(spec, num_blocks, torch.device("cpu"))
        if device.type == "cuda":
            for layer in layers:
                layer.k, layer.v = layer.k.pin_memory(), layer.v.pin_memory()
                if layer.k_scale is not None and layer.v_scale is not None:
                    layer.k_scale = layer.k_scale.pin_memory()
                    layer.v_scale = layer.v_scale.pin_memory()
        return cls(layers, device)

    @property
    def num_blocks(self) -> int:
        """Return the host pool's size in blocks."""
        return self.layers[0].k.shape[1] if self.layers else 0

    def save(self, kv_caches: list[LayerKVCache], block_ids: list[int], slots: list[int]) -> None:
        """Copy device blocks `block_ids` into host slots `slots`, every layer."""
        if not block_ids:
            return
        src = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        dst = torch.tensor(slots, dtype=torch.int64)
        for cache, host in zip(kv_caches, self.layers, strict=True):
            for d, h in zip(_block_tensors(cache), _block_tensors(host), strict=True):
                h.index_copy_(1, dst, d.index_select(1, src).to("cpu"))

    def load(self, kv_caches: list[LayerKVCache], slots: list[int], block_ids: list[int]) -> None:
        """Copy host slots `slots` into device blocks `block_ids`, every layer."""
        if not slots:
            return
        src = torch.tensor(slots, dtype=torch.int64)
        dst = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        is_cuda = self.device.type == "cuda"
        for cache, host in zip(kv_caches, self.layers, strict=True):
            for d, h in zip(_block_tensors(cache), _block_tensors(host), strict=True):
                blocks = h.index_select(1, src)
                if is_cuda:  # a pinned staging copy lets the upload run asynchronously
                    blocks = blocks.pin_memory()
                d.index_copy_(1, dst, blocks.to(self.device, non_blocking=is_cuda))
