"""The launchers of the Triton attention kernels: the fused quantize-on-write (write.py), split-K
decode and varlen prefill (decode.py, prefill.py) that read 1-byte FP8 blocks and dequantize them in
registers; the backend over them is backend.py.

The cache layout is the reference's: K/V [num_kv_heads, num_blocks, block_size, head_dim],
dynamic FP8 scales [num_kv_heads, num_blocks, block_size] in bf16, or static scales
[kvh or 1, head_dim or 1] in fp32. Dequantization never materializes a 16-bit copy: FP8 tiles
are widened in registers (exactly: every e4m3/e5m2 value is a bf16/fp16 value) and the scales
are folded into the math instead of the tiles (a per-token K scale multiplies that token's
score column, a per-token V scale its softmax weight, a static per-channel K scale the query).

The kernels also run on CPU tensors under TRITON_INTERPRET=1 (how CI checks them against
attention/reference.py); the engine itself uses this backend only on CUDA.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from infer8.attention.exact_tail import rotate
from infer8.attention.kv_cache import LayerKVCache
from infer8.attention.triton.decode import decode_kernel, decode_tail_kernel, reduce_kernel
from infer8.attention.triton.prefill import prefill_kernel
from infer8.attention.triton.tail import (
    TritonTailStep,
)
from infer8.attention.triton.write import X_MODES, grid_constants, rotate_q_kernel, write_kv_kernel
from infer8.quant import fp8

_LOG2E = 1.4426950408889634
# Scale modes of a cache, as the kernels see them.
_NO_SCALE, _DYNAMIC, _STATIC = 0, 1, 2


def is_interpreted() -> bool:
    """Return whether these kernels were defined under TRITON_INTERPRET=1 (CPU tensors)."""
    return not isinstance(write_kv_kernel, triton.runtime.JITFunction)


# -- launchers ------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch shape of the attention kernels (tuned per device, not per call)."""

    decode_block_n: int = 64
    decode_num_warps: int = 4
    decode_num_stages: int = 5
    prefill_block_m: int = 64
    prefill_block_n: int = 64
    prefill_num_warps: int = 4
    prefill_num_stages: int = 2
    # A decode split streams at least this many context tokens (fewer splits for short ones).
    decode_min_split_tokens: int = 256
    # decode_tail_kernel's tile: the exact tail's sinks and window, in tiles this long.
    decode_tail_block_n: int = 16
    # An fp32 model over an FP8 cache multiplies two fp16 terms of q and of p: twice the
    # operand registers, spread over twice the warps.
    decode_split_num_warps: int = 8
    decode_tail_num_warps: int = 4


