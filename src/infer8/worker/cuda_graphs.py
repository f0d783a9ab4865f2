"""CUDA graphs for decode steps: one graph per batch-size bucket, padded up to the bucket.

A decode step launches a few kernels per layer with almost no work each, so on a GPU the
launch overhead rivals the math; replaying a captured graph removes it. Each bucket owns static
input buffers (token ids, positions, slots, context lengths, block tables; with an FP8 exact
tail its per-token ring and sink slots and per-sequence tail table) that a step copies into
before replay. Padding rows have slot -1 (nothing is written) and context length 0 (the
attention kernel returns zeros), so they cannot disturb real sequences. Capture goes through a
small GraphAPI: CUDA's on a GPU; without CUDA the same class runs the model eagerly on those
buffers, or through a stand-in API whose "graph" calls the forward again on replay, which lets
CPU tests check the padding, the capture order and replay into the static output.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch

from infer8.attention.kv_cache import LayerKVCache
from infer8.attention.metadata import AttentionMetadata
from infer8.attention.triton.backend import TritonAttention, TritonStepMetadata
from infer8.attention.triton.tail import TritonTailStep, build_tail_step
from infer8.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Return the batch sizes to capture, vLLM's: 1, 2, 4, then steps of 8 below 256 and of 16
    from there, up to max_num_seqs (always captured), so a batch pads at most 15 rows."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, max_num_seqs, 16)]
    return [*(b for b in sizes if b < max_num_seqs), max_num_seqs]


def bucket_for(num_seqs: int, buckets: list[int]) -> int | None:
    """Return the smallest bucket that holds num_seqs, None when it is larger than all."""
    return next((b for b in buckets if b >= num_seqs), None)


class DecodeGraph(Protocol):
    """A captured step: replay re-runs it on the same static buffers."""

    def replay(self) -> None:
        """Run the captured step again."""


class GraphAPI(Protocol):
    """What capture needs from the device: a shared pool, capture, synchronization."""

    def pool(self) -> Any:
        """Return a memory pool handle every bucket's graph shares."""

    def capture(
        self, forward: Callable[[], torch.Tensor], pool: Any
    ) -> tuple[DecodeGraph, torch.Tensor]:
        """Capture forward() into a graph; return it and forward's (static) output."""

    def synchronize(self) -> None:
        """Wait for the device."""


