"""The native kernels that read and write the paged cache's blocks (csrc/fp8_gather.c): gather
and dequantize FP8 blocks in one pass, quantize on write, the exact tail's residuals and store."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from infer8.kernels.cpu.library import NativeLibrary
from infer8.quant import fp8

if TYPE_CHECKING:
    from infer8.attention.kv_cache import LayerKVCache

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class KVKernels:
    """Gathers, dequantization and writes of cache blocks and tail stores (CPU tensors)."""

    def __init__(self, lib: NativeLibrary) -> None:
        self.lib = lib
        self._ones: dict[int, torch.Tensor] = {}  # per head_dim: the scales of static reads

    def gather(
        self, cache_t: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """Fill out [kvh, n, block_size, d] with cache_t's blocks `block_ids` (same dtype)."""
        assert cache_t.is_contiguous() and out.is_contiguous() and out.dtype == cache_t.dtype
        assert cache_t.device.type == "cpu" and block_ids.dtype == torch.int64
        ids = block_ids.contiguous()
        num_kv_heads, num_blocks = cache_t.shape[:2]
        block_bytes = cache_t[0, 0].numel() * cache_t.element_size()
        self.lib.gather_blocks(
            cache_t.data_ptr(),
            ids.data_ptr(),
            ids.numel(),
            num_kv_heads,
            num_blocks,
            block_bytes,
            out.data_ptr(),
        )
        return out

    def dequantize_blocks(
        self,
        cache_t: torch.Tensor,
        scale_t: torch.Tensor | None,
        static: torch.Tensor | None,
        block_ids: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Fill out [kvh, n, block_size, d] (bf16 or float32) with the dequantized blocks."""
        assert cache_t.dtype in _FP8 and cache_t.is_contiguous() and cache_t.device.type == "cpu"
        assert out.dtype in (torch.bfloat16, torch.float32) and out.is_contiguous()
        num_kv_heads, num_blocks, block_size, head_dim = cache_t.shape
        ids = block_ids.contiguous()
        assert ids.dtype == torch.int64
        ones = self._ones.get(head_dim)
        if ones is None:
            ones = self._ones[head_dim] = torch.ones(head_dim, dtype=torch.float32)
        static_f = None
        if scale_t is None:
            assert static is not None
            # the reference multiplies by the scale in the output dtype: round it the same way
            static_f = static.to(out.dtype).float().expand(num_kv_heads, head_dim).contiguous()
        self.lib.gather_dequant_fp8(
            cache_t.data_ptr(),
            None if scale_t is None else scale_t.data_ptr(),
            None if static_f is None else static_f.data_ptr(),
            ids.data_ptr(),
            ids.numel(),
            num_kv_heads,
            num_blocks,
            block_size,
            head_dim,
            int(cache_t.dtype == torch.float8_e5m2),
            ones.data_ptr(),
            out.data_ptr(),
            int(out.dtype == torch.float32),
        )
        return out

    def tail_residual(
        self, x: torch.Tensor, block_dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return (E4M3 residual, its scales, block value + residual) of x's rows in one pass.

        x: [..., head_dim] bf16 or float32; the block value is x quantized as write_kv does it
        (dynamic scales, `block_dtype`). Bit for bit what exact_tail's torch functions return.
        """
        assert x.dtype in (torch.bfloat16, torch.float32) and x.device.type == "cpu"
        assert block_dtype in _FP8 and x.shape[-1] <= 512
        x = x.contiguous()
        head_dim = x.shape[-1]
        res_q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
        res_scale = torch.empty(x.shape[:-1], dtype=fp8.SCALE_DTYPE)
        tail = torch.empty_like(x)
        self.lib.tail_residual(
            x.data_ptr(),
            x.numel() // head_dim,
            head_dim,
            int(x.dtype == torch.float32),
            int(block_dtype == torch.float8_e5m2),
            fp8.SCALE_ROUND_UP / fp8.fp8_max(block_dtype),
            fp8.SCALE_ROUND_UP / fp8.fp8_max(torch.float8_e4m3fn),
            res_q.data_ptr(),
            res_scale.data_ptr(),
            tail.data_ptr(),
        )
        return res_q, res_scale, tail

    def prefill_tail(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
        cache: LayerKVCache,
        out: tuple[torch.Tensor, ...] | None = None,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]:
        """A step's new K and V [n, kvh, d] (bf16 or float32; token strides free, heads d
        apart) rotated as the cache's rotation asks, quantized into its FP8 blocks (dynamic
        scales), and their exact-tail values, in one pass: bit for bit the reference's write then
        _tail_values. Returns ((E4M3 residuals [n, 2 * kvh, d], scales [n, 2 * kvh]: K's heads,
        then V's), tail values, block values), the last two [2, kvh, n, d] in x's dtype; into
        `out` (those four tensors) where given (fresh pages cost more than this pass)."""
        n, kvh, d = k.shape
        assert k.dtype == v.dtype and k.dtype in (torch.bfloat16, torch.float32) and d <= 512
        assert cache.format.scale == "dynamic"
        assert cache.k_scale is not None and cache.v_scale is not None
        k, v = (x if x.stride(2) == 1 and x.stride(1) == d else x.contiguous() for x in (k, v))
        slots = slot_mapping.contiguous()
        assert slots.dtype == torch.int64 and slots.numel() == n
        if out is None:
            out = (
                torch.empty((n, 2 * kvh, d), dtype=torch.float8_e4m3fn),
                torch.empty((n, 2 * kvh), dtype=fp8.SCALE_DTYPE),
                torch.empty((2, kvh, n, d), dtype=k.dtype),
                torch.empty((2, kvh, n, d), dtype=k.dtype),
            )
        res_q, res_scale, tail, block = out
        assert res_q.shape == (n, 2 * kvh, d) and res_q.dtype == torch.float8_e4m3fn
        assert res_scale.shape == (n, 2 * kvh) and res_scale.dtype == fp8.SCALE_DTYPE
        assert tail.shape == block.shape == (2, kvh, n, d) and tail.dtype == block.dtype == k.dtype
        assert all(x.is_contiguous() for x in out)
        rotate = cache.rotation is not None
        self.lib.call(
            "prefill_tail",
            k=k.data_ptr(),
            k_stride=k.stride(0),
            v=v.data_ptr(),
            v_stride=v.stride(0),
            n=n,
            kvh=kvh,
            d=d,
            x_f32=int(k.dtype == torch.float32),
            rotate_keys=int(rotate),
            rotate_values=int(rotate and cache.format.hadamard),
            block_is_e5m2=int(cache.k.dtype == torch.float8_e5m2),
            block_per_amax=fp8.SCALE_ROUND_UP / fp8.fp8_max(cache.k.dtype),
            e4m3_per_amax=fp8.SCALE_ROUND_UP / fp8.fp8_max(torch.float8_e4m3fn),
            slot_mapping=slots.data_ptr(),
            num_slots=cache.k[0].numel() // d,
            k_cache=cache.k.data_ptr(),
            k_scale=cache.k_scale.data_ptr(),
            v_cache=cache.v.data_ptr(),
            v_scale=cache.v_scale.data_ptr(),
            res_q=res_q.data_ptr(),
            res_scale=res_scale.data_ptr(),
            tail=tail.data_ptr(),
            block=block.data_ptr(),
        )
        return (res_q, res_scale), tail, block

    def write_store(
        self,
        store: tuple[torch.Tensor, torch.Tensor],
        residual: tuple[torch.Tensor, torch.Tensor],
        token_ids: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """exact_tail.write_store in one native pass: the residuals of tokens `token_ids`
        (values [tokens, heads, d] E4M3, scales [tokens, heads]) into the store's `slots`."""
        if slots.numel() == 0:
            return
        values, scales = store
        heads, d = values.shape[0], values.shape[-1]
        res_q, res_scale = residual[0].contiguous(), residual[1].contiguous()
        assert values.is_contiguous() and scales.is_contiguous() and values.device.type == "cpu"
        assert res_q.dtype == values.dtype and res_scale.dtype == scales.dtype
        assert res_q.shape[1:] == (heads, d) and res_scale.shape[1:] == (heads,)
        ids, at = token_ids.contiguous(), slots.contiguous()
        assert ids.dtype == at.dtype == torch.int64 and ids.numel() == at.numel()
        self.lib.write_store(
            res_q.data_ptr(), res_scale.data_ptr(), ids.data_ptr(), at.data_ptr(), ids.numel(),
            heads, d, values[0].numel() // d, values.data_ptr(), scales.data_ptr(),
        )  # fmt: skip

    def write_fp8(
        self,
        x: torch.Tensor,
        slot_mapping: torch.Tensor,
        cache_t: torch.Tensor,
        scale_t: torch.Tensor,
    ) -> None:
        """Quantize x [tokens, kvh, d] with dynamic scales into cache_t's slots, in one pass.

        cache_t: [kvh, num_blocks, block_size, d] FP8; scale_t: [kvh, num_blocks, block_size].
        Bit for bit fp8.dynamic_scale + fp8.quantize (reference.write_blocks).
        """
        assert x.dtype in (torch.bfloat16, torch.float32) and x.device.type == "cpu"
        assert cache_t.dtype in _FP8 and cache_t.is_contiguous() and scale_t.is_contiguous()
        assert x.shape[-1] <= 512 and scale_t.dtype == fp8.SCALE_DTYPE
        x = x.contiguous()
        slots = slot_mapping.contiguous()
        assert slots.dtype == torch.int64
        num_tokens, num_kv_heads, head_dim = x.shape
        self.lib.write_fp8(
            x.data_ptr(),
            num_tokens,
            num_kv_heads,
            head_dim,
            int(x.dtype == torch.float32),
            int(cache_t.dtype == torch.float8_e5m2),
            fp8.SCALE_ROUND_UP / fp8.fp8_max(cache_t.dtype),
            slots.data_ptr(),
            cache_t[0].numel() // head_dim,
            cache_t.data_ptr(),
            scale_t.data_ptr(),
        )

    def write_rows(
        self, x: torch.Tensor, slot_mapping: torch.Tensor, cache_t: torch.Tensor
    ) -> None:
        """Store x [tokens, kvh, d] (rows of d, any token stride; float32 or bf16) in the slots
        of a float32 / bf16 cache_t [kvh, num_blocks, block_size, d]: index_copy_'s values
        (float32 -> bf16 rounds to nearest even) in one pass."""
        native = (torch.bfloat16, torch.float32)
        assert x.dtype in native and cache_t.dtype in native and cache_t.is_contiguous()
        num_tokens, num_kv_heads, head_dim = x.shape
        if x.stride(2) != 1 or x.stride(1) != head_dim:
            x = x.contiguous()
        slots = slot_mapping.contiguous()
        assert slots.dtype == torch.int64 and slots.numel() == num_tokens
        self.lib.write_rows(
            x.data_ptr(), x.stride(0), num_tokens, num_kv_heads, head_dim,
            int(x.dtype == torch.float32), slots.data_ptr(), cache_t[0].numel() // head_dim,
            cache_t.data_ptr(), int(cache_t.dtype == torch.float32),
        )  # fmt: skip

    @staticmethod
    def prefill_tail_supported(
        cache: LayerKVCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> bool:
        """Return whether prefill_tail runs this cache and these rows: an FP8 cache on the CPU
        with dynamic scales (no calibration), q / k / v of one dtype (bf16 or float32) with
        rows of d, head_dim <= 512 and a multiple of 8 (a power of two with a rotation)."""
        d = cache.k.shape[-1]
        return (
            cache.format.scale == "dynamic"
            and cache.k.device.type == "cpu"
            and cache.k_amax is None
            and q.dtype == k.dtype == v.dtype
            and k.dtype in (torch.bfloat16, torch.float32)
            and d <= 512
            and d % 8 == 0
            and (cache.rotation is None or d & (d - 1) == 0)
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        )
