"""TritonAttention: the CUDA backend over the Triton kernels (launch.py), for every cache format
on sm_89+ (E4M3 for the tail's residuals) and 16-bit / E5M2 caches without a tail on sm_80+.

The cache layout is the reference's: K/V [num_kv_heads, num_blocks, block_size, head_dim],
dynamic FP8 scales [num_kv_heads, num_blocks, block_size] in bf16, or static scales
[kvh or 1, head_dim or 1] in fp32. Dequantization never materializes a 16-bit copy: FP8 tiles
are widened in registers (exactly: every e4m3/e5m2 value is a bf16/fp16 value) and the scales
are folded into the math instead of the tiles (a per-token K scale multiplies that token's
score column, a per-token V scale its softmax weight, a static per-channel K scale the query).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer8.attention.kv_cache import LayerKVCache
from infer8.attention.metadata import AttentionMetadata
from infer8.attention.triton.launch import (
    KernelConfig,
    TailArgs,
    choose_num_splits,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv,
)
from infer8.attention.triton.tail import TritonTailStep, build_tail_step
from infer8.attention.triton.tail_write import tail_residuals, write_ring


@dataclass
class TritonStepMetadata:
    """The device tensors the kernels read, derived once per step from AttentionMetadata (or
    a CUDA graph bucket's static buffers, filled before each replay)."""

    num_real_tokens: int
    slot_mapping: torch.Tensor  # [num_real_tokens] int64 (-1: a padding token, not written)
    num_decode: int
    num_prefill: int
    decode_token_ids: torch.Tensor  # [num_decode] int64
    decode_seq_lens: torch.Tensor  # [num_decode] int32
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks]
    prefill_q_start: torch.Tensor  # [num_prefill] int32
    prefill_q_lens: torch.Tensor  # [num_prefill] int32
    prefill_seq_lens: torch.Tensor  # [num_prefill] int32
    prefill_block_tables: torch.Tensor  # [num_prefill, max_blocks]
    prefill_max_q_len: int
    tail: TritonTailStep | None = None  # an FP8 cache's exact tail (meta.tail)


class TritonAttention:
    """The CUDA attention backend. Holds the kernel configuration and the decode split count
    (fixed per model and device, so graphs and eager steps agree); no per-step state."""

    def __init__(
        self,
        device: torch.device,
        config: KernelConfig | None = None,
        num_splits: int | None = None,
    ) -> None:
        self.device = device
        self.config = config or KernelConfig()
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 4
        )
        self._num_splits = num_splits

    def num_splits(self, num_kv_heads: int) -> int:
        """Return the decode split count (chosen on first use from the SMs and KV heads)."""
        if self._num_splits is None:
            self._num_splits = choose_num_splits(num_kv_heads, self.num_sms)
        return self._num_splits

    def build_metadata(self, meta: AttentionMetadata) -> TritonStepMetadata:
        """Return the kernels' view of this step's metadata (once per step, every layer's)."""
        dev = self.device
        pre = meta.prefill_seq_ids
        starts = [meta.query_start_loc[i] for i in pre]
        q_lens = [meta.query_start_loc[i + 1] - meta.query_start_loc[i] for i in pre]

        def int32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=dev)

        step = TritonStepMetadata(
            num_real_tokens=meta.num_real_tokens,
            slot_mapping=meta.slot_mapping,
            num_decode=len(meta.decode_seq_ids),
            num_prefill=len(pre),
            decode_token_ids=meta.decode_token_ids,
            decode_seq_lens=int32([meta.seq_lens[i] for i in meta.decode_seq_ids]),
            decode_block_tables=meta.decode_block_tables,
            prefill_q_start=int32(starts),
            prefill_q_lens=int32(q_lens),
            prefill_seq_lens=int32([meta.seq_lens[i] for i in pre]),
            prefill_block_tables=meta.block_tables[pre] if pre else meta.block_tables[:0],
            prefill_max_q_len=max(q_lens, default=0),
        )
        if meta.tail is not None:
            step.tail = build_tail_step(
                meta.tail, meta.num_real_tokens, meta.decode_seq_ids, pre,
                meta.query_start_loc, meta.seq_lens, dev,
            )  # fmt: skip
        return step

    def write_and_attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        step: TritonStepMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Store the real tokens' K/V, then attend each sequence's new tokens over its cached
        context (causal within the chunk).

        q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]; padding
        tokens (index >= num_real_tokens) get zeros. With an exact tail the step's residuals are
        computed and the sinks stored before attention, the rings written after (tail.py).
        A Hadamard cache is rotated inside the kernels.
        """
        n = step.num_real_tokens
        k_new, v_new = k[:n], v[:n]
        write_kv(cache, k_new, v_new, step.slot_mapping)
        tail = None
        if step.tail is not None and cache.tail_store is not None:
            tail = TailArgs(step.tail, tail_residuals(cache, k_new, v_new, step.tail))
        out = self.attend(q, cache, step, scale, tail=tail)
        if tail is not None:
            write_ring(cache, tail.new, tail.step)
        return out

    def attend(
        self,
        q: torch.Tensor,
        cache: LayerKVCache,
        step: TritonStepMetadata,
        scale: float,
        out: torch.Tensor | None = None,
        tail: TailArgs | None = None,
    ) -> torch.Tensor:
        """Attend over what the cache holds (this step's K/V written; with a tail, its
        residuals computed): the decode rows, then the prefill chunks, into `out` if given."""
        if out is None:
            out = torch.empty_like(q)
        if q.shape[0] > step.num_real_tokens:
            out[step.num_real_tokens :].zero_()
        if step.num_decode:
            paged_decode_attention(
                q, cache, out, step.decode_token_ids, step.decode_seq_lens,
                step.decode_block_tables, scale, self.num_splits(cache.k.shape[0]), self.config,
                tail,
            )  # fmt: skip
        if step.num_prefill:
            paged_prefill_attention(
                q, cache, out, step.prefill_q_start, step.prefill_q_lens, step.prefill_seq_lens,
                step.prefill_block_tables, step.prefill_max_q_len, scale, self.config, tail,
            )  # fmt: skip
        return out
