"""FP8 in the Triton kernels: rounding to a format's grid, per-row quantization (dynamic or
static scales), the Hadamard rotation of rows, the quantize-on-write kernel and the rotation of
decode queries ahead of the split decode kernels.

Everything here rounds the way torch does, so the kernels' stored bytes are bit-identical to
the reference's (tests/gpu/test_triton_kernels.py), on a GPU and under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (mantissa bits, smallest normal, magic constant) per storage format, for round_to_grid. The
# magic is 1.5 * 2**(23 + e) where 2**e is the format's subnormal spacing, so (x + magic) -
# magic rounds x to that spacing in fp32 (round to nearest even).
_GRID = {
    torch.float8_e4m3fn: (3, 2.0**-6, 1.5 * 2.0 ** (23 - 9)),
    torch.float8_e5m2: (2, 2.0**-14, 1.5 * 2.0 ** (23 - 16)),
    torch.bfloat16: (7, 0.0, 0.0),  # shares fp32's exponent: no separate subnormal case
}
# How a kernel rounds an fp32 value to the model's dtype (X_MODE): fp32, bf16, fp16.
X_MODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def grid_constants(dtype: torch.dtype) -> tuple[int, float, float]:
    """Return round_to_grid's (mantissa bits, smallest normal, magic); 0 bits = plain cast."""
    return _GRID.get(dtype, (0, 0.0, 0.0))


