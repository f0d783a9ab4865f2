"""Writing the FP8 cache's exact tail on the CUDA backend (steps 1 and 3 of tail.py's outline):
`tail_residuals` recomputes each new token's FP8 block value and stores its E4M3 residual in the
step buffer (and sink slots), `write_ring` copies the tokens that enter a ring after attention."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer8.attention.exact_tail import RESIDUAL_DTYPE
from infer8.attention.kv_cache import LayerKVCache
from infer8.attention.triton.tail import TritonTailStep
from infer8.attention.triton.write import (
    X_MODES,
    grid_constants,
    quantize_rows,
    rotate_rows,
    round_to_model,
)
from infer8.quant import fp8


@triton.jit
def _residual_rows(
    x,
    static_ptr,
    static_off,
    mask,
    fp8_max,
    scale_factor,
    res_factor,
    min_scale,
    SCALE_MODE: tl.constexpr,
    MANT_BITS: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    MAGIC: tl.constexpr,
    X_MODE: tl.constexpr,
):
    """Return rows x's residual over their FP8 block value: E4M3 grid values and scales."""
    static = x
    if SCALE_MODE == 2:
        static = tl.load(static_ptr + static_off, mask=mask, other=1.0)
    xq, scale, _ = quantize_rows(
        x, static, mask, fp8_max, scale_factor, min_scale, SCALE_MODE, MANT_BITS, MIN_NORMAL, MAGIC
    )
    if SCALE_MODE == 2:
        block = round_to_model(xq * round_to_model(static, X_MODE), X_MODE)
    else:
        block = round_to_model(xq * round_to_model(scale, X_MODE)[:, None], X_MODE)
    r = tl.where(mask, x - block, 0.0)
    res, res_scale, _ = quantize_rows(
        r, r, mask, 448.0, res_factor, min_scale, 1, 3, 2.0**-6, 1.5 * 2.0 ** (23 - 9)
    )
    return res, res_scale


@triton.jit
def _token_residual(
    x_ptr,
    stride_h,
    static_ptr,
    static_off,
    rot_ptr,
    head0,
    t,
    sink_slot,
    new_ptr,
    new_scale_ptr,
    store_ptr,
    store_scale_ptr,
    store_stride_h,
    store_scale_stride_h,
    num_kv_heads,
    head_dim,
    fp8_max,
    scale_factor,
    res_factor,
    min_scale,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    MANT_BITS: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    MAGIC: tl.constexpr,
    ROTATE: tl.constexpr,
    X_MODE: tl.constexpr,
):
    """Store one token's K (head0 0) or V (head0 kvh) residuals in the step buffer and sink."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < num_kv_heads
    mask = mask_h[:, None] & (offs_d[None, :] < head_dim)
    x = tl.load(x_ptr + offs_h[:, None] * stride_h + offs_d[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if ROTATE:
        x = round_to_model(rotate_rows(x, rot_ptr, head_dim, BLOCK_D), X_MODE)
    res, res_scale = _residual_rows(
        x, static_ptr, static_off, mask, fp8_max, scale_factor, res_factor, min_scale,
        SCALE_MODE, MANT_BITS, MIN_NORMAL, MAGIC, X_MODE,
    )  # fmt: skip
    heads = head0 + offs_h  # the residual heads: K's, then V's
    res = res.to(new_ptr.dtype.element_ty)
    res_scale = res_scale.to(new_scale_ptr.dtype.element_ty)
    row = t * 2 * num_kv_heads + heads
    tl.store(new_ptr + row[:, None] * head_dim + offs_d[None, :], res, mask=mask)
    tl.store(new_scale_ptr + row, res_scale, mask=mask_h)
    if sink_slot >= 0:
        store_off = heads[:, None] * store_stride_h + sink_slot * head_dim + offs_d[None, :]
        tl.store(store_ptr + store_off, res, mask=mask)
        tl.store(store_scale_ptr + heads * store_scale_stride_h + sink_slot, res_scale, mask=mask_h)


@triton.jit
def _tail_residual_kernel(
    k_ptr,
    v_ptr,
    k_static_ptr,
    v_static_ptr,
    rot_ptr,
    sink_slot_ptr,
    new_ptr,
    new_scale_ptr,
    store_ptr,
    store_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_static_h,
    stride_static_d,
    store_stride_h,
    store_scale_stride_h,
    num_kv_heads,
    head_dim,
    fp8_max,
    scale_factor,
    res_factor,
    min_scale,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    MANT_BITS: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    MAGIC: tl.constexpr,
    ROTATE: tl.constexpr,
    X_MODE: tl.constexpr,
):
    """One token: its K and V residuals into the step buffer, and into its sink slot if any."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    static_off = offs_h[:, None] * stride_static_h + offs_d[None, :] * stride_static_d
    sink_slot = tl.load(sink_slot_ptr + t)
    _token_residual(
        k_ptr + t * stride_kt, stride_kh, k_static_ptr, static_off, rot_ptr, 0, t, sink_slot,
        new_ptr, new_scale_ptr, store_ptr, store_scale_ptr, store_stride_h,
        store_scale_stride_h, num_kv_heads, head_dim, fp8_max, scale_factor, res_factor,
        min_scale, BLOCK_H, BLOCK_D, SCALE_MODE, MANT_BITS, MIN_NORMAL, MAGIC, ROTATE, X_MODE,
    )  # fmt: skip
    _token_residual(
        v_ptr + t * stride_vt, stride_vh, v_static_ptr, static_off, rot_ptr, num_kv_heads, t,
        sink_slot, new_ptr, new_scale_ptr, store_ptr, store_scale_ptr, store_stride_h,
        store_scale_stride_h, num_kv_heads, head_dim, fp8_max, scale_factor, res_factor,
        min_scale, BLOCK_H, BLOCK_D, SCALE_MODE, MANT_BITS, MIN_NORMAL, MAGIC, ROTATE, X_MODE,
    )  # fmt: skip


