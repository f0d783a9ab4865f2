"""The native CPU kernels (csrc/*.c) called through ctypes: the FP8 cache's gather and writes,
the exact tail's rows, decode attention and the whole decode layer; the element-wise passes
(native_elementwise.py) and prefill attention (native_prefill.py) are parts of the same class.

Eager FP8 casts run at ~0.7 G elements/s on these CPUs and torch.compile's at ~8; plain C loops,
vectorized by the compiler, are several times faster and skip the FP8 gather buffer. They are
built once per machine (native_build.py) and loaded with ctypes; without a compiler the engine
falls back to the torch path.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from infer8.attention.exact_tail import TailMetadata
    from infer8.attention.kv_cache import LayerKVCache

from infer8.attention.native_build import build_library
from infer8.attention.native_elementwise import NativeElementwise
from infer8.attention.native_prefill import NativePrefillAttention
from infer8.quant import fp8

logger = logging.getLogger(__name__)

_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}
_SCALE_PER_AMAX = {dt: fp8.SCALE_ROUND_UP / fp8.fp8_max(dt) for dt in fp8.FP8_DTYPES}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_NO_TAIL_ARGS = (None, 0, 0, None, None, 0, None, None, 0, None, None, 0)  # see _tail_args


class NativeFP8Gather(NativeElementwise, NativePrefillAttention):
    """The compiled CPU kernels (FP8 gather and write, decode and band attention, the
    rotation, a layer's element-wise passes), called through ctypes."""

    def __init__(self, lib_path: Path) -> None:
        lib = ctypes.CDLL(str(lib_path))
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float

        def bind(name: str, *argtypes: type) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = list(argtypes), None
            return fn

        self._fn = bind("infer8_gather_dequant_fp8", p, p, p, p, i64, i64, i64, i64, i64, i32,
                        p, p, i32)  # fmt: skip
        self._gather = bind("infer8_gather_blocks", p, p, i64, i64, i64, i64, p)
        self._residual = bind("infer8_tail_residual", p, i64, i64, i32, i32, f32, f32, p, p, p)
        self._write_store = bind("infer8_write_store", p, p, p, p, i64, i64, i64, i64, p, p)
        self._write_rows = bind("infer8_write_rows", p, i64, i64, i64, i64, i32, p, i64, p, i32)
        self._write = bind("infer8_write_fp8", p, i64, i64, i64, i32, i32, f32, p, i64, p, p)
        self._decode = bind("infer8_decode_attention", p, p, p, p, p, i32, p, i64, p, i64, i64,
                            i64, i64, i64, i64, f32, i32, p, p, p, p, p, i64, i64, p, p, i64,
                            p)  # fmt: skip
        self._decode_layer = bind("infer8_decode_layer", p, i64, p, p, i64, p, p, p, p, p, i32,
                                  p, i64, p, i64, i64, i64, i64, i64, i64, f32, i32, i32, i32,
                                  f32, p, p, p, i64, i64, p, p, i64, f32, p, p, i64, p, p, i64,
                                  p)  # fmt: skip
        self._hadamard = bind("infer8_hadamard_rows", p, i64, i64, i64, i64, i64, i32, p)
        self._prefill_tail = bind("infer8_prefill_tail", p, i64, p, i64, i64, i64, i64, i32,
                                  i32, i32, i32, f32, f32, p, i64, p, p, p, p, p, p, p,
                                  p)  # fmt: skip
        self._rms_norm = bind("infer8_rms_norm", p, i64, p, p, i64, i64, f32, i32, p)
        self._silu_and_mul = bind("infer8_silu_and_mul", p, i64, i64, i32, p)
        self._greedy = bind("infer8_greedy_rows", p, i64, i64, f32, p)
        self._candidates = bind("infer8_nucleus_candidates", p, i64, i64, p, p, i64, p, p, p, p)
        self._rope = bind("infer8_rope", p, i64, i64, i64, i64, p, p, i32)
        self._band = bind("infer8_band_attention", p, p, p, i64, i64, i64, i64, i64, i64, i64,
                          f32, i32, p, p)  # fmt: skip
        self._two_value = bind("infer8_two_value_attention", p, i64, i64, p, i64, p, i64, p,
                               i64, p, i64, i64, i64, p, i64, i64, i64, i64, i64, i64, f32, i32,
                               p, i64, i64, i32, i32)  # fmt: skip
        self._two_value_prompts = bind("infer8_two_value_prompts", p, i64, i64, p, i64, p, i64,
                                       p, i64, p, i64, i64, i64, p, i64, p, p, i64, i64, i64,
                                       f32, i32, p, i64, i64, i32, i32)  # fmt: skip
        self._ones: dict[int, torch.Tensor] = {}
        self._no_second = torch.zeros(0, dtype=torch.uint8)  # causal_attention: no second value
        self._step_tail: tuple[Any, ...] | None = None  # decode_layer: (tail, its arguments)

    @classmethod
    def load(cls) -> NativeFP8Gather | None:
        """Build (if needed) and load the kernel; None, with a warning, if that fails."""
        try:
            return cls(build_library())
        except (OSError, RuntimeError) as e:
            logger.warning(
                "native FP8 gather unavailable (%s); FP8 blocks are gathered and dequantized "
                "by torch (compiled if a C++ compiler works, else eager)",
                e,
            )
            return None

    def gather(
        self, cache_t: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """Fill out [kvh, n, block_size, d] with cache_t's blocks `block_ids` (same dtype)."""
        assert cache_t.is_contiguous() and out.is_contiguous() and out.dtype == cache_t.dtype
        assert cache_t.device.type == "cpu" and block_ids.dtype == torch.int64
        ids = block_ids.contiguous()
        num_kv_heads, num_blocks = cache_t.shape[:2]
        block_bytes = cache_t[0, 0].numel() * cache_t.element_size()
        self._gather(
            cache_t.data_ptr(),
            ids.data_ptr(),
            ids.numel(),
            num_kv_heads,
            num_blocks,
            block_bytes,
            out.data_ptr(),
        )
        return out

    def __call__(
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
        self._fn(
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
        self._residual(
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
        scales), and their exact-tail values, in one pass: bit for bit torch_ref's write_kv then
        _tail_values. Returns ((E4M3 residuals [n, 2 * kvh, d], scales [n, 2 * kvh]: K's heads,
        then V's), tail values, block values), the last two [2, kvh, n, d] in x's dtype; into
        `out` (those four tensors) where given (fresh pages cost more than this pass)."""
        n, kvh, d = k.shape
        assert k.dtype == v.dtype and k.dtype in (torch.bfloat16, torch.float32) and d <= 512
        assert cache.k.dtype in _FP8 and cache.k_scale is not None and cache.v_scale is not None
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
        rotate = cache.k_rotation is not None
        self._prefill_tail(
            k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), n, kvh, d,
            int(k.dtype == torch.float32), int(rotate), int(rotate and cache.rotate_values),
            int(cache.k.dtype == torch.float8_e5m2),
            fp8.SCALE_ROUND_UP / fp8.fp8_max(cache.k.dtype),
            fp8.SCALE_ROUND_UP / fp8.fp8_max(torch.float8_e4m3fn), slots.data_ptr(),
            cache.k[0].numel() // d, cache.k.data_ptr(), cache.k_scale.data_ptr(),
            cache.v.data_ptr(), cache.v_scale.data_ptr(), res_q.data_ptr(),
            res_scale.data_ptr(), tail.data_ptr(), block.data_ptr(),
        )  # fmt: skip
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
        self._write_store(
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
        Bit for bit fp8.dynamic_scale + fp8.quantize (torch_ref.write_kv's torch path).
        """
        assert x.dtype in (torch.bfloat16, torch.float32) and x.device.type == "cpu"
        assert cache_t.dtype in _FP8 and cache_t.is_contiguous() and scale_t.is_contiguous()
        assert x.shape[-1] <= 512 and scale_t.dtype == fp8.SCALE_DTYPE
        x = x.contiguous()
        slots = slot_mapping.contiguous()
        assert slots.dtype == torch.int64
        num_tokens, num_kv_heads, head_dim = x.shape
        self._write(
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
        self._write_rows(
            x.data_ptr(), x.stride(0), num_tokens, num_kv_heads, head_dim,
            int(x.dtype == torch.float32), slots.data_ptr(), cache_t[0].numel() // head_dim,
            cache_t.data_ptr(), int(cache_t.dtype == torch.float32),
        )  # fmt: skip

    @staticmethod
    def decode_supported(cache: LayerKVCache, dtype: torch.dtype) -> bool:
        """Return whether decode_attention runs this cache (no static scales) and dtype."""
        return (
            cache.k.dtype in _KINDS
            and cache.k_static_scale is None
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
        [B, width] float32): the exact tail as TorchRefAttention._decode applies it, the
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
        self._decode(
            q.data_ptr(), cache.k.data_ptr(), cache.v.data_ptr(),
            ptr(cache.k_scale) if fp8_cache else None, ptr(cache.v_scale) if fp8_cache else None,
            _KINDS[cache.k.dtype], table.data_ptr(), table.shape[1], lens.data_ptr(), b,
            num_kv_heads, num_heads // num_kv_heads, num_blocks, block_size, head_dim, scale,
            int(q.dtype == torch.float32), new_k, new_v, store, store_scale, read_rows, seats,
            stride, pos, valid, width, out.data_ptr(),
        )  # fmt: skip
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
            NativeFP8Gather.decode_supported(cache, q.dtype)
            and cache.k_amax is None
            and d <= 512
            and (cache.k_rotation is None or d & (d - 1) == 0)
            and q.stride(-1) == k.stride(-1) == 1
            and q.stride(1) == k.stride(1) == d
            and (k.stride() == v.stride() or k.shape[0] == 1)
        )

    @staticmethod
    def prefill_tail_supported(
        cache: LayerKVCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> bool:
        """Return whether prefill_tail runs this cache and these rows: an FP8 cache on the CPU
        with dynamic scales (no calibration), q / k / v of one dtype (bf16 or float32) with
        rows of d, head_dim <= 512 and a multiple of 8 (a power of two with a rotation)."""
        d = cache.k.shape[-1]
        return (
            cache.k.dtype in _FP8
            and cache.k.device.type == "cpu"
            and cache.k_scale is not None
            and cache.k_static_scale is None
            and cache.k_amax is None
            and q.dtype == k.dtype == v.dtype
            and k.dtype in (torch.bfloat16, torch.float32)
            and d <= 512
            and d % 8 == 0
            and (cache.k_rotation is None or d & (d - 1) == 0)
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
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
        tail: TailMetadata | None,
        checked: bool = False,
    ) -> torch.Tensor:
        """TorchRefAttention's write_kv then forward for an all-decode batch (token b is
        sequence b), in one native call (csrc/decode_attention.c: infer8_decode_layer).

        q [B, H, d], k / v [B, kvh, d]: rows of d (views of the fused projection's output
        welcome); the cache's rotation, FP8 write and exact tail (`tail`: this step's, with the
        cache's store) as the torch reference applies them. Returns [B, H, d]. `checked`: the
        caller has just seen decode_layer_supported hold (TorchRefAttention, each layer).
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
        fp8_cache = cache.k_scale is not None
        per_amax = _SCALE_PER_AMAX[cache.k.dtype] if fp8_cache else 0.0
        store = store_scale = None
        tail_args: tuple[int | None, ...] = _NO_TAIL_ARGS
        if tail is not None:
            assert cache.kv_tail is not None and cache.kv_tail[0].is_contiguous()
            store, store_scale = cache.kv_tail
            tail_args = self._tail_args(tail, store)

        def ptr(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        read_rows, seats, stride, pos, valid, width, *sink_args = tail_args
        sinks, sink_slots, num_sinks, rings, ring_slots, num_rings = sink_args
        self._decode_layer(
            q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0), slots.data_ptr(),
            cache.k.data_ptr(), cache.v.data_ptr(), ptr(cache.k_scale), ptr(cache.v_scale),
            _KINDS[cache.k.dtype], table.data_ptr(), table.shape[1], lens.data_ptr(), b,
            num_kv_heads, num_heads // num_kv_heads, num_blocks, block_size, d, scale,
            int(q.dtype == torch.float32), int(cache.k_rotation is not None),
            int(cache.rotate_values), per_amax, ptr(store), ptr(store_scale), read_rows,
            seats, stride, pos, valid, width, _SCALE_PER_AMAX[torch.float8_e4m3fn], sinks,
            sink_slots, num_sinks, rings, ring_slots, num_rings, out.data_ptr(),
        )  # fmt: skip
        return out

    def _tail_args(self, tail: TailMetadata, store: torch.Tensor) -> tuple[int | None, ...]:
        """decode_layer's tail arguments (read rows, seats, stride, pos, valid, width, sinks,
        sink slots, their count, ring tokens, ring slots, their count) from a step's tail
        metadata: the same for every layer of the step (their stores share one shape), so kept
        for the last `tail` seen, which is held so that its id is not reused."""
        if self._step_tail is not None and self._step_tail[0] is tail:
            return self._step_tail[1]
        parts = [t.contiguous() for t in (tail.read_rows, tail.decode_pos, tail.decode_valid,
                 tail.sink_write_token_ids, tail.sink_write_slots, tail.write_token_ids,
                 tail.write_slots)]  # fmt: skip
        read_rows, pos, valid, sinks, sink_slots, rings, ring_slots = parts
        args = (read_rows.data_ptr(), store.shape[1], store.shape[2], pos.data_ptr(),
                valid.data_ptr(), tail.decode_pos.shape[1], sinks.data_ptr(),
                sink_slots.data_ptr(), sinks.numel(), rings.data_ptr(), ring_slots.data_ptr(),
                rings.numel())  # fmt: skip
        self._step_tail = (tail, args, parts)  # parts: the pointers' owners
        return args