@triton.jit
def round_to_grid(x, MANT_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, MAGIC: tl.constexpr):
    """Round fp32 x to the nearest (ties to even) value with MANT_BITS mantissa bits.

    The cast that follows is then exact. Hardware casts round the same way; the interpreter's
    fp32 -> fp8/bf16 casts do not (bf16 truncates; fp8 loses the carry when rounding crosses a
    power of two, e.g. -31.6 -> -16 in e4m3), so rounding here makes both bit-identical to torch.
    """
    SHIFT: tl.constexpr = 23 - MANT_BITS
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> SHIFT) & 1
    bits = (bits + ((1 << (SHIFT - 1)) - 1) + lsb) & (-(1 << SHIFT))
    y = bits.to(tl.float32, bitcast=True)
    if MIN_NORMAL > 0:
        tiny = (tl.abs(x) + MAGIC) - MAGIC
        # x's sign bit on the magnitude: tiny negatives keep -0.0, as torch's cast does (a
        # compare-and-negate lost it on an H200, where the compiler rewrites it)
        sign = x.to(tl.int32, bitcast=True) & -2147483648
        tiny = (tiny.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        y = tl.where(tl.abs(x) < MIN_NORMAL, tiny, y)
    return y


@triton.jit
def round_to_model(x, X_MODE: tl.constexpr):
    """Round fp32 x to the model dtype's values (X_MODE 0 fp32, 1 bf16, 2 fp16), kept fp32."""
    if X_MODE == 1:
        x = round_to_grid(x, 7, 0.0, 0.0)
    elif X_MODE == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def quantize_rows(
    x,
    static,
    mask,
    fp8_max,
    scale_factor,
    min_scale,
    SCALE_MODE: tl.constexpr,
    MANT_BITS: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    MAGIC: tl.constexpr,
):
    """Quantize rows x [R, D] (fp32) as the cache stores them.

    Returns the stored values on the format's grid (fp32, the cast is exact), the per-row
    scale (dynamic: amax * scale_factor rounded to bf16; ones otherwise) and how many values
    a static scale clipped. static: [R, D] fp32 scales (SCALE_MODE 2), else unused.
    """
    scale = tl.full((x.shape[0],), 1.0, tl.float32)
    num_clipped = 0
    if SCALE_MODE == 1:  # dynamic: one bf16 scale per row
        scale = round_to_grid(
            tl.maximum(tl.max(tl.abs(x), axis=1) * scale_factor, min_scale), 7, 0.0, 0.0
        )
        x = tl.math.div_rn(x, scale[:, None])
    elif SCALE_MODE == 2:
        x = tl.math.div_rn(x, static)
        clipped = tl.where(mask & (tl.abs(x) > fp8_max), 1, 0)
        num_clipped = tl.sum(tl.sum(clipped, axis=1), axis=0)
    if SCALE_MODE != 0:
        x = tl.clamp(x, -fp8_max, fp8_max)
    if MANT_BITS > 0:
        x = round_to_grid(x, MANT_BITS, MIN_NORMAL, MAGIC)
    return x, scale, num_clipped


@triton.jit
def rotate_rows(x, rot_ptr, head_dim, BLOCK_D: tl.constexpr):
    """Return x [R, BLOCK_D] (fp32) times the [head_dim, head_dim] Hadamard matrix, in fp32.

    R must be >= 16 (tl.dot); padded columns of x must be zero.
    """
    offs = tl.arange(0, BLOCK_D)
    mask = (offs[:, None] < head_dim) & (offs[None, :] < head_dim)
    rot = tl.load(rot_ptr + offs[:, None] * head_dim + offs[None, :], mask=mask, other=0.0)
    return tl.dot(x, rot, input_precision="ieee")


@triton.jit
def write_kv_kernel(
    k_ptr,
    v_ptr,
    slot_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    k_static_ptr,
    v_static_ptr,
    saturated_ptr,
    rot_ptr,
    stride_xt,
    stride_xh,
    stride_vt,
    stride_vh,
    stride_ch,
    stride_cb,
    stride_cs,
    stride_sh,
    stride_sb,
    stride_static_h,
    stride_static_d,
    num_kv_heads,
    head_dim,
    fp8_max,
    scale_factor,
    min_scale,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    MANT_BITS: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    MAGIC: tl.constexpr,
    ROTATE: tl.constexpr,
    X_MODE: tl.constexpr,
):
    """Store one token's K and V (all KV heads) in its slot, quantizing for FP8 caches.

    With ROTATE, K and V are first multiplied by the Hadamard matrix (rounded to the model
    dtype, as the reference's rotate does).
    """
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # negative slots are padding (CUDA-graph buckets): nothing to store
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
        # [BLOCK_H, BLOCK_D] fp32
        k = tl.load(
            k_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :],
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        v = tl.load(
            v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        if ROTATE:
            k = round_to_model(rotate_rows(k, rot_ptr, head_dim, BLOCK_D), X_MODE)
            v = round_to_model(rotate_rows(v, rot_ptr, head_dim, BLOCK_D), X_MODE)
        cache_off = (
            offs_h[:, None].to(tl.int64) * stride_ch
            + block * stride_cb
            + offset * stride_cs
            + offs_d[None, :]
        )
        # static scales: [kvh or 1, head_dim or 1], zero strides broadcast
        static_off = offs_h[:, None] * stride_static_h + offs_d[None, :] * stride_static_d
        k_static = k
        v_static = v
        if SCALE_MODE == 2:
            k_static = tl.load(k_static_ptr + static_off, mask=mask, other=1.0)
            v_static = tl.load(v_static_ptr + static_off, mask=mask, other=1.0)
        k, k_s, k_clipped = quantize_rows(
            k, k_static, mask, fp8_max, scale_factor, min_scale,
            SCALE_MODE, MANT_BITS, MIN_NORMAL, MAGIC,
        )  # fmt: skip
        v, v_s, v_clipped = quantize_rows(
            v, v_static, mask, fp8_max, scale_factor, min_scale,
            SCALE_MODE, MANT_BITS, MIN_NORMAL, MAGIC,
        )  # fmt: skip
        if SCALE_MODE == 1:  # dynamic: one bf16 scale per token and KV head
            scale_off = offs_h.to(tl.int64) * stride_sh + block * stride_sb + offset
            tl.store(k_scale_ptr + scale_off, k_s.to(tl.bfloat16), mask=offs_h < num_kv_heads)
            tl.store(v_scale_ptr + scale_off, v_s.to(tl.bfloat16), mask=offs_h < num_kv_heads)
        elif SCALE_MODE == 2:
            num_clipped = (k_clipped + v_clipped).to(tl.int64)
            if num_clipped > 0:
                tl.atomic_add(saturated_ptr, num_clipped)
        tl.store(k_cache_ptr + cache_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + cache_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotate_q_kernel(
    q_ptr,
    out_ptr,
    token_idx_ptr,
    rot_ptr,
    stride_qt,
    stride_qh,
    stride_ob,
    stride_oh,
    num_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    X_MODE: tl.constexpr,
):
    """Rotate BLOCK_H heads of decode sequence b's query row q[token_idx[b]] into out[b].

    In fp32, rounded once to q's dtype as exact_tail.rotate rounds: the split decode kernels
    then read the rotated queries from a compact [num_seqs, num_heads, head_dim] buffer.
    """
    b = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < head_dim)
    token = tl.load(token_idx_ptr + b).to(tl.int64)
    q = tl.load(
        q_ptr + token * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=mask,
        other=0.0,
    ).to(tl.float32)  # [BLOCK_H, BLOCK_D]
    q = round_to_model(rotate_rows(q, rot_ptr, head_dim, BLOCK_D), X_MODE)
    tl.store(
        out_ptr + b.to(tl.int64) * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :],
        q.to(out_ptr.dtype.element_ty),
        mask=mask,
    )
