"""The PyTorch reference attention over the paged cache (the CPU backend and the GPU oracle)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from infer8.attention import exact_tail, tail_prefill
from infer8.attention.backend import write_then_attend
from infer8.attention.cpu_native import NativeFP8Gather
from infer8.attention.kv_cache import LayerKVCache
from infer8.attention.metadata import AttentionMetadata
from infer8.attention.split_prefill import KeyRange, split_prefill_attention
from infer8.quant import fp8

Dequantize = Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]


logger = logging.getLogger(__name__)


def _dequantize_eager(xq: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return fp8.dequantize(xq, scale, dtype)


class CompiledDequantize:
    """torch.compile'd FP8 dequantization that falls back to eager torch if compiling fails.

    Compiling needs a C++ compiler at run time (inductor); a machine without one (a slim
    container image) must still serve, so the first failure switches to the eager path for good.
    """

    def __init__(self) -> None:
        self._compiled: Dequantize | None = torch.compile(_dequantize_eager, dynamic=True)

    @property
    def is_compiled(self) -> bool:
        """Return whether the compiled path is (still) in use."""
        return self._compiled is not None

    def __call__(self, xq: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self._compiled is not None:
            try:
                return self._compiled(xq, scale, dtype)
            except Exception as e:  # noqa: BLE001 - any compile failure: serve on, slower
                self._compiled = None
                reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else repr(e)
                logger.warning(
                    "torch.compile is unavailable (%s: %s); FP8 KV dequantization runs in "
                    "eager torch (correct, slower)",
                    type(e).__name__,
                    reason,
                )
        return _dequantize_eager(xq, scale, dtype)

    def probe(self) -> bool:
        """Compile once on a tiny input now (at start-up); return whether it worked."""
        xq = torch.zeros(2, 4, 8, dtype=torch.float8_e4m3fn)
        self(xq, torch.ones(2, 4, 1, dtype=torch.bfloat16), torch.bfloat16)
        return self.is_compiled


class TorchRefAttention:
    """Writes K/V into the paged cache and attends over it with SDPA.

    FP8 blocks are dequantized only for the blocks a step reads. Eager FP8 casts are slow on
    CPU (~0.7 G elements/s here): `use_native` gathers and dequantizes in one pass with a small
    C kernel (see cpu_native.py); without it, `use_compile` runs the dequantization through
    torch.compile (~8 G elements/s measured on the same machine).
    """

    def __init__(
        self,
        use_compile: bool = False,
        use_native: bool = False,
        dense_tail_max_len: int = tail_prefill.DENSE_TAIL_MAX_LEN,
    ) -> None:
        self.dense_tail_max_len = dense_tail_max_len
        # fresh prompts up to this length attend through the native two-value pass (first
        # values only): 0.66-0.79x SDPA's time from 16 to 512 bf16 tokens, 1.04x at 1,024
        self.native_causal_max_len = 512
        self._dequantize: Dequantize = _dequantize_eager
        self._buffers: dict[str, torch.Tensor] = {}
        # fresh prompts' two-value reads by (length, window, sinks): the same for every layer
        self._fresh_masks: dict[tuple[int, int, int], torch.Tensor] = {}
        # write_kv's inputs and their rotations: forward gets the same tensors as k_new /
        # v_new (an exact tail) and reuses them instead of rotating them a second time
        self._rotated: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._native = NativeFP8Gather.load() if use_native else None
        if use_compile and self._native is None:
            compiled = CompiledDequantize()
            if compiled.probe():
                logger.info("FP8 KV dequantization: torch.compile (no native C kernel)")
                self._dequantize = compiled

    def _rotate(self, x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        """Return x [n, heads, d] rotated (exact_tail.rotate); natively as a fast Walsh-Hadamard
        transform where it runs (one call instead of a matmul's several: ~2x at decode sizes)."""
        if self._native is not None and x.device.type == "cpu" and x.stride(-1) == 1:
            if x.dtype in (torch.bfloat16, torch.float32) and x.dim() == 3:
                return self._native.rotate(x)
        return exact_tail.rotate(x, rotation)

    def write_kv(
        self, cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store each new token's K/V in its slot, quantizing when the cache is FP8.

        k, v: [num_real_tokens, num_kv_heads, head_dim]
        """
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        self._rotated = None
        if cache.k_rotation is not None:
            k_in, v_in = k, v
            k = self._rotate(k, cache.k_rotation)
            if cache.rotate_values:
                v = self._rotate(v, cache.k_rotation)
            self._rotated = (k_in, v_in, k, v)
        if cache.k_amax is not None:  # calibration: per-channel running amax
            torch.maximum(cache.k_amax, k.abs().amax(dim=0).float(), out=cache.k_amax)
            torch.maximum(cache.v_amax, v.abs().amax(dim=0).float(), out=cache.v_amax)
        kernels = self._native if cache.k.device.type == "cpu" else None
        if kernels is not None and cache.k_scale is None:
            if kernels.elementwise_supported(cache.k) and kernels.elementwise_supported(k):
                # one pass from the projection's strided rows: index_copy_ took 3 ms per
                # tensor for a 4,096-token bf16 step
                kernels.write_rows(k, slot_mapping, cache.k)
                kernels.write_rows(v, slot_mapping, cache.v)
                return
        k_flat = cache.k.view(num_kv_heads, -1, head_dim)  # [kvh, num_slots, d]
        v_flat = cache.v.view(num_kv_heads, -1, head_dim)
        if cache.k_scale is None:
            # index_copy_ rather than `flat[:, slots] = ...` (index_put): 207 vs 303 us for a
            # 2,048-token chunk on the reference CPU, the same values
            k_flat.index_copy_(1, slot_mapping, k.transpose(0, 1).to(cache.k.dtype))
            v_flat.index_copy_(1, slot_mapping, v.transpose(0, 1).to(cache.v.dtype))
            return
        dtype = cache.k.dtype
        if (
            kernels is not None
            and cache.k_static_scale is None
            and k.dtype in (torch.bfloat16, torch.float32)
        ):
            assert cache.v_scale is not None
            # one pass per tensor: scale, quantize, store (~15 small torch ops otherwise)
            kernels.write_fp8(k, slot_mapping, cache.k, cache.k_scale)
            kernels.write_fp8(v, slot_mapping, cache.v, cache.v_scale)
            return
        for x, flat, scale_store, static in (
            (k, k_flat, cache.k_scale, cache.k_static_scale),
            (v, v_flat, cache.v_scale, cache.v_static_scale),
        ):
            if static is None:
                scale = fp8.dynamic_scale(x, dtype)  # [num_tokens, num_kv_heads]
                scale_store.view(num_kv_heads, -1)[:, slot_mapping] = scale.transpose(0, 1)
                q = fp8.quantize(x, scale[..., None], dtype)
            else:
                # static: [num_kv_heads, 1] per head or [num_kv_heads, head_dim] per channel
                assert cache.num_saturated is not None
                q, num_saturated = fp8.quantize_counting(x, static, dtype)
                cache.num_saturated += num_saturated
            flat[:, slot_mapping] = q.transpose(0, 1)

    def write_and_attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """write_kv, then forward (with k / v as this step's K/V where the cache has a tail).

        An all-decode batch on the CPU runs as one native call per layer
        (NativeFP8Gather.decode_layer: the same values, a dozen calls fewer).
        """
        n = meta.num_real_tokens
        tail = meta.tail if cache.kv_tail is not None else None
        native = self._native
        if (
            native is not None
            and not meta.prefill_seq_ids
            and len(meta.decode_seq_ids) == n == q.shape[0]
            and native.decode_layer_supported(cache, q, k, v)
        ):
            return native.decode_layer(
                q, k, v, cache, meta.slot_mapping, meta.decode_block_tables,
                meta.decode_seq_lens, scale, tail, checked=True,
            )  # fmt: skip
        if (
            native is not None
            and tail is not None
            and meta.prefill_seq_ids
            and native.prefill_tail_supported(cache, q, k, v)
        ):
            return self._prefill_with_tail(q, k[:n], v[:n], cache, meta, scale)
        if (
            native is not None
            and tail is None
            and meta.prefill_seq_ids
            and cache.k.dtype == k.dtype
            and cache.k_rotation is None
        ):
            # a 16/32-bit cache in the compute dtype stores k / v as they are: prompts
            # computed whole in this step attend over them, not over their blocks read back
            self.write_kv(cache, k[:n], v[:n], meta.slot_mapping)
            self._rotated = None
            return self._attend(q, cache, meta, scale, None, own=(k[:n], v[:n]))
        return write_then_attend(self, q, k, v, cache, meta, scale)

    def _prefill_with_tail(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """write_kv then forward for a step with prefill chunks and an exact tail, on the CPU:
        the same values, with the new K/V rotated, written, and their tail values computed in
        one native pass whose block values stand in for the gathered blocks of fresh prompts
        (a prompt computed whole in this step reads no block but its own)."""
        assert self._native is not None and meta.tail is not None and cache.kv_tail is not None
        native, tail, store = self._native, meta.tail, cache.kv_tail
        self._rotated = None
        n, kvh, d = k.shape
        cpu = torch.device("cpu")
        buffers = (
            self._buffer("prefill_res", (n, 2 * kvh, d), torch.float8_e4m3fn, cpu),
            self._buffer("prefill_res_scale", (n, 2 * kvh), fp8.SCALE_DTYPE, cpu),
            self._buffer("prefill_tail", (2, kvh, n, d), k.dtype, cpu),
            self._buffer("prefill_blocks", (2, kvh, n, d), k.dtype, cpu),
        )  # a layer's are read only by its own attention and store writes
        residual, tail_values, block_values = native.prefill_tail(
            k, v, meta.slot_mapping, cache, buffers
        )
        # prompts computed whole in this step (their chunk is their context) and short enough
        # for the dense two-value form: they read no block but their own, so no ring, no
        # stored sinks, and their rows' exact values start at 0
        starts, lens = meta.query_start_loc, meta.seq_lens
        fresh_ids = {
            i
            for i in meta.prefill_seq_ids
            if starts[i + 1] - starts[i] == lens[i] <= self.dense_tail_max_len
        }
        # every prefill chunk a fresh prompt (W1's prefill steps, with or without decodes):
        # their q and output rows are rotated inside their attention calls, the decode rows'
        # alone (_attend), instead of every row in two passes of their own
        in_kernel = cache.k_rotation is not None and len(fresh_ids) == len(meta.prefill_seq_ids)
        if cache.k_rotation is not None and not in_kernel:
            q = self._rotate(q, cache.k_rotation)
        native.write_store(store, residual, tail.sink_write_token_ids, tail.sink_write_slots)
        values = (tail_values[0].transpose(0, 1), tail_values[1].transpose(0, 1))
        rotate = (in_kernel, in_kernel and cache.rotate_values)
        fresh = (block_values, tail_values, fresh_ids)
        out = self._attend(q, cache, meta, scale, values, fresh, rotate)
        native.write_store(store, residual, tail.write_token_ids, tail.write_slots)
        if cache.k_rotation is not None and cache.rotate_values and not in_kernel:
            out = self._rotate(out, cache.k_rotation)  # H is its own inverse
        return out

    def _fresh_prompts(
        self,
        q: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        fresh: tuple[torch.Tensor, torch.Tensor, set[int]] | None,
        rotate: tuple[bool, bool],
        own: tuple[torch.Tensor, torch.Tensor] | None,
        out: torch.Tensor,
    ) -> set[int]:
        """Attend the prompts computed whole in this step that read only the step's K / V
        (_attend's `fresh` or `own`) in one native call, into out; return their ids."""
        native, starts, lens = self._native, meta.query_start_loc, meta.seq_lens
        seconds = None
        if fresh is not None:  # block values first, tail values second
            assert native is not None and meta.tail is not None
            ids = [i for i in meta.prefill_seq_ids if i in fresh[2]]
            blocks, exact, _ = fresh  # [2, kvh, n, d]: K, V
            keys, values = (blocks[0], exact[0]), (blocks[1], exact[1])
            window, sinks = meta.tail.window, meta.tail.num_sinks
            seconds = [self._fresh_reads(lens[i], window, sinks[i]) for i in ids]
        elif own is not None and native is not None and native.two_value_supported(q):
            limit = self.native_causal_max_len  # the causal pass over the step's rows
            ids = [i for i in meta.prefill_seq_ids if starts[i + 1] - starts[i] == lens[i] <= limit]
            k, v = own[0].transpose(0, 1), own[1].transpose(0, 1)  # [kvh, n, d] views
            keys, values = (k, k), (v, v)
        else:
            return set()
        if ids:
            spans = [(starts[i], lens[i]) for i in ids]
            target = out if out.is_contiguous() else torch.zeros(q.shape, dtype=q.dtype)
            native.two_value_prompts(q, keys, values, spans, seconds, scale, target, *rotate)
            if target is not out:
                for a, n in spans:
                    out[a : a + n] = target[a : a + n]
        return set(ids)

    def _fresh_reads(self, seq_len: int, window: int, num_sinks: int) -> torch.Tensor:
        """Return a fresh prompt's [seq_len, seq_len] uint8 reads (tail_prefill.dense_parts')."""
        key = (seq_len, window, num_sinks)
        reads = self._fresh_masks.get(key)  # lengths <= dense_tail_max_len: a bounded set
        if reads is None:
            reads = tail_prefill.fresh_reads(seq_len, window, num_sinks).to(torch.uint8)
            self._fresh_masks[key] = reads
        return reads

    def _buffer(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Return a reusable scratch tensor: one allocation per step shape, not per layer.

        Fresh CPU allocations fill at ~6.5 GB/s against ~30 GB/s for warm memory, and every
        layer of a step gathers the same number of blocks.
        """
        buf = self._buffers.get(name)
        if buf is None or buf.shape != shape or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(shape, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf

    def _read(
        self,
        cache_t: torch.Tensor,
        scale_t: torch.Tensor | None,
        static: torch.Tensor | None,
        block_table: torch.Tensor,
        out_dtype: torch.dtype,
        name: str | None = None,
    ) -> torch.Tensor:
        """Gather the blocks of `block_table` ([..., num_blocks]) and dequantize them.

        Returns [num_kv_heads, ..., num_blocks * block_size, head_dim] in out_dtype. With a
        `name` the gather lands in a reused buffer (valid until the next call with that name).
        """
        num_kv_heads, _, block_size, head_dim = cache_t.shape
        flat = block_table.reshape(-1)
        shape = (num_kv_heads, *block_table.shape[:-1], -1, head_dim)
        gathered = (num_kv_heads, flat.numel(), block_size, head_dim)
        native_dtypes = (torch.bfloat16, torch.float32)
        if scale_t is not None and self._native is not None and out_dtype in native_dtypes:
            out = (
                torch.empty(gathered, dtype=out_dtype, device=cache_t.device)
                if name is None
                else self._buffer(name, gathered, out_dtype, cache_t.device)
            )
            return self._native(
                cache_t, scale_t if static is None else None, static, flat, out
            ).view(shape)
        if name is None:
            blocks = cache_t.index_select(1, flat)
        else:
            buf = self._buffer(name, gathered, cache_t.dtype, cache_t.device)
            if self._native is not None and cache_t.device.type == "cpu":
                blocks = self._native.gather(cache_t, flat, buf)
            else:
                blocks = torch.index_select(cache_t, 1, flat, out=buf)
        blocks = blocks.view(shape)
        if scale_t is None:
            return blocks.to(out_dtype)
        if static is None:
            scale = scale_t.index_select(1, flat).view(shape[:-1])[..., None]
        else:  # [kvh or 1, d or 1] -> broadcast over the batch and token dims
            scale = static.view(static.shape[0], *([1] * (blocks.dim() - 2)), static.shape[-1])
        return self._dequantize(blocks, scale, out_dtype)

    def _decode(
        self,
        q: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        residuals: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Attend one query token per sequence over its cached context, GQA-aware.

        q: [B, num_heads, head_dim] -> [B, num_heads, head_dim]. Plain batched matmuls, one per
        KV head over its contiguous gathered blocks: on CPU this beats SDPA's flash kernel for
        single-token queries by several times.
        """
        table = meta.decode_block_tables
        if self._native is not None and self._native.decode_supported(cache, q.dtype):
            return self._native_decode(q, cache, meta, scale, new_kv)
        k = self._read(cache.k, cache.k_scale, cache.k_static_scale, table, q.dtype, "k")
        v = self._read(cache.v, cache.v_scale, cache.v_static_scale, table, q.dtype, "v")
        tail = meta.tail
        if new_kv is not None:  # the new tokens' tail values; older tail positions: below
            assert tail is not None and residuals is not None
            exact_tail.write_decode_new(k, new_kv[0], tail)
            exact_tail.write_decode_new(v, new_kv[1], tail)
        b, num_heads, head_dim = q.shape
        num_kv_heads, _, ctx_len, _ = k.shape  # k, v: [KVH, B, L, D]
        group = num_heads // num_kv_heads
        # query head h reads KV head h // group (transformers' repeat_kv order). One batched
        # matmul over (KV head, sequence) pairs, not one per KV head: a third of the small ops,
        # the same values (end to end no faster on the reference CPU: benchmarks/
        # decode_attention_ab.py measured 1.01x the step time, within noise).
        qh = q.view(b, num_kv_heads, group, head_dim).transpose(0, 1)
        qh = qh.reshape(num_kv_heads * b, group, head_dim)  # [KVH*B, G, D]
        keys = k.reshape(num_kv_heads * b, ctx_len, head_dim)
        scores = torch.bmm(qh, keys.transpose(1, 2)).float() * scale  # [KVH*B, G, L]
        width = 0 if tail is None or residuals is None else tail.decode_pos.shape[1]
        if width:  # tail positions: q.(block + residual) = the score above + q.residual
            assert tail is not None and residuals is not None
            pos = tail.decode_pos[None, :, None, :].expand(num_kv_heads, b, group, width)
            valid = tail.decode_valid[None, :, None, :]
            res_k = exact_tail.decode_residuals(residuals[0], b, width)
            corr = torch.bmm(qh, res_k.transpose(1, 2)).float() * scale
            scores.view(num_kv_heads, b, group, ctx_len).scatter_add_(
                3, pos, corr.view(num_kv_heads, b, group, width) * valid
            )
        seq_lens = meta.decode_seq_lens.to(scores.device)
        pad = torch.arange(ctx_len, device=scores.device) >= seq_lens[:, None]  # [B, L]
        pad = pad.view(1, b, 1, ctx_len)  # True past each sequence's end
        scores.view(num_kv_heads, b, group, ctx_len).masked_fill_(pad, -float("inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.bmm(probs, v.reshape(num_kv_heads * b, ctx_len, head_dim))
        if width:  # and p.(block + residual) = the output above + p.residual
            assert tail is not None and residuals is not None
            p_tail = probs.view(num_kv_heads, b, group, ctx_len).gather(3, pos)
            p_tail = (p_tail * valid.to(p_tail.dtype)).view(num_kv_heads * b, group, width)
            out = out + torch.bmm(p_tail, exact_tail.decode_residuals(residuals[1], b, width))
        return (
            out.view(num_kv_heads, b, group, head_dim)
            .transpose(0, 1)
            .reshape(b, num_heads, head_dim)
        )

    def _native_decode(
        self,
        q: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """_decode in one native pass per (sequence, KV head): blocks and the tail's residual
        store read in place."""
        assert self._native is not None
        lens = meta.decode_seq_lens  # built once per step, not per layer
        tail_args = None
        if new_kv is not None:
            tail = meta.tail
            assert tail is not None and cache.kv_tail is not None
            # the store rows read, the decode sequences' first
            tail_args = (*new_kv, *cache.kv_tail, tail.read_rows, tail.decode_pos,
                         tail.decode_valid)  # fmt: skip
        return self._native.decode_attention(
            q, cache, meta.decode_block_tables, lens, scale, tail_args
        )

    def forward(
        self,
        q: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        k_new: torch.Tensor | None = None,
        v_new: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend each sequence's new tokens over its cached context (causal within the chunk).

        q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]; padding
        tokens (index >= meta.num_real_tokens) get zeros. With an exact tail (meta.tail),
        k_new / v_new are this step's K/V ([num_real_tokens, num_kv_heads, head_dim]): their
        residuals over the FP8 block values give the tail's values (see exact_tail.py); sinks
        are stored before attention, the rings after.
        """
        if cache.k_rotation is not None:
            q = self._rotate(q, cache.k_rotation)
            done = self._rotated
            if done is not None and k_new is done[0] and v_new is done[1]:
                k_new, v_new = done[2], done[3]  # write_kv rotated these very tensors
            else:
                if k_new is not None:
                    k_new = self._rotate(k_new, cache.k_rotation)
                if v_new is not None and cache.rotate_values:
                    v_new = self._rotate(v_new, cache.k_rotation)
        self._rotated = None
        if meta.tail is not None and cache.kv_tail is None:  # a cache without a tail store
            meta = dataclasses.replace(meta, tail=None)
        if meta.tail is None:
            out = self._attend(q, cache, meta, scale, None)
        else:
            assert k_new is not None and v_new is not None
            assert cache.kv_tail is not None
            tail = meta.tail
            residual, values = self._tail_values(cache, k_new, v_new)
            store = cache.kv_tail
            write_store = exact_tail.write_store
            if self._native is not None and store[0].device.type == "cpu":
                write_store = self._native.write_store  # one pass, no index_put
            write_store(store, residual, tail.sink_write_token_ids, tail.sink_write_slots)
            out = self._attend(q, cache, meta, scale, values)
            write_store(store, residual, tail.write_token_ids, tail.write_slots)
        if cache.k_rotation is not None and cache.rotate_values:
            out = self._rotate(out, cache.k_rotation)  # H is its own inverse
        return out

    def _read_tail_store(
        self, store: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """Return the tail store's rows `rows` dequantized: [kvh, len(rows) * stride, d].

        With the native kernel, one pass (eager FP8 casts are the slow part of a decode step).
        """
        values, scales = store
        num_kv_heads, _, stride, head_dim = values.shape
        shape = (num_kv_heads, rows.numel(), stride, head_dim)
        if self._native is not None and dtype in (torch.bfloat16, torch.float32):
            out = torch.empty(shape, dtype=dtype, device=values.device)
            return self._native(values, scales, None, rows, out).view(num_kv_heads, -1, head_dim)
        deq = fp8.dequantize(
            values.index_select(1, rows), scales.index_select(1, rows)[..., None], dtype
        )
        return deq.view(num_kv_heads, -1, head_dim)

    def _tail_values(
        self, cache: LayerKVCache, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """Return the residual (values [n, 2 * kvh, d], scales [n, 2 * kvh]: K's heads, then
        V's) and the tail values of this step's K and V.

        One native pass over K and V together where it applies (dynamic scales, bf16/float32:
        the same bits as the torch functions, which serve everything else).
        """
        n, kvh, _ = k_new.shape
        kv = torch.stack([k_new, v_new], dim=1)  # [n, 2, kvh, d]
        native = self._native is not None and k_new.dtype in (torch.bfloat16, torch.float32)
        if native and cache.k_static_scale is None:
            assert self._native is not None
            res_q, res_scale, tail = self._native.tail_residual(kv, cache.k.dtype)
        else:
            statics = (cache.k_static_scale, cache.v_static_scale)
            res_q, res_scale, tail = exact_tail.tail_values(kv, cache.k.dtype, statics)
        return (res_q.view(n, 2 * kvh, -1), res_scale.view(n, 2 * kvh)), (tail[:, 0], tail[:, 1])

    def _attend(
        self,
        q: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None,
        fresh: tuple[torch.Tensor, torch.Tensor, set[int]] | None = None,
        rotate: tuple[bool, bool] = (False, False),
        own: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Attend q's decode rows and prefill chunks; with `fresh` (this step's block and tail
        values of K and V, [2, kvh, n, d] each, and the prefill sequences computed whole in
        this step), those prompts attend over the step's values without reading their blocks
        back, their q and output rotated in that call as `rotate` (q, output) asks, and the
        decode rows' q and output here. `own`: this step's K / V ([n, kvh, d]) exactly as the
        cache holds them (no tail): prompts computed whole in this step read them instead of
        their blocks."""
        out = torch.zeros_like(q)
        dtype = q.dtype
        tail = meta.tail
        residuals = None
        native_decode = self._native is not None and self._native.decode_supported(cache, dtype)
        all_fresh = fresh is not None and len(fresh[2]) == len(meta.prefill_seq_ids)
        # the dequantized store rows: for chunks after cached positions, and for decode rows
        # when the native decode (which reads the store itself) does not run
        if tail is not None and ((meta.prefill_seq_ids and not all_fresh) or not native_decode):
            assert cache.kv_tail is not None
            kv_res = self._read_tail_store(cache.kv_tail, tail.read_rows, dtype)
            num_kv_heads = kv_res.shape[0] // 2
            residuals = (kv_res[:num_kv_heads], kv_res[num_kv_heads:])
        if meta.decode_seq_ids:
            ids = meta.decode_token_ids
            decode_kv = new_kv
            if new_kv is not None and len(meta.decode_seq_ids) != q.shape[0]:
                decode_kv = (new_kv[0][ids], new_kv[1][ids])
            qd = q[ids]
            if rotate[0]:  # as the prefill chunks' calls rotate theirs
                assert cache.k_rotation is not None
                qd = self._rotate(qd, cache.k_rotation)
            o = self._decode(qd, cache, meta, scale, decode_kv, residuals)
            if rotate[1]:
                assert cache.k_rotation is not None
                o = self._rotate(o, cache.k_rotation)
            if len(meta.decode_seq_ids) == q.shape[0]:
                return o  # an all-decode batch: token i is sequence i
            out[ids] = o
        done = self._fresh_prompts(q, meta, scale, fresh, rotate, own, out)
        for i in meta.prefill_seq_ids:
            if i in done:
                continue
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            q_len, seq_len = end - start, meta.seq_lens[i]
            if own is not None and q_len == seq_len:  # [KVH, seq_len, D] views
                k, v = own[0][start:end].transpose(0, 1), own[1][start:end].transpose(0, 1)
            else:
                table = meta.block_tables[i, : -(-seq_len // cache.block_size)]
                # [KVH, seq_len, D]
                k = self._read(cache.k, cache.k_scale, cache.k_static_scale, table, dtype)
                v = self._read(cache.v, cache.v_scale, cache.v_static_scale, table, dtype)
                k, v = k[:, :seq_len], v[:, :seq_len]
            qs = q[start:end].transpose(0, 1)  # [H, q_len, D]
            if tail is not None:
                assert new_kv is not None and residuals is not None
                o = tail_prefill.sequence_attention(
                    qs, (k, v), residuals, (new_kv[0][start:end], new_kv[1][start:end]),
                    tail, i, scale, self.dense_tail_max_len, self._native,
                )  # fmt: skip
                out[start:end] = o.transpose(0, 1)
                continue
            if q_len != seq_len:
                # a chunk after cached positions: key ranges each query sees differently,
                # merged by log-sum-exp (no [q_len, keys] mask: see split_prefill.py)
                s0 = seq_len - q_len
                ranges = [
                    KeyRange(k[:, :s0], v[:, :s0]),
                    KeyRange(k[:, s0:], v[:, s0:], causal=True),
                ]
                o = split_prefill_attention(qs, ranges, None, scale)
                out[start:end] = o.transpose(0, 1)
                continue
            native = self._native
            if native is not None and seq_len <= self.native_causal_max_len:
                if native.two_value_supported(qs):  # float32 / bf16 on the CPU
                    o = native.causal_attention(qs, k, v, scale)
                    out[start:end] = o.transpose(0, 1)
                    continue
            # 4-D inputs: on CPU, 3-D ones fall back to SDPA's unfused math path (explicit
            # mask, bmm + softmax), measured 6x slower on a 2,048-token prompt.
            o = F.scaled_dot_product_attention(
                qs[None],
                k[None],
                v[None],
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            out[start:end] = o[0].transpose(0, 1)
        return out