@triton.jit
def _ring_write_kernel(
    ring_slot_ptr,
    new_ptr,
    new_scale_ptr,
    store_ptr,
    store_scale_ptr,
    store_stride_h,
    store_scale_stride_h,
    num_res_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One token: copy its residuals (all heads) from the step buffer into its ring slot."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(ring_slot_ptr + t)
    if slot >= 0:
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask_h = offs_h < num_res_heads
        mask = mask_h[:, None] & (offs_d[None, :] < head_dim)
        row = t * num_res_heads + offs_h
        res = tl.load(new_ptr + row[:, None] * head_dim + offs_d[None, :], mask=mask)
        tl.store(
            store_ptr + offs_h[:, None] * store_stride_h + slot * head_dim + offs_d[None, :],
            res,
            mask=mask,
        )
        scale = tl.load(new_scale_ptr + row, mask=mask_h)
        tl.store(store_scale_ptr + offs_h * store_scale_stride_h + slot, scale, mask=mask_h)


def tail_residuals(
    cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor, step: TritonTailStep
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return this step's residuals ([tokens, 2 * kvh, d] E4M3, [tokens, 2 * kvh] scales) and
    store the sinks' in their slots. k, v: [tokens, kvh, d], unrotated (rotated here if the
    cache rotates keys)."""
    assert cache.tail_store is not None and cache.format.is_fp8
    store, store_scale = cache.tail_store
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and store.is_contiguous()
    new = torch.empty((num_tokens, 2 * num_kv_heads, head_dim), dtype=RESIDUAL_DTYPE,
                      device=k.device)  # fmt: skip
    new_scale = torch.empty((num_tokens, 2 * num_kv_heads), dtype=store_scale.dtype,
                            device=k.device)  # fmt: skip
    if num_tokens == 0:
        return new, new_scale
    static = cache.format.scale == "static"
    k_static = cache.k_static_scale.float().contiguous() if static else k  # type: ignore[union-attr]
    v_static = cache.v_static_scale.float().contiguous() if static else v  # type: ignore[union-attr]
    static_strides = (0, 0)
    if static:
        static_strides = tuple(
            0 if n == 1 else st for n, st in zip(k_static.shape, k_static.stride())
        )  # type: ignore[assignment]  # noqa: E501
    fmax = fp8.fp8_max(cache.k.dtype)
    mant_bits, min_normal, magic = grid_constants(cache.k.dtype)
    rotation = cache.rotation
    _tail_residual_kernel[(num_tokens,)](
        k, v, k_static, v_static, rotation if rotation is not None else k, step.sink_slots,
        new, new_scale, store, store_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *static_strides,
        store.stride(0), store_scale.stride(0), num_kv_heads, head_dim,
        fmax, fp8.SCALE_ROUND_UP / fmax, fp8.SCALE_ROUND_UP / fp8.fp8_max(RESIDUAL_DTYPE),
        fp8._MIN_SCALE,
        BLOCK_H=max(16, triton.next_power_of_2(num_kv_heads)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        SCALE_MODE=2 if static else 1,
        MANT_BITS=mant_bits,
        MIN_NORMAL=min_normal,
        MAGIC=magic,
        ROTATE=rotation is not None,
        X_MODE=X_MODES[k.dtype],
    )  # fmt: skip
    return new, new_scale


def write_ring(
    cache: LayerKVCache, new: tuple[torch.Tensor, torch.Tensor], step: TritonTailStep
) -> None:
    """Copy the residuals of the tokens that enter a ring into their slots (after attention)."""
    assert cache.tail_store is not None
    store, store_scale = cache.tail_store
    num_tokens, num_res_heads, head_dim = new[0].shape
    if num_tokens == 0:
        return
    _ring_write_kernel[(num_tokens,)](
        step.ring_slots, new[0], new[1], store, store_scale,
        store.stride(0), store_scale.stride(0), num_res_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_res_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip


__all__ = ["tail_residuals", "write_ring"]
