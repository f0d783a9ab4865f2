"""Multi-LoRA's batched low-rank products on CUDA (the bgmv idea of Punica): every token of a
step multiplies by its own adapter's A and B, picked by its slot, in two Triton kernels.

lora_shrink_kernel: h[t] = x[t] @ a[s].T into a float32 scratch; lora_expand_kernel:
y[t] += h[t] @ b[s], accumulated in float32 and stored once in y's dtype. Each program owns
one token and one block of its output (rank, then out_features) and streams the reduction
axis through a float32 tile, summed once at the end. A token's result depends on its own row
and adapter only, never on the batch. The kernels also run on CPU tensors under
TRITON_INTERPRET=1 (tests/gpu/test_lora_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements of a program's [rows, reduction] tile: 32 fp32 values per thread at 4 warps.
_TILE = 4096
# Rows of A (shrink) or B (expand) a program reads at once: a fused qkv's rank 3 * 64 takes
# three shrink programs per token and three steps of the expand loop.
_MAX_BLOCK_R = 64


@triton.jit
def lora_shrink_kernel(
    x_ptr,
    a_ptr,
    h_ptr,
    slot_ids_ptr,
    stride_xt,
    stride_as,
    stride_ar,
    stride_ht,
    rank,
    in_features,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Write h[t, r] = x[t] . a[s, r] for BLOCK_R ranks r of token t (slot s < 0: nothing)."""
    t = tl.program_id(0)
    slot = tl.load(slot_ids_ptr + t)
    if slot < 0:
        return
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    x_row = x_ptr + t.to(tl.int64) * stride_xt
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + offs_r.to(tl.int64) * stride_ar
    acc = tl.zeros((BLOCK_R, BLOCK_K), tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < in_features
        x = tl.load(x_row + offs_k, mask=mask_k, other=0.0).to(tl.float32)  # [BLOCK_K]
        a = tl.load(
            a_rows[:, None] + offs_k[None, :], mask=mask_r[:, None] & mask_k[None, :], other=0.0
        ).to(tl.float32)  # [BLOCK_R, BLOCK_K]
        acc += a * x[None, :]
    tl.store(h_ptr + t.to(tl.int64) * stride_ht + offs_r, tl.sum(acc, axis=1), mask=mask_r)


@triton.jit
def lora_expand_kernel(
    h_ptr,
    b_ptr,
    y_ptr,
    slot_ids_ptr,
    stride_ht,
    stride_bs,
    stride_br,
    stride_yt,
    rank,
    out_features,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Add h[t] @ b[s] to BLOCK_N columns of y[t] (slot s < 0: leave y[t] as it is)."""
    t = tl.program_id(0)
    slot = tl.load(slot_ids_ptr + t)
    if slot < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < out_features
    h_row = h_ptr + t.to(tl.int64) * stride_ht
    b_slot = b_ptr + slot.to(tl.int64) * stride_bs
    acc = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        h = tl.load(h_row + offs_r, mask=mask_r, other=0.0)  # [BLOCK_R] fp32
        b = tl.load(
            b_slot + offs_r[:, None].to(tl.int64) * stride_br + offs_n[None, :],
            mask=mask_r[:, None] & mask_n[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_R, BLOCK_N]
        acc += b * h[:, None]
    y_row = y_ptr + t.to(tl.int64) * stride_yt + offs_n
    y = tl.load(y_row, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_row, (y + tl.sum(acc, axis=0)).to(y_ptr.dtype.element_ty), mask=mask_n)


def triton_lora_add(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slot_ids: torch.Tensor
) -> None:
    """y[t] += (x[t] @ a[s].T) @ b[s] for each token t whose slot s = slot_ids[t] >= 0 (in place).

    x: [num_tokens, in_features]; y: [num_tokens, out_features] (rows may be strided);
    a: [num_slots, rank, in_features]; b: [num_slots, rank, out_features] (B transposed, the
    LoRA scaling folded in); slot_ids: [num_tokens] int32, -1 for tokens without an adapter.
    x, y, a and b share one dtype (bf16, fp16 or fp32); the products accumulate in fp32.
    """
    num_tokens, in_features = x.shape
    num_slots, rank, out_features = b.shape
    assert a.shape == (num_slots, rank, in_features), (a.shape, b.shape, x.shape)
    assert y.shape == (num_tokens, out_features), (y.shape, x.shape, b.shape)
    assert slot_ids.shape == (num_tokens,) and slot_ids.dtype == torch.int32
    assert x.dtype == y.dtype == a.dtype == b.dtype, (x.dtype, y.dtype, a.dtype, b.dtype)
    assert x.stride(1) == y.stride(1) == a.stride(2) == b.stride(2) == 1, "rows must be dense"
    assert slot_ids.is_contiguous()
    if num_tokens == 0 or rank == 0:
        return
    h = torch.empty((num_tokens, rank), dtype=torch.float32, device=x.device)  # [T, rank]
    block_r = min(triton.next_power_of_2(rank), _MAX_BLOCK_R)
    block_k = min(triton.next_power_of_2(in_features), _TILE // block_r)
    lora_shrink_kernel[(num_tokens, triton.cdiv(rank, block_r))](
        x, a, h, slot_ids, x.stride(0), a.stride(0), a.stride(1), h.stride(0),
        rank, in_features, BLOCK_R=block_r, BLOCK_K=block_k,
    )  # fmt: skip
    block_n = min(triton.next_power_of_2(out_features), _TILE // block_r)
    lora_expand_kernel[(num_tokens, triton.cdiv(out_features, block_n))](
        h, b, y, slot_ids, h.stride(0), b.stride(0), b.stride(1), y.stride(0),
        rank, out_features, BLOCK_R=block_r, BLOCK_N=block_n,
    )  # fmt: skip
