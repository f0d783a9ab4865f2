"""Device slots for LoRA adapters, the host cache that fills them, and a step's low-rank products.

Each fused projection keeps, per layer, A stacked as [max_loras, max_rank x n, in] and B
(transposed, scaled) as [max_loras, max_rank x n, out] for its n PEFT modules (q/k/v: 3,
gate/up: 2), rank-major: row j x n + i is rank j of module i, so the slots' largest loaded
rank r reads the first r x n rows and an oversized --max-lora-rank costs memory, not time. A
module an adapter leaves out, or ranks past its own, are zeros. B's rows of one module touch
only its own output columns, so one product per fused projection computes all its modules.

A step's tokens pick their slot (LoRAMapping). On CPU a native kernel takes the step's
adapter tokens sorted by slot, in blocks of one adapter that share each load of A and B
(kernels/cpu/csrc/lora.c; the slots are float32 there). Without the native library the
products are grouped by slot in torch: the tokens of each adapter gathered into one padded
batch, two batched matmuls over the slots in use and one scatter-add (the segment / gathered
matmul idea of Punica), or a plain pair of matmuls when every token uses one adapter. On CUDA a
Triton kernel reads each token's slot (lora/triton_ops.py).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from infer8.lora.config import LoRAConfig, LoRARequest
from infer8.lora.peft import LoRAWeights, module_shapes, read_adapter
from infer8.models.llama import LlamaArchConfig

if TYPE_CHECKING:
    from infer8.kernels.cpu.elementwise import NativeElementwise

logger = logging.getLogger(__name__)

# Steps of at most this many tokens run the CPU kernel (csrc/lora.c), larger ones batched
# matmuls. At 64 rows (`python benchmarks/lora_products.py`, 2-core Zen 4) the kernel took
# 0.96-1.12x the matmuls' time for one adapter and 0.57-0.62x for four mixed; in a W1 run its
# prefill chunks of 2,048 rows took ~3x the matmuls' (it reads A and B again per four tokens).
NATIVE_MAX_TOKENS = 256

# fused projection -> its PEFT modules in output order
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


class LoRASlots(nn.Module):
    """Owns the adapters' device tensors: A and B of every fused projection, per layer and slot
    (buffers, so the KV budget counts them with the weights)."""

    def __init__(
        self,
        arch: LlamaArchConfig,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        with_float32: bool = False,
    ) -> None:
        """`with_float32`: a float32 copy of every slot too, for the CPU kernel (the same
        tensors for a float32 model)."""
        super().__init__()
        self.max_loras, self.max_rank = max_loras, max_rank
        self.has_float32 = with_float32 or dtype == torch.float32
        shapes = module_shapes(arch)
        # PEFT module -> (fused projection, its place i among the n, output columns [start, end))
        self.placement: dict[str, tuple[str, int, int, int]] = {}
        self.cols: dict[str, torch.Tensor] = {}  # fused -> its modules' column bounds [n + 1]
        self.slot_ranks = [0] * max_loras  # the rank of each slot's adapter (0: empty)
        self.num_layers = arch.num_hidden_layers
        self._float32_views: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        self._views: dict[
            tuple[int, int, int, bool], dict[str, list[tuple[torch.Tensor, torch.Tensor]]]
        ] = {}
        for fused, modules in FUSED_MODULES.items():
            in_features = shapes[modules[0]][0]
            start = 0
            for i, module in enumerate(modules):
                out = shapes[module][1]
                self.placement[module] = (fused, i, start, start + out)
                start += out
            bounds = [self.placement[m][2] for m in modules] + [start]
            self.cols[fused] = torch.tensor(bounds, dtype=torch.int64)
            rows = len(modules) * max_rank
            layers = arch.num_hidden_layers
            # [layers, max_loras, rows, in] and [layers, max_loras, rows, out]
            self.register_buffer(f"a_{fused}", torch.zeros(layers, max_loras, rows, in_features,
                                 dtype=dtype, device=device), persistent=False)  # fmt: skip
            self.register_buffer(f"b_{fused}", torch.zeros(layers, max_loras, rows, start,
                                 dtype=dtype, device=device), persistent=False)  # fmt: skip
            for name in (f"a_{fused}", f"b_{fused}"):
                own = getattr(self, name)
                copy = own if dtype == torch.float32 or not with_float32 else own.float()
                self.register_buffer(name.replace("_", "32_", 1), copy, persistent=False)

    def views(
        self, first: int, end: int, rank: int, squeeze: bool
    ) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Return, per fused projection and layer, A^T and B of slots [first, end) over the
        rows of rank `rank` ([in, rows] and [rows, out] for one slot with `squeeze`, else
        [slots, in, rows] and [slots, rows, out]); cached until a slot is loaded again."""
        key = (first, end, rank, squeeze)
        cached = self._views.get(key)
        if cached is not None:
            return cached
        views: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for fused, modules in FUSED_MODULES.items():
            rows = rank * len(modules)
            a_all, b_all = getattr(self, f"a_{fused}"), getattr(self, f"b_{fused}")
            views[fused] = []
            for layer in range(a_all.shape[0]):
                a = a_all[layer, first:end, :rows].transpose(1, 2)
                b = b_all[layer, first:end, :rows]
                views[fused].append((a[0], b[0]) if squeeze else (a, b))
        self._views[key] = views
        return views

    def float32_views(self) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Return, per fused projection and layer, the float32 copies of A and B
        ([max_loras, rows, in], [max_loras, rows, out]; with_float32), made once."""
        if self._float32_views is None:
            self._float32_views = {
                fused: [
                    (getattr(self, f"a32_{fused}")[layer], getattr(self, f"b32_{fused}")[layer])
                    for layer in range(self.num_layers)
                ]
                for fused in FUSED_MODULES
            }
        return self._float32_views

    def tensors(self, fused: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return A [max_loras, rows, in] and B [max_loras, rows, out] of one layer."""
        return getattr(self, f"a_{fused}")[layer], getattr(self, f"b_{fused}")[layer]

    @torch.inference_mode()
    def load(self, slot: int, weights: LoRAWeights) -> None:
        """Write an adapter into a slot (what it leaves out is zero)."""
        self._views.clear()
        for fused in FUSED_MODULES:
            for prefix in ("a_", "b_", "a32_", "b32_"):
                getattr(self, f"{prefix}{fused}")[:, slot].zero_()
        for (layer, module), (a, b) in weights.modules.items():
            fused, i, col, col_end = self.placement[module]
            n, rank = len(FUSED_MODULES[fused]), a.shape[0]
            dst_a, dst_b = self.tensors(fused, layer)
            dst_a[slot, i : i + n * rank : n].copy_(a)  # rows j * n + i, j < rank
            dst_b[slot, i : i + n * rank : n, col:col_end].copy_(b.t())
            if self.has_float32 and dst_a.dtype != torch.float32:
                a32, b32 = self.float32_views()[fused][layer]
                a32[slot, i : i + n * rank : n].copy_(a)
                b32[slot, i : i + n * rank : n, col:col_end].copy_(b.t())
        self.slot_ranks[slot] = weights.rank


