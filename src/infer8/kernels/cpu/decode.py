"""The native decode attention (csrc/decode_attention.c): one query per sequence over its
blocks, and a whole decode layer (rotation, FP8 write, exact tail and attention) in one call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from infer8.kernels.cpu.library import NativeLibrary
from infer8.quant import fp8

if TYPE_CHECKING:
    from infer8.attention.exact_tail import TailMetadata
    from infer8.attention.kv_cache import LayerKVCache

_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}
_SCALE_PER_AMAX = {dt: fp8.SCALE_ROUND_UP / fp8.fp8_max(dt) for dt in fp8.FP8_DTYPES}
_NO_TAIL_ARGS = (None, 0, 0, None, None, 0, None, None, 0, None, None, 0)  # see DecodeTail


@dataclass(frozen=True)
class DecodeTail:
    """A step's exact-tail indices as decode_layer reads them, built once per step (every
    layer's store has one shape): the contiguous tensors, which own the pointers passed."""

    read_rows: torch.Tensor  # [rows read] int64
    pos: torch.Tensor  # [B, width] int64
    valid: torch.Tensor  # [B, width] float32
    sink_token_ids: torch.Tensor
    sink_slots: torch.Tensor
    ring_token_ids: torch.Tensor
    ring_slots: torch.Tensor

    @classmethod
    def from_metadata(cls, tail: TailMetadata) -> DecodeTail:
        """Return the tail of a step's metadata in decode_layer's form."""
        return cls(*(t.contiguous() for t in (tail.read_rows, tail.decode_pos,
                   tail.decode_valid, tail.sink_write_token_ids, tail.sink_write_slots,
                   tail.write_token_ids, tail.write_slots)))  # fmt: skip

    def arguments(self, store: torch.Tensor) -> tuple[int | None, ...]:
        """Return decode_layer's tail arguments (read rows, seats, stride, pos, valid, width,
        sinks, sink slots, their count, ring tokens, ring slots, their count) for a store
        [2 kvh, seats, stride, d]."""
        return (self.read_rows.data_ptr(), store.shape[1], store.shape[2], self.pos.data_ptr(),
                self.valid.data_ptr(), self.pos.shape[1], self.sink_token_ids.data_ptr(),
                self.sink_slots.data_ptr(), self.sink_token_ids.numel(),
                self.ring_token_ids.data_ptr(), self.ring_slots.data_ptr(),
                self.ring_token_ids.numel())  # fmt: skip


