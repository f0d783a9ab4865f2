"""The attention backend protocol: what a model layer needs from attention, and nothing more.

A backend is chosen once at start-up (attention/__init__.py's registry) and handed to the model.
Each step the runner's common AttentionMetadata goes through the backend's build_metadata once;
what it returns is passed to every layer's write_and_attend. A backend keeps no state from one
call to the next: what a later call reads lives in the cache (LayerKVCache) or in that step's
metadata.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from infer8.attention.kv_cache import LayerKVCache
from infer8.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Store a layer's new K/V into the paged cache, then attend over it."""

    def build_metadata(self, meta: AttentionMetadata) -> Any:
        """Return this backend's view of a step (once per step, read by every layer)."""
        ...

    def write_and_attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        meta: Any,
        scale: float,
    ) -> torch.Tensor:
        """One layer: store k / v's real tokens ([num_tokens, kv_heads, d]) in their slots, then
        attend q ([num_tokens, heads, d]) over each sequence's context, causally within its
        chunk; `meta` is what build_metadata returned. Returns [num_tokens, heads, d], zeros
        for padding tokens."""
        ...
