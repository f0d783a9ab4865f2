"""FLOPs and bytes of one layer's split-K decode attention (triton/launch.py: paged_decode_attention).

A roofline model from the shapes alone: what the kernels issue (tl.dot multiplies BLOCK_G =
max(16, group) query rows per program, padding included) and what they move (the KV read from
memory, the rest mostly from L2). With rotated keys (the FP8 default) it counts the Hadamard
rotation of q and of the output where it runs: in every (sequence, KV head, split) program, as
the kernels once did (`rotate_in_splits`), or once per sequence in rotate_q_kernel before the
decode kernel and in reduce_kernel after the combine, 16 query heads per program (tl.dot's
smallest row count). With the exact tail, decode_tail_kernel writes one more split's partials.
"""

from __future__ import annotations

from dataclasses import dataclass

F32_BYTES = 4
ROTATION_BLOCK_H = 16  # query heads per program of rotate_q_kernel and reduce_kernel's ROTATE


@dataclass(frozen=True)
class DecodeCost:
    """One layer's decode attention work: FLOPs by kind, bytes by kind."""

    attention_flops: int  # q.k and p.v, as issued (padded query rows included)
    rotation_flops: int  # q in, output back (0 without rotated keys)
    kv_bytes: int  # K and V (and their per-token scales) read from the cache
    other_bytes: int  # q, out, split partials, rotation passes and matrix reads

    @property
    def flops(self) -> int:
        """Return all FLOPs."""
        return self.attention_flops + self.rotation_flops

    @property
    def num_bytes(self) -> int:
        """Return all bytes moved."""
        return self.kv_bytes + self.other_bytes


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def decode_cost(
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    context_tokens: int,
    num_splits: int,
    kv_bytes_per_element: int,
    scale_bytes_per_token: int = 0,
    model_bytes_per_element: int = 2,
    rotated: bool = False,
    rotate_in_splits: bool = False,
    tail: bool = False,
) -> DecodeCost:
    """Return one layer's decode FLOPs and bytes for num_seqs sequences of context_tokens.

    Every context uses all num_splits splits (long contexts do). rotate_in_splits: the
    rotation runs in each of the num_seqs x num_kv_heads x num_splits programs on BLOCK_G rows
    (the kernels' old placement); otherwise where the kernels run it now, in the q-rotation
    and reduce programs (each reads the matrix). The output is written directly only with one
    split, no tail and no rotation; otherwise every split (and the tail's) writes partials.
    """
    group = num_heads // num_kv_heads
    block_g = max(16, _next_power_of_2(group))
    issued_rows = num_seqs * num_kv_heads * block_g  # query rows the dots multiply
    attention_flops = 2 * 2 * issued_rows * context_tokens * head_dim
    per_token_kv = num_kv_heads * (head_dim * kv_bytes_per_element + scale_bytes_per_token)
    kv_bytes = 2 * num_seqs * context_tokens * per_token_kv
    qo_bytes = 2 * num_seqs * num_heads * head_dim * model_bytes_per_element
    partial_bytes = 0
    num_slots = num_splits + tail
    if num_slots > 1 or (rotated and not rotate_in_splits):
        # float32 partial outputs and log-sum-exps, written then reduced
        partial_bytes = 2 * num_seqs * num_heads * num_slots * (head_dim + 1) * F32_BYTES
    rotation_flops = rotation_bytes = 0
    matrix_bytes = head_dim * head_dim * F32_BYTES
    if rotated and rotate_in_splits:
        programs = num_seqs * num_kv_heads * num_splits
        rotation_flops = 2 * programs * 2 * block_g * head_dim * head_dim
        rotation_bytes = 2 * programs * matrix_bytes
    elif rotated:  # q read, rotated, written compact; the reduce rotates before its store
        programs = num_seqs * -(-num_heads // ROTATION_BLOCK_H)  # per kernel
        rotation_flops = 2 * programs * 2 * ROTATION_BLOCK_H * head_dim * head_dim
        rotation_bytes = 2 * num_seqs * num_heads * head_dim * model_bytes_per_element
        rotation_bytes += 2 * programs * matrix_bytes
    return DecodeCost(
        attention_flops, rotation_flops, kv_bytes, qo_bytes + partial_bytes + rotation_bytes
    )