@dataclass
class LoRAMapping:
    """Which slot each token of a step uses, in the form the step's products read.

    One of: `slot` (every token one adapter), `slot_ids` (CUDA: int32 [num_tokens], -1 for
    the base model), or the grouped form: `gather` [num_slots x group] token indices,
    `valid` [num_slots, group, 1] (0 for padding) over slots [first_slot, first_slot +
    num_slots).
    """

    rank: int  # the largest rank among the step's adapters: rows [0, rank x n) are read
    slot: int | None = None
    slot_ids: torch.Tensor | None = None
    order: torch.Tensor | None = None  # CPU native: the adapter tokens, sorted by slot
    gather: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    first_slot: int = 0
    num_slots: int = 0
    group: int = 0


def build_mapping(
    token_slots: np.ndarray,
    device: torch.device,
    dtype: torch.dtype,
    rank: int,
    native: bool = False,
) -> LoRAMapping | None:
    """Return a step's mapping from each token's slot (-1: base model) for adapters of rank
    at most `rank` (`native`: for the CPU kernel); None if no token has an adapter."""
    active = token_slots >= 0
    if not active.any():
        return None
    if native:
        tokens = np.flatnonzero(active)
        order = tokens[np.argsort(token_slots[tokens], kind="stable")]
        slot_ids = torch.from_numpy(token_slots.astype(np.int32))
        return LoRAMapping(rank, slot_ids=slot_ids, order=torch.from_numpy(order.astype(np.int64)))
    if device.type == "cuda":
        slot_ids = torch.from_numpy(token_slots.astype(np.int32)).to(device)
        return LoRAMapping(rank, slot_ids=slot_ids)
    slots = np.unique(token_slots[active])
    if len(slots) == 1 and active.all():
        return LoRAMapping(rank, slot=int(slots[0]))
    first, num_slots = int(slots[0]), int(slots[-1] - slots[0] + 1)
    tokens = np.flatnonzero(active)
    rel = token_slots[tokens] - first
    order = np.argsort(rel, kind="stable")
    counts = np.bincount(rel, minlength=num_slots)
    group = int(counts.max())
    starts = np.cumsum(counts) - counts
    pos = np.arange(len(tokens)) - np.repeat(starts, counts)  # place within its slot's group
    gather = np.zeros(num_slots * group, np.int64)  # padding reads token 0, scaled by 0
    valid = np.zeros(num_slots * group, np.float32)
    flat = rel[order] * group + pos
    gather[flat] = tokens[order]
    valid[flat] = 1.0
    return LoRAMapping(
        rank,
        gather=torch.from_numpy(gather),
        valid=torch.from_numpy(valid).to(dtype).view(num_slots, group, 1),
        first_slot=first,
        num_slots=num_slots,
        group=group,
    )