class DecodeKernels:
    """Decode attention and the fused decode layer on CPU tensors."""

    def __init__(self, lib: NativeLibrary) -> None:
        self.lib = lib

    @staticmethod
    def decode_supported(cache: LayerKVCache, dtype: torch.dtype) -> bool:
        """Return whether decode_attention runs this cache (no static scales) and dtype."""
        return (
            cache.k.dtype in _KINDS
            and cache.format.scale != "static"
            and dtype in (torch.float32, torch.bfloat16)
            and cache.k.shape[-1] % 8 == 0
            and cache.k.device.type == "cpu"
        )

    def decode_attention(
        self,
        q: torch.Tensor,
        cache: LayerKVCache,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        tail: tuple[torch.Tensor, ...] | None = None,
    ) -> torch.Tensor:
        """Attend one query per sequence over its cached context; return [B, heads, d].

        q: [B, heads, d] (float32 or bf16); block_table: [B, blocks] int64; seq_lens: [B] int64.
        tail: (new_k, new_v [B, kvh, d] in q's dtype, the residual store (values [2 kvh, seats,
        stride, d] E4M3, scales [2 kvh, seats, stride] bf16: K's heads, then V's), read_rows
        [B * width / stride] int64 (sequence b's store rows first), pos [B, width] int64, valid
        [B, width] float32): the exact tail as the reference applies it, the
        residuals dequantized in the kernel.
        """
        assert self.decode_supported(cache, q.dtype) and cache.k.is_contiguous()
        b, num_heads, head_dim = q.shape
        num_kv_heads, num_blocks, block_size, _ = cache.k.shape
        q = q.contiguous()
        table = block_table.contiguous()
        lens = seq_lens.contiguous()
        assert table.dtype == torch.int64 and lens.dtype == torch.int64
        out = torch.empty_like(q)
        parts: list[torch.Tensor | None] = [None] * 7
        seats = stride = width = 0
        if tail is not None:
            parts = [t.contiguous() for t in tail]
            new_k, new_v, store, store_scale, read_rows, pos, valid = parts
            assert new_k.dtype == new_v.dtype == q.dtype and store.dtype == torch.float8_e4m3fn
            assert store_scale.dtype == torch.bfloat16 and read_rows.dtype == torch.int64
            assert store.shape[0] == 2 * num_kv_heads and pos.shape == valid.shape
            seats, stride, width = store.shape[1], store.shape[2], pos.shape[1]
            assert width % stride == 0 and read_rows.numel() >= b * (width // stride)
        fp8_cache = cache.k_scale is not None

        def ptr(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        new_k, new_v, store, store_scale, read_rows, pos, valid = map(ptr, parts)
        self.lib.call(
            "decode_attention",
            q=q.data_ptr(),
            k_cache=cache.k.data_ptr(),
            v_cache=cache.v.data_ptr(),
            k_scale=ptr(cache.k_scale) if fp8_cache else None,
            v_scale=ptr(cache.v_scale) if fp8_cache else None,
            kind=_KINDS[cache.k.dtype],
            table=table.data_ptr(),
            table_stride=table.shape[1],
            seq_lens=lens.data_ptr(),
            batch=b,
            num_kv_heads=num_kv_heads,
            group=num_heads // num_kv_heads,
            num_blocks=num_blocks,
            block_size=block_size,
            d=head_dim,
            sm_scale=scale,
            x_f32=int(q.dtype == torch.float32),
            new_k=new_k,
            new_v=new_v,
            store=store,
            store_scale=store_scale,
            read_rows=read_rows,
            seats=seats,
            stride=stride,
            pos=pos,
            valid=valid,
            width=width,
            out=out.data_ptr(),
        )
        return out

    @staticmethod
    def decode_layer_supported(
        cache: LayerKVCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> bool:
        """Return whether decode_layer runs this cache and these rows: the decode kernel's
        conditions, dynamic scales (no calibration), head_dim <= 512, q / k / v rows of d
        (k and v at one token stride; a single row's dim 0 stride is never read)."""
        d = cache.k.shape[-1]
        return (
            DecodeKernels.decode_supported(cache, q.dtype)
            and cache.k_amax is None
            and d <= 512
            and (cache.rotation is None or d & (d - 1) == 0)
            and q.stride(-1) == k.stride(-1) == 1
            and q.stride(1) == k.stride(1) == d
            and (k.stride() == v.stride() or k.shape[0] == 1)
        )

    def decode_layer(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        tail: DecodeTail | None,
        checked: bool = False,
    ) -> torch.Tensor:
        """The reference's write_and_attend for an all-decode batch (token b is sequence b), in
        one native call (csrc/decode_attention.c: infer8_decode_layer).

        q [B, H, d], k / v [B, kvh, d]: rows of d (views of the fused projection's output
        welcome); the cache's rotation, FP8 write and exact tail (`tail`: this step's, with the
        cache's store) as the reference applies them. Returns [B, H, d]. `checked`: the
        caller has just seen decode_layer_supported hold (CpuAttention, each layer).
        """
        assert checked or self.decode_layer_supported(cache, q, k, v)
        assert cache.k.is_contiguous()
        b, num_heads, d = q.shape
        num_kv_heads, num_blocks, block_size, _ = cache.k.shape
        assert k.shape == v.shape == (b, num_kv_heads, d) and q.dtype == k.dtype == v.dtype
        table, lens = block_table.contiguous(), seq_lens.contiguous()
        slots = slot_mapping.contiguous()
        assert table.dtype == lens.dtype == slots.dtype == torch.int64
        out = torch.empty((b, num_heads, d), dtype=q.dtype)
        fp8_cache = cache.format.is_fp8
        per_amax = _SCALE_PER_AMAX[cache.k.dtype] if fp8_cache else 0.0
        store = store_scale = None
        tail_args: tuple[int | None, ...] = _NO_TAIL_ARGS
        if tail is not None:
            assert cache.tail_store is not None and cache.tail_store[0].is_contiguous()
            store, store_scale = cache.tail_store
            tail_args = tail.arguments(store)

        def ptr(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        read_rows, seats, stride, pos, valid, width, *sink_args = tail_args
        sinks, sink_slots, num_sinks, rings, ring_slots, num_rings = sink_args
        self.lib.call(
            "decode_layer",
            q=q.data_ptr(),
            q_stride=q.stride(0),
            k=k.data_ptr(),
            v=v.data_ptr(),
            kv_stride=k.stride(0),
            slot_mapping=slots.data_ptr(),
            k_cache=cache.k.data_ptr(),
            v_cache=cache.v.data_ptr(),
            k_scale=ptr(cache.k_scale),
            v_scale=ptr(cache.v_scale),
            kind=_KINDS[cache.k.dtype],
            table=table.data_ptr(),
            table_stride=table.shape[1],
            seq_lens=lens.data_ptr(),
            batch=b,
            num_kv_heads=num_kv_heads,
            group=num_heads // num_kv_heads,
            num_blocks=num_blocks,
            block_size=block_size,
            d=d,
            sm_scale=scale,
            x_f32=int(q.dtype == torch.float32),
            rotate_keys=int(cache.format.hadamard),
            rotate_values=int(cache.format.hadamard),
            cache_per_amax=per_amax,
            store=ptr(store),
            store_scale=ptr(store_scale),
            read_rows=read_rows,
            seats=seats,
            stride=stride,
            pos=pos,
            valid=valid,
            width=width,
            e4m3_per_amax=_SCALE_PER_AMAX[torch.float8_e4m3fn],
            sink_ids=sinks,
            sink_slots=sink_slots,
            num_sinks=num_sinks,
            ring_ids=rings,
            ring_slots=ring_slots,
            num_rings=num_rings,
            out=out.data_ptr(),
        )
        return out
