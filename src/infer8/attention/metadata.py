"""Attention metadata for one flat, unpadded batch, built once per step by the model runner."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from infer8.attention.exact_tail import TailMetadata


@dataclass
class AttentionMetadata:
    """Where each token's K/V goes and what each sequence attends over.

    Tokens of all scheduled requests are packed into one 1-D batch: sequence i owns tokens
    [query_start_loc[i], query_start_loc[i+1]) and, after this step, has seq_lens[i] tokens of
    context in the blocks named by block_tables[i]. Static-batch padding tokens, if any, come
    after all real tokens (index >= num_real_tokens) and attend to nothing.

    A backend must write all of a layer's new K/V (slot_mapping) before any sequence attends:
    with prefix caching a request may read blocks that another request fills in the same step,
    and a new request's first chunk may start after a cached prefix (num_computed_tokens > 0).
    """

    num_real_tokens: int
    slot_mapping: (
        torch.Tensor
    )  # [num_real_tokens] int64, flat slot = block_id * block_size + offset
    query_start_loc: list[int]  # [num_seqs + 1]
    seq_lens: list[int]  # [num_seqs]
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int64, zero padded
    # Decode fast path: sequences with exactly one new token, attended in one batched call.
    decode_seq_ids: list[int]
    decode_token_ids: torch.Tensor  # [num_decode] int64, token index of each decode sequence
    decode_block_tables: torch.Tensor  # [num_decode, max_decode_blocks] int64
    # [num_decode] context lengths of the decode sequences (int64 on the CPU, where the native
    # decode kernel reads them; a CUDA graph bucket's own int32 buffer)
    decode_seq_lens: torch.Tensor
    # Everything else (prefill chunks) is attended one sequence at a time.
    prefill_seq_ids: list[int]
    # FP8 cache with an exact tail: set by the model runner after building (exact_tail.py).
    tail: TailMetadata | None = None

    @property
    def num_seqs(self) -> int:
        """Return the number of sequences in the batch."""
        return len(self.seq_lens)


def build_attention_metadata(
    query_lens: list[int],
    num_computed_tokens: list[int],
    block_ids: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Build metadata from per-sequence query lengths, progress and block tables."""
    num_seqs = len(block_ids)
    num_blocks = np.fromiter(map(len, block_ids), dtype=np.int64, count=num_seqs)
    table = np.zeros((num_seqs, max(1, int(num_blocks.max()) if num_seqs else 0)), np.int64)
    is_used = np.arange(table.shape[1]) < num_blocks[:, None]
    table[is_used] = np.fromiter(chain.from_iterable(block_ids), np.int64, int(num_blocks.sum()))
    return metadata_from_table(
        np.asarray(query_lens, dtype=np.int64),
        np.asarray(num_computed_tokens, dtype=np.int64),
        table, np.arange(num_seqs), num_blocks, block_size, device,
    )  # fmt: skip


def metadata_from_table(
    query_lens: np.ndarray,
    num_computed_tokens: np.ndarray,
    table: np.ndarray,
    rows: np.ndarray,
    num_blocks: np.ndarray,
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Build a step's metadata with numpy from a block table that may outlive the step.

    table: [num_rows, width] int64 block ids, zero past each row's blocks; sequence i's blocks
    are row rows[i], num_blocks[i] of them. Slots, positions and tables are computed per
    array, never per token in Python (a decode step of 256 sequences of 4K tokens took 88 ms on a 2-core CPU that way).
    """
    num_seqs = len(query_lens)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    seq_lens = num_computed_tokens + query_lens
    positions = token_positions(query_lens, num_computed_tokens, query_start_loc)
    seq_of_token = np.repeat(rows, query_lens)
    slots = table[seq_of_token, positions // block_size] * block_size + positions % block_size
    max_blocks = max(1, int(num_blocks.max()) if num_seqs else 0)
    is_decode = query_lens == 1
    decode_ids = np.flatnonzero(is_decode)
    max_decode_blocks = (
        max(1, -(-int(seq_lens[decode_ids].max()) // block_size)) if len(decode_ids) else 1
    )
    return AttentionMetadata(
        num_real_tokens=int(query_start_loc[-1]),
        slot_mapping=to_device(slots, device),
        query_start_loc=query_start_loc.tolist(),
        seq_lens=seq_lens.tolist(),
        block_tables=to_device(table[rows, :max_blocks], device),
        decode_seq_ids=decode_ids.tolist(),
        decode_token_ids=to_device(query_start_loc[decode_ids], device),
        decode_block_tables=to_device(table[rows[decode_ids], :max_decode_blocks], device),
        decode_seq_lens=torch.from_numpy(seq_lens[decode_ids]),
        prefill_seq_ids=np.flatnonzero(~is_decode).tolist(),
    )


def token_positions(
    query_lens: np.ndarray, num_computed_tokens: np.ndarray, query_start_loc: np.ndarray
) -> np.ndarray:
    """Return each packed token's position in its sequence ([sum(query_lens)] int64)."""
    offsets = np.repeat(num_computed_tokens - query_start_loc[:-1], query_lens)
    return np.arange(int(query_start_loc[-1]), dtype=np.int64) + offsets


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Return a step input on the device: through pinned memory without waiting on CUDA.

    The caching host allocator keeps a pinned block until its copy has run, so a step's
    buffers are never overwritten in flight. On CPU the array's memory is used as it is.
    """
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