class CudaGraphAPI:
    """GraphAPI over torch.cuda.CUDAGraph."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(
        self, forward: Callable[[], torch.Tensor], pool: Any
    ) -> tuple[DecodeGraph, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward()
        return graph, out

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class _Bucket:
    """The static buffers, metadata and (on CUDA) the graph of one batch size."""

    def __init__(
        self, size: int, max_blocks: int, max_model_len: int, device: torch.device,
        tail_window: int = 0,
    ) -> None:  # fmt: skip
        self.size = size
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((size, max_blocks), dtype=torch.int64, device=device)
        token_ids = torch.arange(size, device=device)
        self.meta = AttentionMetadata(
            num_real_tokens=size,
            slot_mapping=self.slot_mapping,
            query_start_loc=list(range(size + 1)),
            seq_lens=[max_model_len] * size,  # an upper bound; the kernels read self.seq_lens
            block_tables=self.block_tables,
            decode_seq_ids=list(range(size)),
            decode_token_ids=token_ids,
            decode_block_tables=self.block_tables,
            decode_seq_lens=self.seq_lens,
            prefill_seq_ids=[],
        )
        empty = torch.zeros(0, dtype=torch.int32, device=device)
        self.step = TritonStepMetadata(
            num_real_tokens=size,
            slot_mapping=self.slot_mapping,
            num_decode=size,
            num_prefill=0,
            decode_token_ids=token_ids,
            decode_seq_lens=self.seq_lens,
            decode_block_tables=self.block_tables,
            prefill_q_start=empty,
            prefill_q_lens=empty,
            prefill_seq_lens=empty,
            prefill_block_tables=self.block_tables[:0],
            prefill_max_q_len=0,
        )
        if tail_window:  # an FP8 cache's exact tail: padding tokens enter no ring or sink
            self.step.tail = TritonTailStep(
                tail_window,
                tail_window - 1,
                torch.full((size,), -1, dtype=torch.int64, device=device),
                torch.full((size,), -1, dtype=torch.int64, device=device),
                torch.zeros((size, 4), dtype=torch.int32, device=device),
                torch.zeros((0, 4), dtype=torch.int32, device=device),
            )
        self.graph: DecodeGraph | None = None
        self.hidden: torch.Tensor | None = None  # [size, hidden_size], the graph's output


class CUDAGraphDecodeRunner:
    """Owns one captured decode graph per batch bucket and runs all-decode steps through them."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[LayerKVCache],
        backend: TritonAttention,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        buckets: list[int] | None = None,
        tail_window: int = 0,
        graph_api: GraphAPI | None = None,
    ) -> None:
        # graph_api None: CUDA graphs on CUDA, eager replay of the static buffers elsewhere
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.device = backend.device
        self.buckets = sorted(buckets) if buckets else batch_buckets(max_num_seqs)
        max_blocks = -(-max_model_len // block_size)
        self._buckets = {
            size: _Bucket(size, max_blocks, max_model_len, self.device, tail_window)
            for size in self.buckets
        }
        if graph_api is None and self.device.type == "cuda":
            graph_api = CudaGraphAPI(self.device)
        self.graph_api = graph_api

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first, sharing one memory pool."""
        api = self.graph_api
        pool = api.pool() if api is not None else None
        for size in sorted(self.buckets, reverse=True):
            bucket = self._buckets[size]
            if api is None:
                continue
            self._forward(bucket)  # compiles the kernels outside the capture
            api.synchronize()
            bucket.graph, bucket.hidden = api.capture(lambda b=bucket: self._forward(b), pool)
        if api is not None:
            api.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def _forward(self, bucket: _Bucket) -> torch.Tensor:
        return self.model(
            bucket.input_ids, bucket.positions, bucket.meta, self.kv_caches, bucket.step
        )

    def can_run(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """Return whether a step of num_tokens is all decodes, unpadded, within the buckets."""
        return (
            not meta.prefill_seq_ids
            and meta.num_real_tokens == meta.num_seqs == num_tokens
            and bucket_for(meta.num_seqs, self.buckets) is not None
        )

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Run an all-decode step padded to its bucket; return hidden states [num_seqs, hidden].

        The result is a view of the bucket's static output: use it before the next run.
        """
        n = meta.num_seqs
        size = bucket_for(n, self.buckets)
        assert size is not None and self.can_run(meta, input_ids.shape[0])
        bucket = self._buckets[size]
        bucket.input_ids[:n].copy_(input_ids)
        bucket.input_ids[n:].zero_()
        bucket.positions[:n].copy_(positions)
        bucket.positions[n:].zero_()
        bucket.slot_mapping[:n].copy_(meta.slot_mapping)
        bucket.slot_mapping[n:].fill_(-1)
        bucket.seq_lens[:n].copy_(torch.tensor(meta.seq_lens, dtype=torch.int32))
        bucket.seq_lens[n:].zero_()
        width = meta.decode_block_tables.shape[1]
        assert width <= bucket.block_tables.shape[1], "a sequence is longer than max_model_len"
        bucket.block_tables[:n, :width].copy_(meta.decode_block_tables)
        tail = bucket.step.tail
        if tail is not None:
            assert meta.tail is not None, "a cache with an exact tail needs the step's tail"
            step = build_tail_step(
                meta.tail, n, meta.decode_seq_ids, [], meta.query_start_loc, meta.seq_lens,
                self.device,
            )  # fmt: skip
            for buf, new in ((tail.ring_slots, step.ring_slots),
                             (tail.sink_slots, step.sink_slots), (tail.decode, step.decode)):  # fmt: skip
                buf[:n].copy_(new)
                buf[n:].fill_(-1 if buf.dim() == 1 else 0)
        if bucket.graph is None:  # CPU (or not captured): the same buffers, run eagerly
            bucket.hidden = self._forward(bucket)
        else:
            bucket.graph.replay()
        assert bucket.hidden is not None
        return bucket.hidden[:n]
