"""FP8 quantize / dequantize / scale math, and static scale files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from infer8.quant import fp8, kv_scales

FORMATS = [(torch.float8_e4m3fn, 448.0, 2.0**-4), (torch.float8_e5m2, 57344.0, 2.0**-3)]


@pytest.mark.parametrize("dtype, fmax, rel", FORMATS)
def test_round_trip_relative_error_in_normal_range(
    dtype: torch.dtype, fmax: float, rel: float
) -> None:
    torch.manual_seed(0)
    tiny = float(torch.finfo(dtype).smallest_normal)
    # log-uniform magnitudes across the normal range, both signs
    mag = torch.exp(
        torch.empty(10000).uniform_(
            torch.log(torch.tensor(tiny)).item(), torch.log(torch.tensor(fmax)).item()
        )
    )
    x = mag * torch.where(torch.rand(10000) < 0.5, -1.0, 1.0)
    one = torch.ones(())
    y = fp8.dequantize(fp8.quantize(x, one, dtype), one, torch.float32)
    err = ((y - x).abs() / x.abs()).max().item()
    assert err <= rel, err
    assert torch.equal(torch.sign(y), torch.sign(x))


@pytest.mark.parametrize("dtype, fmax, rel", FORMATS)
def test_saturates_exactly_at_format_max_and_never_stores_inf(
    dtype: torch.dtype, fmax: float, rel: float
) -> None:
    assert fp8.fp8_max(dtype) == fmax
    x = torch.tensor([fmax, -fmax, fmax * 1.5, -fmax * 10, float("inf"), -float("inf"), 0.0, -0.0])
    q = fp8.quantize(x, torch.ones(()), dtype)
    y = q.float()
    assert torch.isfinite(y).all()
    assert y.tolist() == [fmax, -fmax, fmax, -fmax, fmax, -fmax, 0.0, 0.0]
    _, n = fp8.quantize_counting(x, torch.ones(()), dtype)
    assert int(n) == 4  # 1.5x, 10x and both infinities were clipped; exactly-max was not


@pytest.mark.parametrize("dtype, fmax, rel", FORMATS)
def test_dynamic_scale_per_token_keeps_precision_beside_an_outlier_token(
    dtype: torch.dtype, fmax: float, rel: float
) -> None:
    torch.manual_seed(1)
    x = torch.randn(8, 3, 64)  # [tokens, kv_heads, head_dim]
    x[5] *= 1e5  # one outlier token
    scale = fp8.dynamic_scale(x, dtype)  # [tokens, kv_heads]
    assert scale.shape == (8, 3) and scale.dtype == fp8.SCALE_DTYPE
    y = fp8.dequantize(fp8.quantize(x, scale[..., None], dtype), scale[..., None], torch.float32)
    # relative to each token-head's amax, every token (outlier included) keeps the format's precision
    amax = x.abs().amax(dim=-1, keepdim=True)
    assert ((y - x).abs() / amax).max().item() <= rel
    # the largest value of each row maps near the format max but is never clipped
    _, n = fp8.quantize_counting(x, scale[..., None], dtype)
    assert int(n) == 0
    if dtype == torch.float8_e5m2:
        return  # E5M2's exponent range absorbs a 1e5 outlier even with one scale per tensor
    # E4M3 with a single per-tensor scale (its amax from the outlier) loses the small tokens
    per_tensor = x.abs().max() / fmax
    y_t = fp8.dequantize(fp8.quantize(x, per_tensor, dtype), per_tensor, torch.float32)
    small = torch.arange(8) != 5
    err_dyn = ((y - x)[small].abs() / x[small].abs().clamp_min(1e-3)).median()
    err_tensor = ((y_t - x)[small].abs() / x[small].abs().clamp_min(1e-3)).median()
    assert err_tensor > 4 * err_dyn


def test_zero_rows_get_a_tiny_scale_and_quantize_to_zero() -> None:
    x = torch.zeros(2, 3, 16)
    scale = fp8.dynamic_scale(x, torch.float8_e4m3fn)
    assert (scale > 0).all()
    q = fp8.quantize(x, scale[..., None], torch.float8_e4m3fn)
    assert (q.float() == 0).all()


def test_static_scales_from_checkpoint_tensors() -> None:
    ckpt = {
        0: {"k_scale": torch.tensor(0.5), "v_scale": torch.tensor([0.1, 0.2])},
        1: {"kv_scale": torch.tensor(0.25)},
    }
    s = kv_scales.from_checkpoint(ckpt, num_layers=2, num_kv_heads=2, head_dim=4)
    assert s is not None and s.source == "checkpoint"
    assert (
        s.k[0].tolist() == [[0.5]]
        and s.v[0].tolist() == [[0.1], [0.2]]
        or torch.allclose(s.v[0], torch.tensor([[0.1], [0.2]]))
    )
    assert s.k[1].item() == 0.25 and s.v[1].item() == 0.25
    assert kv_scales.from_checkpoint({}, 2, 2, 4) is None
    with pytest.raises(ValueError, match="layer 1"):
        kv_scales.from_checkpoint({0: ckpt[0]}, 2, 2, 4)
    with pytest.raises(ValueError, match="positive"):
        kv_scales.from_checkpoint({0: {"kv_scale": torch.tensor(0.0)}}, 1, 2, 4)


@pytest.mark.parametrize(
    "granularity, k_shape", [("layer", (1, 1)), ("head", (2, 1)), ("channel", (2, 4))]
)
def test_calibration_file_round_trip(
    tmp_path: Path, granularity: str, k_shape: tuple[int, int]
) -> None:
    amax = [torch.arange(1.0, 9.0).reshape(2, 4), torch.full((2, 4), 3.0)]
    path = tmp_path / "scales.json"
    kv_scales.save_calibration(path, amax, amax, granularity, model="m", num_tokens=10)
    s = kv_scales.load_calibration(path, torch.float8_e4m3fn, 2, 2, 4)
    assert tuple(s.k[0].shape) == k_shape
    assert tuple(s.v[0].shape) == ((1, 1) if granularity == "layer" else (2, 1))
    assert s.k[0].max().item() == pytest.approx(8.0 / 448.0)
    # the same file gives E5M2 scales for E5M2's range
    s2 = kv_scales.load_calibration(path, torch.float8_e5m2, 2, 2, 4)
    assert s2.k[0].max().item() == pytest.approx(8.0 / 57344.0)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not an infer8 KV calibration file"):
        kv_scales.load_calibration(bad, torch.float8_e4m3fn, 2, 2, 4)
    with pytest.raises(ValueError, match="3 layers|layers"):
        kv_scales.load_calibration(path, torch.float8_e4m3fn, 3, 2, 4)
