"""Attention metadata for one flat, unpadded batch, built once per step by the model runner."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

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
    num_seqs = len(query_lens)
    query_start_loc = [0]
    seq_lens = []
    slots: list[int] = []
    for q_len, computed, blocks in zip(query_lens, num_computed_tokens, block_ids):
        query_start_loc.append(query_start_loc[-1] + q_len)
        seq_lens.append(computed + q_len)
        for pos in range(computed, computed + q_len):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    num_blocks = torch.tensor([len(b) for b in block_ids], dtype=torch.int64)  # [num_seqs]
    max_blocks = max(1, int(num_blocks.max()) if num_seqs else 0)
    # one tensor of every sequence's blocks, then one masked write (not a tensor per sequence)
    table = torch.zeros((num_seqs, max_blocks), dtype=torch.int64)
    is_used = torch.arange(max_blocks) < num_blocks[:, None]  # [num_seqs, max_blocks]
    table[is_used] = torch.tensor(list(chain.from_iterable(block_ids)), dtype=torch.int64)

    decode_seq_ids = [i for i in range(num_seqs) if query_lens[i] == 1]
    prefill_seq_ids = [i for i in range(num_seqs) if query_lens[i] != 1]
    max_decode_blocks = max((-(-seq_lens[i] // block_size) for i in decode_seq_ids), default=1)
    decode_block_tables = table[decode_seq_ids, :max_decode_blocks]
    decode_lens = torch.tensor([seq_lens[i] for i in decode_seq_ids], dtype=torch.int64)
    return AttentionMetadata(
        num_real_tokens=query_start_loc[-1],
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=table.to(device),
        decode_seq_ids=decode_seq_ids,
        decode_token_ids=torch.tensor(
            [query_start_loc[i] for i in decode_seq_ids], dtype=torch.int64, device=device
        ),
        decode_block_tables=decode_block_tables.to(device),
        decode_seq_lens=decode_lens,
        prefill_seq_ids=prefill_seq_ids,
    )