class LoRAStep:
    """A step's adapters for the model: adds each token's low-rank product to a projection.

    The per-layer views of the slots it reads are made once per slot contents and rank
    (LoRASlots.views): a decode step makes 4 x num_layers of these calls, where a few tensor
    views each would be a visible share of the products' own time.
    """

    def __init__(
        self,
        slots: LoRASlots,
        mapping: LoRAMapping,
        cuda_add: Callable[..., None] | None = None,
        native: NativeElementwise | None = None,
    ) -> None:
        self.mapping, self.cuda_add, self.native = mapping, cuda_add, native
        self.cols = slots.cols
        m = mapping
        if m.order is not None:
            self.native_tensors = slots.float32_views()
        elif m.slot is not None:
            self.views = slots.views(m.slot, m.slot + 1, m.rank, squeeze=True)
        elif m.slot_ids is not None:
            self.views = slots.views(0, slots.max_loras, m.rank, squeeze=False)
        else:
            self.views = slots.views(
                m.first_slot, m.first_slot + m.num_slots, m.rank, squeeze=False
            )

    def add(self, fused: str, layer: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += x @ A_s.T @ B_s for each token's slot s, in place (x [t, in], y [t, out])."""
        m = self.mapping
        if m.order is not None:
            assert self.native is not None and m.slot_ids is not None
            a, b = self.native_tensors[fused][layer]
            self.native.lora_add(x, y, a, b, m.order, m.slot_ids, m.rank, self.cols[fused])
            return
        a_t, b = self.views[fused][layer]
        if m.slot is not None:
            y.addmm_(torch.mm(x, a_t), b)
        elif m.slot_ids is not None:
            assert self.cuda_add is not None
            self.cuda_add(x, y, a_t.transpose(1, 2), b, m.slot_ids)
        else:
            assert m.gather is not None and m.valid is not None
            xg = x.index_select(0, m.gather).view(m.num_slots, m.group, -1)
            h = torch.bmm(xg, a_t).mul_(m.valid)  # [slots, group, rows]
            y.index_add_(0, m.gather, torch.bmm(h, b).view(m.num_slots * m.group, -1))


class LoRAManager:
    """Owns which adapter is in which slot and a host cache of loaded adapters (LRU both)."""

    def __init__(
        self,
        slots: LoRASlots,
        arch: LlamaArchConfig,
        config: LoRAConfig,
        dtype: torch.dtype,
        device: torch.device,
        native: NativeElementwise | None = None,
    ) -> None:
        """`dtype`: the model's; `native`: the CPU kernels' element-wise passes (their LoRA
        kernel reads the slots' float32 copies)."""
        self.slots, self.arch, self.config = slots, arch, config
        self.dtype, self.device, self.native = dtype, device, native
        self.host_cache: OrderedDict[int, LoRAWeights] = OrderedDict()
        self.slot_to_id: list[int | None] = [None] * config.max_loras
        self.id_to_slot: dict[int, int] = {}
        self.slot_lru: OrderedDict[int, None] = OrderedDict()  # ids in slots, oldest first
        self.cuda_add: Callable[..., None] | None = None
        if device.type == "cuda":
            from infer8.lora.triton_ops import triton_lora_add

            self.cuda_add = triton_lora_add

    def _weights(self, lora: LoRARequest) -> LoRAWeights:
        weights = self.host_cache.get(lora.lora_int_id)
        if weights is None:
            # float32 on the host: each slot copy rounds once to its own dtype
            weights = read_adapter(
                lora.lora_path, self.arch, self.config.max_lora_rank, torch.float32
            )
            self.host_cache[lora.lora_int_id] = weights
            while len(self.host_cache) > self.config.num_cpu_loras:
                self.host_cache.popitem(last=False)
        self.host_cache.move_to_end(lora.lora_int_id)
        return weights

    def activate(self, loras: Iterable[LoRARequest]) -> dict[int, int]:
        """Put every adapter of a step in a slot; return lora_int_id -> slot."""
        needed = {lora.lora_int_id: lora for lora in loras}
        assert len(needed) <= self.config.max_loras, "more adapters in a step than --max-loras"
        for lora_id, lora in needed.items():
            if lora_id not in self.id_to_slot:
                slot = self._free_slot(needed)
                self.slots.load(slot, self._weights(lora))
                old = self.slot_to_id[slot]
                if old is not None:
                    del self.id_to_slot[old]
                    self.slot_lru.pop(old, None)
                self.slot_to_id[slot], self.id_to_slot[lora_id] = lora_id, slot
            self.slot_lru[lora_id] = None
            self.slot_lru.move_to_end(lora_id)
        return {lora_id: self.id_to_slot[lora_id] for lora_id in needed}

    def _free_slot(self, needed: dict[int, LoRARequest]) -> int:
        """Return the lowest empty slot, else the least recently used one no step adapter holds."""
        for slot, lora_id in enumerate(self.slot_to_id):
            if lora_id is None:
                return slot
        for lora_id in self.slot_lru:
            if lora_id not in needed:
                return self.id_to_slot[lora_id]
        raise AssertionError("no slot to evict")  # len(needed) <= max_loras

    def step(self, token_slots: np.ndarray) -> LoRAStep | None:
        """Return the step's adapters for the model (None when no token uses one)."""
        used = np.unique(token_slots[token_slots >= 0])
        rank = max((self.slots.slot_ranks[s] for s in used), default=0)
        # the CPU kernel at decode sizes; batched matmuls past them (a prefill chunk's rows
        # make the matmuls efficient, where the kernel reads A and B again per four tokens)
        native = (
            self.native is not None
            and self.device.type == "cpu"
            and len(token_slots) <= NATIVE_MAX_TOKENS
        )
        mapping = build_mapping(token_slots, self.device, self.dtype, rank, native)
        if mapping is None:
            return None
        return LoRAStep(self.slots, mapping, self.cuda_add, self.native if native else None)


def lora_requests_of(loras: Iterable[LoRARequest | None]) -> list[LoRARequest]:
    """Return the distinct adapters among a step's requests' (in first-seen order)."""
    seen: dict[int, LoRARequest] = {}
    for lora in loras:
        if lora is not None:
            seen.setdefault(lora.lora_int_id, lora)
    return list(seen.values())
