"""CpuAttention: the CPU backend over the native kernels, with torch's flash kernel and SDPA for
long prefill chunks (cpu/chunks.py).

It computes what the reference does (attention/reference.py), by the fastest path for each
step: an all-decode step is one native call per layer (rotation, FP8 write, exact tail and
attention together); a prefill step with an exact tail writes, quantizes and computes the tail
values of its new K/V in one native pass; prompts computed whole in one step attend over the
step's own K/V instead of reading their blocks back. It runs bf16 / float32 compute over
16/32-bit caches and FP8 caches with dynamic scales; calibration observers go to the reference.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from infer8.attention.cpu.chunks import ChunkAttention
from infer8.attention.cpu.tail_prefill import DENSE_TAIL_MAX_LEN
from infer8.attention.kv_cache import KVCacheFormat, LayerKVCache
from infer8.attention.metadata import AttentionMetadata
from infer8.attention.reference import ReferenceAttention
from infer8.kernels.cpu import NativeKernels
from infer8.kernels.cpu.decode import DecodeKernels, DecodeTail
from infer8.kernels.cpu.kv_kernels import KVKernels
from infer8.quant import fp8

_COMPUTE_DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class CpuStepMetadata:
    """A step's metadata as this backend reads it: the common part and, for an all-decode step
    with an exact tail, the tail's indices in the fused decode layer's form."""

    common: AttentionMetadata
    decode_tail: DecodeTail | None = None


class CpuAttention:
    """The CPU attention backend (see the module docstring). Holds the kernels, scratch buffers
    reused from layer to layer, and nothing a later call reads back."""

    def __init__(
        self, kernels: NativeKernels, dense_tail_max_len: int = DENSE_TAIL_MAX_LEN
    ) -> None:
        self.kernels = kernels
        self.reference = ReferenceAttention()
        self.chunks = ChunkAttention(kernels, dense_tail_max_len)

    @staticmethod
    def supports(fmt: KVCacheFormat, head_dim: int) -> bool:
        """Return whether this backend runs a cache of this format and head size."""
        pow2 = head_dim & (head_dim - 1) == 0
        return (
            fmt.scale != "static"
            and fmt.dtype in (*_COMPUTE_DTYPES, *fp8.FP8_DTYPES)
            and head_dim % 8 == 0
            and head_dim <= 512
            and (pow2 or not fmt.hadamard)
        )

    def build_metadata(self, meta: AttentionMetadata) -> CpuStepMetadata:
        """Return the step's metadata with what every layer's fused decode call reads."""
        decode_tail = None
        if meta.tail is not None and not meta.prefill_seq_ids:
            decode_tail = DecodeTail.from_metadata(meta.tail)
        return CpuStepMetadata(meta, decode_tail)

    def write_and_attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        step: CpuStepMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Store the step's K/V, then attend (reference.ReferenceAttention.write_and_attend)."""
        meta = step.common
        if cache.k_amax is not None or q.dtype not in _COMPUTE_DTYPES:
            return self.reference.write_and_attend(q, k, v, cache, meta, scale)
        n = meta.num_real_tokens
        has_tail = meta.tail is not None and cache.tail_store is not None
        if (
            not meta.prefill_seq_ids
            and len(meta.decode_seq_ids) == n == q.shape[0]
            and DecodeKernels.decode_layer_supported(cache, q, k, v)
        ):
            return self.kernels.decode.decode_layer(
                q, k, v, cache, meta.slot_mapping, meta.decode_block_tables,
                meta.decode_seq_lens, scale, step.decode_tail if has_tail else None, checked=True,
            )  # fmt: skip
        if has_tail and meta.prefill_seq_ids and KVKernels.prefill_tail_supported(cache, q, k, v):
            return self.chunks.prefill_with_tail(q, k[:n], v[:n], cache, meta, scale)
        if not has_tail and meta.prefill_seq_ids and cache.k.dtype == k.dtype:
            if not cache.format.hadamard:
                # a 16/32-bit cache in the compute dtype stores k / v as they are: prompts
                # computed whole in this step attend over them, not over their blocks read back
                self._write(cache, k[:n], v[:n], meta.slot_mapping)
                return self.chunks.attend(q, cache, meta, scale, None, own=(k[:n], v[:n]))
        return self._write_then_attend(q, k[:n], v[:n], cache, meta, scale)

    def _write_then_attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """The general path: rotate, write, the tail's values and store, attend, rotate back.

        k, v: the real tokens' [n, kv_heads, d]. Sinks are stored before attention, the ring
        after it (exact_tail.py).
        """
        if cache.format.hadamard:  # K, V and q alike; the output rotated back (H = H^-1)
            q, k, v = (self.chunks.rotate(x) for x in (q, k, v))
        self._write(cache, k, v, meta.slot_mapping)
        if meta.tail is not None and cache.tail_store is None:  # a format with a tail, no seat
            meta = dataclasses.replace(meta, tail=None)
        if meta.tail is None:
            out = self.chunks.attend(q, cache, meta, scale, None)
        else:
            assert cache.tail_store is not None
            tail, store, kv = meta.tail, cache.tail_store, self.kernels.kv
            residual, values = self._tail_values(cache, k, v)
            kv.write_store(store, residual, tail.sink_write_token_ids, tail.sink_write_slots)
            out = self.chunks.attend(q, cache, meta, scale, values)
            kv.write_store(store, residual, tail.write_token_ids, tail.write_slots)
        if cache.format.hadamard:
            out = self.chunks.rotate(out)
        return out

    def _write(
        self, cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store each token's K/V [n, kv_heads, d] in its slot, in one native pass per tensor."""
        kv = self.kernels.kv
        if cache.format.scale == "none":
            # from the projection's strided rows: index_copy_ took 3 ms per tensor for a
            # 4,096-token bf16 step
            kv.write_rows(k, slot_mapping, cache.k)
            kv.write_rows(v, slot_mapping, cache.v)
            return
        assert cache.k_scale is not None and cache.v_scale is not None
        # scale, quantize, store (~15 small torch ops otherwise)
        kv.write_fp8(k, slot_mapping, cache.k, cache.k_scale)
        kv.write_fp8(v, slot_mapping, cache.v, cache.v_scale)

    def _tail_values(
        self, cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """Return the residual (values [n, 2 * kvh, d], scales [n, 2 * kvh]: K's heads, then
        V's) and the tail values of this step's K and V, in one native pass over both."""
        n, kvh, _ = k.shape
        kv = torch.stack([k, v], dim=1)  # [n, 2, kvh, d]
        res_q, res_scale, tail = self.kernels.kv.tail_residual(kv, cache.k.dtype)
        return (res_q.view(n, 2 * kvh, -1), res_scale.view(n, 2 * kvh)), (tail[:, 0], tail[:, 1])