@dataclass(frozen=True)
class _CacheArgs:
    """One layer's cache as kernel arguments: tensors, strides and the scale mode."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_static: torch.Tensor
    v_static: torch.Tensor
    strides: tuple[int, ...]  # cache h, b, s; dynamic scale h, b; static h, d
    scale_mode: int


def _cache_args(cache: LayerKVCache) -> _CacheArgs:
    """Check the layout the kernels assume and flatten a LayerKVCache into kernel arguments."""
    k, v = cache.k, cache.v
    assert k.stride() == v.stride() and k.stride(-1) == 1, "K and V must share a dense layout"
    # Unused pointer arguments still need a tensor; the kernels never read them.
    k_scale = v_scale = k_static = v_static = k
    scale_strides = (0, 0)
    static_strides = (0, 0)
    if cache.format.scale == "none":
        mode = _NO_SCALE
    elif cache.format.scale == "dynamic":
        mode = _DYNAMIC
        assert cache.k_scale is not None and cache.v_scale is not None
        assert cache.k_scale.stride(-1) == 1
        assert cache.k_scale.stride() == cache.v_scale.stride()
        k_scale, v_scale = cache.k_scale, cache.v_scale
        scale_strides = (cache.k_scale.stride(0), cache.k_scale.stride(1))
    else:
        mode = _STATIC
        assert cache.k_static_scale is not None and cache.v_static_scale is not None
        k_static = cache.k_static_scale.float().contiguous()
        v_static = cache.v_static_scale.float().contiguous()
        assert k_static.dim() == 2 and k_static.shape == v_static.shape
        # [kvh or 1, head_dim or 1]: a size-1 dim broadcasts through a zero stride
        static_strides = tuple(
            0 if n == 1 else st for n, st in zip(k_static.shape, k_static.stride())
        )  # type: ignore[assignment]
    return _CacheArgs(
        k, v, k_scale, v_scale, k_static, v_static,
        (k.stride(0), k.stride(1), k.stride(2), *scale_strides, *static_strides),
        mode,
    )  # fmt: skip


def write_kv(
    cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store each token's K/V in its slot (slot < 0: skip), quantizing when the cache is FP8.

    k, v: [num_tokens, num_kv_heads, head_dim] (rows may be strided views of a fused QKV).
    A Hadamard cache (cache.rotation) gets K and V rotated in the same pass.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    rotation = cache.rotation
    if cache.k_amax is not None:  # calibration observers, as in the reference
        assert cache.v_amax is not None
        obs_k, obs_v = (k, v) if rotation is None else (rotate(k, rotation), rotate(v, rotation))
        torch.maximum(cache.k_amax, obs_k.abs().amax(dim=0).float(), out=cache.k_amax)
        torch.maximum(cache.v_amax, obs_v.abs().amax(dim=0).float(), out=cache.v_amax)
    args = _cache_args(cache)
    is_fp8 = args.scale_mode != _NO_SCALE
    fmax = fp8.fp8_max(cache.k.dtype) if is_fp8 else 0.0
    if args.scale_mode == _STATIC:
        assert cache.num_saturated is not None, "static scales count clipped values"
    saturated = cache.num_saturated if cache.num_saturated is not None else slot_mapping
    mant_bits, min_normal, magic = grid_constants(cache.k.dtype)
    block_h = triton.next_power_of_2(num_kv_heads)
    write_kv_kernel[(num_tokens,)](
        k, v, slot_mapping, args.k, args.v, args.k_scale, args.v_scale,
        args.k_static, args.v_static, saturated, rotation if rotation is not None else k,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *args.strides,
        num_kv_heads, head_dim, fmax,
        fp8.SCALE_ROUND_UP / fmax if is_fp8 else 1.0, fp8._MIN_SCALE,
        BLOCK_SIZE=cache.block_size,
        BLOCK_H=block_h if rotation is None else max(16, block_h),  # tl.dot needs 16 rows
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        SCALE_MODE=args.scale_mode,
        MANT_BITS=mant_bits,
        MIN_NORMAL=min_normal,
        MAGIC=magic,
        ROTATE=rotation is not None,
        X_MODE=X_MODES[k.dtype],
    )  # fmt: skip


@dataclass(frozen=True)
class TailArgs:
    """What the attention kernels read of the exact tail in one layer's step."""

    step: TritonTailStep
    new: tuple[torch.Tensor, torch.Tensor]  # this step's residuals and scales (tail_residuals)


def _tail_args(
    cache: LayerKVCache, tail: TailArgs | None, kind: str, q: torch.Tensor
) -> tuple[object, ...]:
    """Return the kernels' rotation and tail arguments (unused pointers get q)."""
    rot = cache.rotation if cache.rotation is not None else q
    if tail is None:
        return (rot, q, q, q, q, q, 0, 0, 1, 0, 0, 0, 0)
    assert cache.tail_store is not None
    store, store_scale = cache.tail_store
    step = tail.step
    table = step.decode if kind == "decode" else step.prefill
    return (
        rot, store, store_scale, tail.new[0], tail.new[1], table,
        step.window, step.ring, max(step.ring, 1), store.shape[2],
        store.stride(0), store_scale.stride(0), cache.k.shape[0],
    )  # fmt: skip


