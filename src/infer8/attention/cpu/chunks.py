"""The CPU backend's attention over a step's rows (CpuAttention's half that reads the cache):
decode rows through the native decode, prefill chunks one sequence at a time by the cheapest
exact form (the native causal or two-value pass for short prompts, torch's flash kernel per key
range for long ones, the exact tail's two forms in tail_prefill.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infer8.attention.cpu import tail_prefill
from infer8.attention.cpu.split_prefill import KeyRange, split_prefill_attention
from infer8.attention.kv_cache import LayerKVCache
from infer8.attention.metadata import AttentionMetadata
from infer8.kernels.cpu import NativeKernels
from infer8.quant import fp8


class ChunkAttention:
    """Attends a step's rows over the cache; holds scratch buffers and a memo of fresh prompts'
    read masks (pure functions of their lengths), nothing a later call depends on."""

    def __init__(self, kernels: NativeKernels, dense_tail_max_len: int) -> None:
        self.kernels = kernels
        self.dense_tail_max_len = dense_tail_max_len
        # fresh prompts up to this length attend through the native two-value pass (first
        # values only): 0.66-0.79x SDPA's time from 16 to 512 bf16 tokens, 1.04x at 1,024
        self.native_causal_max_len = 512
        self._buffers: dict[str, torch.Tensor] = {}
        # fresh prompts' two-value reads by (length, window, sinks): the same for every layer
        self._fresh_masks: dict[tuple[int, int, int], torch.Tensor] = {}

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Return x [n, heads, d] times the Hadamard matrix: a native fast Walsh-Hadamard
        transform (one call instead of a matmul's several: ~2x at decode sizes)."""
        return self.kernels.elementwise.rotate(x)

    def prefill_with_tail(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write and attend a step with prefill chunks and an exact tail: the new K/V [n, kvh, d]
        rotated, written, and their tail values computed in one native pass whose block values
        stand in for the gathered blocks of fresh prompts (a prompt computed whole in this step
        reads no block but its own)."""
        assert meta.tail is not None and cache.tail_store is not None
        kv, tail, store = self.kernels.kv, meta.tail, cache.tail_store
        n, kvh, d = k.shape
        cpu = torch.device("cpu")
        buffers = (
            self._buffer("prefill_res", (n, 2 * kvh, d), torch.float8_e4m3fn, cpu),
            self._buffer("prefill_res_scale", (n, 2 * kvh), fp8.SCALE_DTYPE, cpu),
            self._buffer("prefill_tail", (2, kvh, n, d), k.dtype, cpu),
            self._buffer("prefill_blocks", (2, kvh, n, d), k.dtype, cpu),
        )  # a layer's are read only by its own attention and store writes
        residual, tail_values, block_values = kv.prefill_tail(
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
        in_kernel = cache.format.hadamard and len(fresh_ids) == len(meta.prefill_seq_ids)
        if cache.format.hadamard and not in_kernel:
            q = self.rotate(q)
        kv.write_store(store, residual, tail.sink_write_token_ids, tail.sink_write_slots)
        values = (tail_values[0].transpose(0, 1), tail_values[1].transpose(0, 1))
        rotate = (in_kernel, in_kernel and cache.format.hadamard)
        fresh = (block_values, tail_values, fresh_ids)
        out = self.attend(q, cache, meta, scale, values, fresh, rotate)
        kv.write_store(store, residual, tail.write_token_ids, tail.write_slots)
        if cache.format.hadamard and not in_kernel:
            out = self.rotate(out)  # H is its own inverse
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
        (attend's `fresh` or `own`) in one native call, into out; return their ids."""
        native, starts, lens = self.kernels.prefill, meta.query_start_loc, meta.seq_lens
        seconds = None
        if fresh is not None:  # block values first, tail values second
            assert meta.tail is not None
            ids = [i for i in meta.prefill_seq_ids if i in fresh[2]]
            blocks, exact, _ = fresh  # [2, kvh, n, d]: K, V
            keys, values = (blocks[0], exact[0]), (blocks[1], exact[1])
            window, sinks = meta.tail.window, meta.tail.num_sinks
            seconds = [self._fresh_reads(lens[i], window, sinks[i]) for i in ids]
        elif own is not None and native.two_value_supported(q):
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
        block_table: torch.Tensor,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        """Gather the blocks of `block_table` ([num_blocks]) and dequantize them: [num_kv_heads,
        num_blocks * block_size, head_dim] in out_dtype, in one native pass."""
        num_kv_heads, _, block_size, head_dim = cache_t.shape
        flat = block_table.reshape(-1)
        shape = (num_kv_heads, -1, head_dim)
        gathered = (num_kv_heads, flat.numel(), block_size, head_dim)
        kv = self.kernels.kv
        if scale_t is not None:
            out = torch.empty(gathered, dtype=out_dtype)
            return kv.dequantize_blocks(cache_t, scale_t, None, flat, out).view(shape)
        return cache_t.index_select(1, flat).view(shape).to(out_dtype)

    def _decode(
        self,
        q: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """Attend one query per decode sequence ([B, heads, d]) over its blocks, in one native
        pass per (sequence, KV head): blocks and the tail's residual store read in place."""
        tail_args = None
        if new_kv is not None:
            tail = meta.tail
            assert tail is not None and cache.tail_store is not None
            # the store rows read, the decode sequences' first
            tail_args = (*new_kv, *cache.tail_store, tail.read_rows, tail.decode_pos,
                         tail.decode_valid)  # fmt: skip
        return self.kernels.decode.decode_attention(
            q, cache, meta.decode_block_tables, meta.decode_seq_lens, scale, tail_args
        )

    def _read_tail_store(
        self, store: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """Return the tail store's rows `rows` dequantized: [kvh, len(rows) * stride, d], in one
        native pass."""
        values, scales = store
        num_kv_heads, _, stride, head_dim = values.shape
        out = torch.empty((num_kv_heads, rows.numel(), stride, head_dim), dtype=dtype)
        deq = self.kernels.kv.dequantize_blocks(values, scales, None, rows, out)
        return deq.view(num_kv_heads, -1, head_dim)

    def attend(
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
        all_fresh = fresh is not None and len(fresh[2]) == len(meta.prefill_seq_ids)
        # the dequantized store rows, for chunks after cached positions (the native decode
        # reads the store itself)
        if tail is not None and meta.prefill_seq_ids and not all_fresh:
            assert cache.tail_store is not None
            kv_res = self._read_tail_store(cache.tail_store, tail.read_rows, dtype)
            num_kv_heads = kv_res.shape[0] // 2
            residuals = (kv_res[:num_kv_heads], kv_res[num_kv_heads:])
        if meta.decode_seq_ids:
            ids = meta.decode_token_ids
            decode_kv = new_kv
            if new_kv is not None and len(meta.decode_seq_ids) != q.shape[0]:
                decode_kv = (new_kv[0][ids], new_kv[1][ids])
            qd = q[ids]
            if rotate[0]:  # as the prefill chunks' calls rotate theirs
                assert cache.format.hadamard
                qd = self.rotate(qd)
            o = self._decode(qd, cache, meta, scale, decode_kv)
            if rotate[1]:
                assert cache.format.hadamard
                o = self.rotate(o)
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
                k = self._read(cache.k, cache.k_scale, table, dtype)
                v = self._read(cache.v, cache.v_scale, table, dtype)
                k, v = k[:, :seq_len], v[:, :seq_len]
            qs = q[start:end].transpose(0, 1)  # [H, q_len, D]
            if tail is not None:
                assert new_kv is not None and residuals is not None
                o = tail_prefill.sequence_attention(
                    qs, (k, v), residuals, (new_kv[0][start:end], new_kv[1][start:end]),
                    tail, i, scale, self.dense_tail_max_len, self.kernels.prefill,
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
            native = self.kernels.prefill
            if seq_len <= self.native_causal_max_len and native.two_value_supported(qs):
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
