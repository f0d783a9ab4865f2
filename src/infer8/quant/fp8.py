"""FP8 quantize / dequantize and scale math (pure torch).

X_fp8 = clip(round_to_fp8(X / scale), -max, +max), max = 448 (E4M3) or 57344 (E5M2); the cast
rounds to nearest even and the clamp comes first, so no NaN or inf is ever stored.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# Scales are stored in bfloat16 beside the cache; a scale rounded down would push the largest
# value past the format max, so computed scales are nudged up by more than bf16's rounding error.
SCALE_DTYPE = torch.bfloat16
SCALE_ROUND_UP = 1.0 + 2.0**-7
_MIN_SCALE = 1e-12


def kv_dtype_name(dtype: torch.dtype) -> str:
    """Return a cache dtype as users know it: 'FP8 (E4M3)', 'FP8 (E5M2)', 'bfloat16'."""
    if dtype == torch.float8_e4m3fn:
        return "FP8 (E4M3)"
    if dtype == torch.float8_e5m2:
        return "FP8 (E5M2)"
    return str(dtype).removeprefix("torch.")


def fp8_max(dtype: torch.dtype) -> float:
    """Return the largest finite value of an FP8 dtype."""
    assert dtype in FP8_DTYPES, f"{dtype} is not an fp8 dtype"
    return float(torch.finfo(dtype).max)


def dynamic_scale(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Return per-row scales (amax of the last dim / format max) in SCALE_DTYPE."""
    amax = x.abs().amax(dim=-1).float()
    scale = (amax * (SCALE_ROUND_UP / fp8_max(dtype))).clamp_min(_MIN_SCALE)
    return scale.to(SCALE_DTYPE)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Return x / scale clipped to the format range and cast to `dtype`.

    `scale` broadcasts against x (e.g. [..., 1] per row, or per channel).
    """
    m = fp8_max(dtype)
    return (x.float() / scale.float()).clamp_(-m, m).to(dtype)


def quantize_counting(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize like `quantize`; also return how many values were clipped (a 0-d tensor)."""
    m = fp8_max(dtype)
    y = x.float() / scale.float()
    num_saturated = (y.abs() > m).sum()
    return y.clamp_(-m, m).to(dtype), num_saturated


def dequantize(xq: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Return xq * scale in `out_dtype`."""
    return xq.to(out_dtype) * scale.to(out_dtype)