def choose_num_splits(num_kv_heads: int, num_sms: int) -> int:
    """Return the decode grid's split count: enough for one sequence to reach every SM.

    Chosen once per model and device, not per step: a context is cut into at most this many
    splits (each at least KernelConfig.decode_min_split_tokens long), so larger batches use
    fewer splits per sequence by themselves.
    """
    return min(64, triton.next_power_of_2(-(-num_sms // num_kv_heads)))


def paged_decode_attention(
    q: torch.Tensor,
    cache: LayerKVCache,
    out: torch.Tensor,
    token_idx: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int = 1,
    config: KernelConfig | None = None,
    tail: TailArgs | None = None,
) -> None:
    """Attend one query token per sequence over its cached context, GQA-aware.

    q, out: [num_tokens, num_heads, head_dim]; sequence b reads q[token_idx[b]] and writes
    out[token_idx[b]] (distinct rows). seq_lens: [B] int32 (0: padding, gets zeros);
    block_tables: [B, max_blocks] (int32, or int64). Each context is cut into at most
    num_splits splits (flash-decoding). tail: the exact tail's step tables and this step's
    residuals (tail.py): decode_tail_kernel reads the sinks and the window into one more
    split. Rotated keys: rotate_q_kernel rotates each sequence's q once into a compact buffer
    before the split kernels, and reduce_kernel rotates the combined output before its one
    store (rotating in every split program would cost num_splits times the work). One split
    without a tail or rotation writes the output directly.
    """
    config = config or KernelConfig()
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0:
        return
    _, num_heads, head_dim = q.shape
    num_kv_heads = cache.k.shape[0]
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads and q.stride(-1) == 1 and out.stride(-1) == 1
    args = _cache_args(cache)
    if args.scale_mode == _DYNAMIC:  # read as 32-bit words of two tokens, K's and V's together
        assert cache.block_size % 2 == 0 and args.k_scale.stride(0) % 2 == 0
        assert (args.v_scale.data_ptr() - args.k_scale.data_ptr()) % 4 == 0
    rotation = cache.rotation
    num_slots = num_splits + (tail is not None)
    direct = num_slots == 1 and rotation is None
    block_d = max(16, triton.next_power_of_2(head_dim))
    # tl.dot multiplies at least 16 rows: the rotations take query heads 16 at a time
    block_h = 16
    rotated_q = q
    if rotation is not None:  # the decode rows only: a mixed step's prefill rows are not read here
        assert rotation.is_contiguous()
        rotated_q = torch.empty(
            (num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device
        )  # [num_seqs, num_heads, head_dim]
        rotate_q_kernel[(num_seqs, triton.cdiv(num_heads, block_h))](
            q, rotated_q, token_idx, rotation, q.stride(0), q.stride(1),
            rotated_q.stride(0), rotated_q.stride(1), num_heads, head_dim,
            BLOCK_H=block_h, BLOCK_D=block_d, X_MODE=X_MODES[q.dtype],
        )  # fmt: skip
    if direct:
        mid_out = mid_lse = out  # unused
        mid_strides: tuple[int, ...] = (0, 0, 0, 0, 0)
    else:
        mid_out = torch.empty(
            (num_seqs, num_heads, num_slots, head_dim), dtype=torch.float32, device=q.device
        )  # [B, H, S, D]
        mid_lse = torch.empty(
            (num_seqs, num_heads, num_slots), dtype=torch.float32, device=q.device
        )
        mid_strides = (*mid_out.stride()[:3], *mid_lse.stride()[:2])
    dot_dtype = _decode_dot_dtype(q.dtype, cache.k.dtype)
    words = dot_dtype == tl.float16 and args.scale_mode != _NO_SCALE and head_dim % 4 == 0
    split = dot_dtype == tl.float16 and q.dtype == torch.float32
    tail_table = tail.step.decode if tail is not None else seq_lens
    window = tail.step.window if tail is not None else 0
    common = dict(
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_SIZE=cache.block_size,
        SCALE_MODE=args.scale_mode,
        COMPACT_Q=rotation is not None,
    )
    decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        rotated_q, args.k, args.v, args.k_scale, args.k_static, args.v_static,
        out, mid_out, mid_lse, token_idx, seq_lens, block_tables, tail_table,
        scale * _LOG2E,
        rotated_q.stride(0), rotated_q.stride(1), out.stride(0), out.stride(1), *args.strides,
        block_tables.stride(0), *mid_strides, config.decode_min_split_tokens, window,
        (args.v_scale.data_ptr() - args.k_scale.data_ptr()) // 4,
        HEAD_DIM=head_dim,
        BLOCK_N=config.decode_block_n,
        TAIL_BLOCK_N=config.decode_tail_block_n,
        DIRECT=direct,
        PRECISION=_precision(q.dtype),
        DOT_DTYPE=dot_dtype,
        SPLIT=split,
        SKIP_TAIL=tail is not None,
        WIDE=cache.k.stride(0) >= 2**31,
        WORDS=words,
        PTX_CVT=words and not is_interpreted() and _converts_fp8_pairs(),
        num_warps=config.decode_split_num_warps if split else config.decode_num_warps,
        num_stages=config.decode_num_stages,
        **common,
    )  # fmt: skip
    if tail is not None:
        decode_tail_kernel[(num_seqs, num_kv_heads)](
            rotated_q, args.k, args.v, args.k_scale, args.v_scale, args.k_static, args.v_static,
            mid_out, mid_lse, token_idx, seq_lens, block_tables, scale * _LOG2E,
            rotated_q.stride(0), rotated_q.stride(1), *args.strides, block_tables.stride(0),
            *mid_strides, head_dim, *_tail_args(cache, tail, "decode", q)[1:], num_splits,
            BLOCK_N=config.decode_tail_block_n,
            num_warps=config.decode_tail_num_warps,
            num_stages=1,
            **common,
        )  # fmt: skip
    if not direct:
        # rotated values: the combined output stays float32 until it is rotated (one rounding)
        grid_h = triton.cdiv(num_heads, block_h) if rotation is not None else num_heads
        reduce_kernel[(num_seqs, grid_h)](
            mid_out, mid_lse, out, token_idx,
            rotation if rotation is not None else mid_out, *mid_strides,
            out.stride(0), out.stride(1), num_heads, head_dim, num_slots,
            BLOCK_S=triton.next_power_of_2(num_slots),
            BLOCK_D=block_d,
            BLOCK_H=block_h,
            ROTATE=rotation is not None,
            X_MODE=X_MODES[out.dtype],
        )  # fmt: skip


def paged_prefill_attention(
    q: torch.Tensor,
    cache: LayerKVCache,
    out: torch.Tensor,
    q_start: torch.Tensor,
    q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_q_len: int,
    scale: float,
    config: KernelConfig | None = None,
    tail: TailArgs | None = None,
) -> None:
    """Attend packed variable-length chunks over their cached context (causal in the chunk).

    Sequence i owns rows [q_start[i], q_start[i] + q_lens[i]) of q and out ([num_tokens,
    num_heads, head_dim]) and has seq_lens[i] tokens of context, its chunk included, in the
    blocks of block_tables[i]. q_start, q_lens, seq_lens: [P] int32. tail: as for decode.
    """
    config = config or KernelConfig()
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or max_q_len == 0:
        return
    _, num_heads, head_dim = q.shape
    num_kv_heads = cache.k.shape[0]
    assert q.stride(-1) == 1 and out.stride(-1) == 1
    args = _cache_args(cache)
    block_m = config.prefill_block_m
    grid = (num_seqs, -(-max_q_len // block_m), num_heads)
    prefill_kernel[grid](
        q, args.k, args.v, args.k_scale, args.v_scale, args.k_static, args.v_static,
        out, q_start, q_lens, seq_lens, block_tables,
        scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *args.strides,
        block_tables.stride(0), head_dim,
        *_tail_args(cache, tail, "prefill", q),
        GROUP=num_heads // num_kv_heads,
        BLOCK_M=block_m,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=config.prefill_block_n,
        BLOCK_SIZE=cache.block_size,
        SCALE_MODE=args.scale_mode,
        PRECISION=_precision(q.dtype),
        HAS_TAIL=tail is not None,
        ROTATE=cache.rotation is not None,
        DOT_DTYPE=_dot_dtype(q.dtype),
        num_warps=config.prefill_num_warps,
        num_stages=config.prefill_num_stages,
    )  # fmt: skip


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """Return tl.dot's operand type: the model's, except bf16 under the interpreter.

    The interpreter multiplies bf16 operands as their raw uint16 bits; widening bf16 values to
    fp32 is exact and the products accumulate in fp32 either way, so the numbers match.
    """
    if dtype == torch.bfloat16:
        return tl.float32 if is_interpreted() else tl.bfloat16
    return {torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


@functools.cache
def _converts_fp8_pairs() -> bool:
    """Return whether the target GPU widens two FP8 values in one instruction (sm_89+)."""
    arch = triton.runtime.driver.active.get_current_target().arch
    return isinstance(arch, int) and arch >= 89


def _decode_dot_dtype(dtype: torch.dtype, cache_dtype: torch.dtype) -> tl.dtype:
    """Return decode_kernel's tl.dot operand type: fp16 over an FP8 cache.

    Every E4M3 / E5M2 value is an fp16 value and one instruction widens two of them, where
    bf16 operands take three conversions per pair (E4M3 -> fp16 -> fp32 -> bf16). The query,
    already scaled by the softmax scale, and the softmax weights (in [0, 1]) fit fp16 with
    more mantissa than bf16's; an fp32 model's are split into two fp16 terms (SPLIT).
    """
    if cache_dtype in fp8.FP8_DTYPES:
        return tl.float16
    return _dot_dtype(dtype)


def _precision(dtype: torch.dtype) -> str:
    """Return tl.dot's input precision: full fp32 for fp32 models (no TF32 surprise)."""
    return "ieee" if dtype == torch.float32 else "tf32"
