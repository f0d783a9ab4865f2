"""The reference attention: plain torch over the paged cache, one sequence at a time.

The oracle every backend is tested against, and the backend for what no faster one runs
(static FP8 scales and calibration on CPU, CPUs without a C compiler, GPUs before sm_89 with
an exact tail). It writes the cache exactly as the other backends do, so a cache written by
one can be read by another:

1. K/V rotated (a Hadamard cache: q too), calibration amax observed, then K/V stored in their
   slots: as they are, or FP8 with a dynamic scale per token and KV head (stored beside the
   block), or with the static scales.
2. With an exact tail, the step's residuals are computed (exact_tail.tail_values) and the sinks
   stored before attention, the ring after it (a long chunk would otherwise overwrite positions
   it still reads).
3. Each sequence's queries attend over its blocks, dequantized, causally within the chunk.
   With a tail a query reads two values of each key: the block value, or block + residual at
   the positions the tail keeps exact for it (two_value_attention).
"""

from __future__ import annotations

import torch

from infer8.attention import exact_tail
from infer8.attention.exact_tail import TailMetadata, first_exact, first_exact_t
from infer8.attention.kv_cache import LayerKVCache
from infer8.attention.metadata import AttentionMetadata
from infer8.quant import fp8


class ReferenceAttention:
    """Writes K/V into the paged cache and attends over it in torch ops; holds nothing."""

    def build_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Return the step's metadata as is (the reference reads the common fields)."""
        return meta

    def write_and_attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Store the step's K/V, then attend: q [num_tokens, heads, d], k / v [num_tokens,
        kv_heads, d] -> [num_tokens, heads, d]; padding tokens (index >= num_real_tokens) get
        zeros."""
        n = meta.num_real_tokens
        k, v = k[:n], v[:n]
        if cache.rotation is not None:
            k, v = exact_tail.rotate(k, cache.rotation), exact_tail.rotate(v, cache.rotation)
        write_blocks(cache, k, v, meta.slot_mapping)
        tail = meta.tail if cache.tail_store is not None else None
        new_values = None
        if tail is not None:
            assert cache.tail_store is not None
            statics = (cache.k_static_scale, cache.v_static_scale)
            kv = torch.stack([k, v], dim=1)  # [n, 2, kvh, d]
            res_q, res_scale, values = exact_tail.tail_values(kv, cache.format.dtype, statics)
            residual = (res_q.view(n, -1, k.shape[-1]), res_scale.view(n, -1))
            new_values = (values[:, 0], values[:, 1])
            exact_tail.write_store(
                cache.tail_store, residual, tail.sink_write_token_ids, tail.sink_write_slots
            )
        out = attend_cache(q, cache, meta, scale, new_values)
        if tail is not None:
            exact_tail.write_store(
                cache.tail_store, residual, tail.write_token_ids, tail.write_slots
            )
        return out


def attend_cache(
    q: torch.Tensor,
    cache: LayerKVCache,
    meta: AttentionMetadata,
    scale: float,
    new_values: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attend each sequence's queries (q's rows) over what the cache holds, its chunk already
    written; a Hadamard cache rotates q and the output back. With the step's tail (meta.tail,
    the cache's store), new_values are the tail values of the step's rotated K and V ([n,
    kv_heads, d] each)."""
    tail = meta.tail if cache.tail_store is not None else None
    if cache.rotation is not None:
        q = exact_tail.rotate(q, cache.rotation)
    out = torch.zeros_like(q)
    residuals = _read_residuals(cache, tail, q.dtype)
    decode_index = {seq: b for b, seq in enumerate(meta.decode_seq_ids)}
    for i in range(meta.num_seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        seq_len = meta.seq_lens[i]
        keys, values = read_blocks(cache, meta.block_tables[i], seq_len, q.dtype)
        exact = None
        if tail is not None:
            assert new_values is not None and residuals is not None
            new = (new_values[0][start:end], new_values[1][start:end])
            if i in decode_index:
                exact = _decode_exact(keys, values, residuals, new, tail, decode_index[i])
            else:
                exact = _prefill_exact(keys, values, residuals, new, tail, i)
        out[start:end] = attend(q[start:end], keys, values, scale, exact)
    if cache.rotation is not None:
        out = exact_tail.rotate(out, cache.rotation)  # H is its own inverse
    return out


def write_kv(
    cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store each token's K/V [n, kv_heads, d] in its slot: rotated where the cache is, then
    as write_blocks stores them."""
    if cache.rotation is not None:
        k, v = exact_tail.rotate(k, cache.rotation), exact_tail.rotate(v, cache.rotation)
    write_blocks(cache, k, v, slot_mapping)


def write_blocks(
    cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store each token's K/V [n, kv_heads, d] (already rotated for a Hadamard cache) in its
    slot, in the cache's format."""
    fmt = cache.format
    if cache.k_amax is not None:  # calibration: per-channel running amax (of what is stored)
        assert cache.v_amax is not None
        torch.maximum(cache.k_amax, k.abs().amax(dim=0).float(), out=cache.k_amax)
        torch.maximum(cache.v_amax, v.abs().amax(dim=0).float(), out=cache.v_amax)
    kvh, d = k.shape[1], k.shape[2]
    for x, blocks, scales, static in (
        (k, cache.k, cache.k_scale, cache.k_static_scale),
        (v, cache.v, cache.v_scale, cache.v_static_scale),
    ):
        flat = blocks.view(kvh, -1, d)  # [kvh, num_slots, d]
        if fmt.scale == "none":
            flat[:, slot_mapping] = x.transpose(0, 1).to(fmt.dtype)
        elif fmt.scale == "dynamic":
            assert scales is not None
            s = fp8.dynamic_scale(x, fmt.dtype)  # [n, kvh]
            scales.view(kvh, -1)[:, slot_mapping] = s.transpose(0, 1)
            flat[:, slot_mapping] = fp8.quantize(x, s[..., None], fmt.dtype).transpose(0, 1)
        else:  # static: [kvh or 1, d or 1], broadcast over tokens
            assert static is not None and cache.num_saturated is not None
            xq, num_saturated = fp8.quantize_counting(x, static, fmt.dtype)
            cache.num_saturated += num_saturated
            flat[:, slot_mapping] = xq.transpose(0, 1)


def read_blocks(
    cache: LayerKVCache, block_table: torch.Tensor, seq_len: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return one sequence's K and V ([kv_heads, seq_len, d] in dtype), dequantized."""
    fmt, bs = cache.format, cache.block_size
    table = block_table[: -(-seq_len // bs)]
    out = []
    for blocks, scales, static in (
        (cache.k, cache.k_scale, cache.k_static_scale),
        (cache.v, cache.v_scale, cache.v_static_scale),
    ):
        kvh, d = blocks.shape[0], blocks.shape[-1]
        x = blocks[:, table].reshape(kvh, -1, d)[:, :seq_len]
        if fmt.scale == "none":
            out.append(x.to(dtype))
        elif fmt.scale == "dynamic":
            assert scales is not None
            s = scales[:, table].reshape(kvh, -1)[:, :seq_len, None]
            out.append(fp8.dequantize(x, s, dtype))
        else:
            assert static is not None
            out.append(fp8.dequantize(x, static.view(static.shape[0], 1, static.shape[1]), dtype))
    return out[0], out[1]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    exact: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attend a chunk's queries q [q_len, heads, d] over its sequence's keys k / v [kv_heads,
    seq_len, d] (the chunk is the last q_len positions), causally, in float32; GQA: query head
    h reads KV head h // (heads / kv_heads). exact: (K, V at tail precision, [q_len, seq_len]
    bool: which (query, key) pairs read them instead of k / v)."""
    q_len, heads, _ = q.shape
    seq_len, group = k.shape[1], heads // k.shape[0]
    qh = q.transpose(0, 1).float()  # [heads, q_len, d]

    def expand(x: torch.Tensor) -> torch.Tensor:
        return x.float().repeat_interleave(group, dim=0)  # [heads, seq_len, d]

    scores = qh @ expand(k).transpose(1, 2) * scale  # [heads, q_len, seq_len]
    if exact is not None:
        reads = exact[2][None]
        scores = torch.where(reads, qh @ expand(exact[0]).transpose(1, 2) * scale, scores)
    query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
    future = torch.arange(seq_len, device=q.device)[None, :] > query_pos
    probs = torch.softmax(scores.masked_fill(future, -float("inf")), dim=-1)
    if exact is None:
        out = probs @ expand(v)
    else:
        out = probs.masked_fill(reads, 0.0) @ expand(v) + (probs * reads) @ expand(exact[1])
    return out.transpose(0, 1).to(q.dtype)


def _read_residuals(
    cache: LayerKVCache, tail: TailMetadata | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Return the tail store's rows this step reads, dequantized: K's and V's [kv_heads,
    rows read * stride, d] (TailMetadata's read indices point into these)."""
    if tail is None:
        return None
    assert cache.tail_store is not None
    values, scales = cache.tail_store
    heads, _, _, d = values.shape
    rows = tail.read_rows
    res = fp8.dequantize(values[:, rows], scales[:, rows][..., None], dtype).reshape(heads, -1, d)
    return res[: heads // 2], res[heads // 2 :]


def _prefill_exact(
    k: torch.Tensor,
    v: torch.Tensor,
    residuals: tuple[torch.Tensor, torch.Tensor],
    new: tuple[torch.Tensor, torch.Tensor],
    tail: TailMetadata,
    seq: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return a prefill chunk's tail-precision K and V ([kv_heads, seq_len, d]) and its reads.

    Query at position a reads position j at tail precision iff j >= first_exact(a) (ring
    positions [lo, s0) from the store, the chunk's own from `new`), or j is one of the sinks
    among the positions it reads quantized (from the store below lo).
    """
    seq_len, q_len = k.shape[1], new[0].shape[0]
    s0 = seq_len - q_len
    ring, sinks = tail.ring_read_slots[seq], tail.sink_read_slots[seq]
    lo = s0 - ring.numel()
    exact = []
    for x, res, x_new in zip((k, v), residuals, new):
        e = x.clone()
        e[:, lo:s0] += res[:, ring]
        e[:, s0:] = x_new.transpose(0, 1)
        e[:, : sinks.numel()] += res[:, sinks]
        exact.append(e)
    window, start = tail.window, tail.exact_starts[seq]
    num_quant = min(seq_len, first_exact(seq_len - 1, window, start))
    num_sinks = min(tail.num_sinks[seq], num_quant)
    pos = torch.arange(seq_len, device=k.device)[None, :]
    query = torch.arange(s0, seq_len, device=k.device)[:, None]
    reads = (pos >= first_exact_t(query, window, start)) | (pos < num_sinks)
    return exact[0], exact[1], reads


def _decode_exact(
    k: torch.Tensor,
    v: torch.Tensor,
    residuals: tuple[torch.Tensor, torch.Tensor],
    new: tuple[torch.Tensor, torch.Tensor],
    tail: TailMetadata,
    b: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_prefill_exact for the b-th decode sequence: its ring and sink positions come from the
    two store rows read for it (TailMetadata.decode_pos / decode_valid), its new token last."""
    seq_len, width = k.shape[1], tail.decode_pos.shape[1]
    valid = tail.decode_valid[b] > 0
    pos = tail.decode_pos[b][valid]
    exact = []
    for x, res, x_new in zip((k, v), residuals, new):
        e = x.clone()
        e[:, pos] += res[:, b * width : (b + 1) * width][:, valid]
        e[:, seq_len - 1] = x_new[0]
        exact.append(e)
    reads = torch.zeros(1, seq_len, dtype=torch.bool, device=k.device)
    reads[0, pos] = True
    reads[0, seq_len - 1] = True
    return exact[0], exact[1], reads
