"""Megatron-style sharding of a Llama-family checkpoint: which slice of each weight a rank holds.

Column-parallel: q/k/v rows by head, gate/up rows by intermediate column. Row-parallel: o_proj
and down_proj columns (their outputs are summed across ranks). Vocabulary-parallel: embedding
and LM head rows, padded to a multiple of the group size. KV heads are split when the group
size divides them and replicated when it is a multiple of them: each rank then holds the one
KV head its query heads read.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from infer8.quant.kv_scales import StaticKVScales
from infer8.utils import cdiv

if TYPE_CHECKING:  # llama.py imports the parallel layers, which import this module
    from infer8.models.llama import LlamaArchConfig

# weight_scale: a per-output-channel FP8 scale [out], cut like the bias
_PROJ_RE = re.compile(r"^model\.layers\.\d+\.(?:self_attn|mlp)\.(\w+)\.(weight|bias|weight_scale)$")
_KV_SCALE_RE = re.compile(r"^model\.layers\.\d+\.self_attn\.(?:[kv]_proj\.)?(?:k|v|kv)_scale$")
_VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")


class HeadShape(Protocol):
    """What decides a model's split: a LlamaArchConfig, or the planner's ModelShape."""

    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...


def kv_heads_per_rank(num_kv_heads: int, world_size: int) -> int:
    """Return the KV heads one rank stores: its share, or one replicated head."""
    return max(1, num_kv_heads // world_size)


def check_tensor_parallel_size(cfg: HeadShape, world_size: int) -> None:
    """Raise ValueError (before anything starts) if the model cannot be split `world_size` ways."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    problem = _split_problem(cfg, world_size)
    if problem is not None:
        valid = [n for n in range(1, cfg.num_attention_heads + 1) if _split_problem(cfg, n) is None]
        raise ValueError(f"tensor_parallel_size {world_size} {problem}; choose one of {valid}")


def _split_problem(cfg: HeadShape, world_size: int) -> str | None:
    """Return why the model cannot be split `world_size` ways, or None."""
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % world_size:
        return f"does not divide the model's {heads} attention heads"
    if kv_heads % world_size and world_size % kv_heads:
        return f"can neither split the model's {kv_heads} KV heads evenly nor replicate them"
    if cfg.intermediate_size % world_size:
        return f"does not divide the model's intermediate size {cfg.intermediate_size}"
    return None


@dataclass(frozen=True)
class TensorParallelShard:
    """What one rank holds of a model: its heads, KV heads, MLP columns and vocabulary rows."""

    config: LlamaArchConfig  # the whole model's
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        check_tensor_parallel_size(self.config, self.world_size)
        assert 0 <= self.rank < self.world_size

    @property
    def q_heads(self) -> range:
        """Return the query heads of this rank."""
        n = self.config.num_attention_heads // self.world_size
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def kv_heads(self) -> range:
        """Return the KV heads of this rank (one, shared with other ranks, when replicated)."""
        kv, world = self.config.num_key_value_heads, self.world_size
        if world <= kv:
            n = kv_heads_per_rank(kv, world)
            return range(self.rank * n, (self.rank + 1) * n)
        # Ranks [h * world / kv, (h + 1) * world / kv) hold the query heads of KV head h.
        head = self.rank // (world // kv)
        return range(head, head + 1)

    @property
    def intermediate(self) -> range:
        """Return the MLP columns of this rank."""
        n = self.config.intermediate_size // self.world_size
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def vocab_rows(self) -> range:
        """Return the vocabulary ids whose embedding / LM-head rows this rank holds."""
        n = cdiv(self.config.vocab_size, self.world_size)
        return range(self.rank * n, min((self.rank + 1) * n, self.config.vocab_size))

    def rank_config(self) -> LlamaArchConfig:
        """Return the architecture as this rank computes it (vocab_size stays the model's)."""
        cfg = self.config
        return dataclasses.replace(
            cfg,
            num_attention_heads=len(self.q_heads),
            num_key_value_heads=len(self.kv_heads),
            intermediate_size=len(self.intermediate),
        )

    def shard_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Return this rank's slice of the checkpoint tensor `name` (unsharded ones whole)."""
        d = self.config.head_dim
        m = _PROJ_RE.match(name)
        if m:
            proj = m.group(1)
            if proj == "q_proj":
                return _rows(tensor, self.q_heads, d)
            if proj in ("k_proj", "v_proj"):
                return _rows(tensor, self.kv_heads, d)
            if proj in ("gate_proj", "up_proj"):
                return _rows(tensor, self.intermediate, 1)
            if proj == "o_proj" and m.group(2) == "weight":
                return tensor[:, self.q_heads.start * d : self.q_heads.stop * d]
            if proj == "down_proj" and m.group(2) == "weight":
                return tensor[:, self.intermediate.start : self.intermediate.stop]
            return tensor
        if name in _VOCAB_ROWS:
            rows = tensor[self.vocab_rows.start : self.vocab_rows.stop]
            num_pad = cdiv(self.config.vocab_size, self.world_size) - len(self.vocab_rows)
            if num_pad:  # the last rank's padding rows: never looked up, logits cut off
                rows = torch.cat([rows, rows.new_zeros(num_pad, rows.shape[1])])
            return rows
        if _KV_SCALE_RE.match(name):
            return self.shard_kv_scale(tensor)
        return tensor

    def shard_weights(
        self, weights: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield this rank's slice of every checkpoint tensor."""
        for name, tensor in weights:
            yield name, self.shard_tensor(name, tensor)

    def shard_kv_scale(self, scale: torch.Tensor) -> torch.Tensor:
        """Return this rank's KV heads of a per-head or per-channel scale (per-layer: as is)."""
        kv, d = self.config.num_key_value_heads, self.config.head_dim
        flat = scale.reshape(-1)
        heads = slice(self.kv_heads.start, self.kv_heads.stop)
        if flat.numel() == kv:
            return flat[heads]
        if flat.numel() == kv * d:
            return flat.view(kv, d)[heads].reshape(-1)
        return scale  # one per layer, or malformed: kv_scales reports the latter

    def shard_static_scales(self, scales: StaticKVScales) -> StaticKVScales:
        """Return static KV scales ([1 or num_kv_heads, 1 or head_dim]) for this rank's heads."""

        def cut(t: torch.Tensor) -> torch.Tensor:
            return t if t.shape[0] == 1 else t[self.kv_heads.start : self.kv_heads.stop]

        return StaticKVScales([cut(k) for k in scales.k], [cut(v) for v in scales.v], scales.source)


def _rows(tensor: torch.Tensor, units: range, unit_size: int) -> torch.Tensor:
    """Return rows [units.start * unit_size, units.stop * unit_size) of a weight or bias."""
    return tensor[units.start * unit_size : units.stop * unit_size]
