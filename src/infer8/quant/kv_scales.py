"""Static FP8 KV scales: from a checkpoint's k_scale / v_scale tensors or a calibration JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from infer8.quant import fp8

CALIBRATION_FORMAT = "infer8-kv-amax-v1"
GRANULARITIES = ("layer", "head", "channel")


@dataclass
class StaticKVScales:
    """Per-layer K and V scales, each broadcastable to [num_kv_heads, head_dim]."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    source: str


def _as_broadcast(t: torch.Tensor, num_kv_heads: int, head_dim: int, what: str) -> torch.Tensor:
    """Shape a scale as [1, 1], [num_kv_heads, 1] or [num_kv_heads, head_dim]."""
    t = t.float().reshape(-1)
    if t.numel() == 1:
        out = t.reshape(1, 1)
    elif t.numel() == num_kv_heads:
        out = t.reshape(num_kv_heads, 1)
    elif t.numel() == num_kv_heads * head_dim:
        out = t.reshape(num_kv_heads, head_dim)
    else:
        raise ValueError(
            f"{what} has {t.numel()} values; expected 1, {num_kv_heads} (per KV head) or "
            f"{num_kv_heads * head_dim} (per channel)"
        )
    if not torch.isfinite(out).all() or (out <= 0).any():
        raise ValueError(f"{what} must be finite and positive")
    return out


def from_checkpoint(
    ckpt: dict[int, dict[str, torch.Tensor]], num_layers: int, num_kv_heads: int, head_dim: int
) -> StaticKVScales | None:
    """Return the checkpoint's scales (k_scale / v_scale, or legacy kv_scale), None if absent."""
    if not ckpt:
        return None
    ks, vs = [], []
    for layer in range(num_layers):
        entry = ckpt.get(layer, {})
        k = entry.get("k_scale", entry.get("kv_scale"))
        v = entry.get("v_scale", entry.get("kv_scale"))
        if k is None or v is None:
            raise ValueError(
                f"the checkpoint has KV scales for some layers but not for layer {layer}"
            )
        ks.append(_as_broadcast(k, num_kv_heads, head_dim, f"layer {layer} k_scale"))
        vs.append(_as_broadcast(v, num_kv_heads, head_dim, f"layer {layer} v_scale"))
    return StaticKVScales(ks, vs, source="checkpoint")


def load_calibration(
    path: str | Path, dtype: torch.dtype, num_layers: int, num_kv_heads: int, head_dim: int
) -> StaticKVScales:
    """Read a calibration file (amax per layer/head/channel) and turn it into scales for dtype."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read KV scales file {path}: {e}") from None
    if data.get("format") != CALIBRATION_FORMAT:
        raise ValueError(
            f"{path} is not an infer8 KV calibration file (format {CALIBRATION_FORMAT})"
        )
    if len(data["k_amax"]) != num_layers or len(data["v_amax"]) != num_layers:
        raise ValueError(
            f"{path} has scales for {len(data['k_amax'])} layers, the model has {num_layers}"
        )
    margin = float(data.get("margin", 1.0))
    m = fp8.fp8_max(dtype)
    ks = [
        _as_broadcast(torch.tensor(a) * margin / m, num_kv_heads, head_dim, f"{path} k_amax[{i}]")
        for i, a in enumerate(data["k_amax"])
    ]
    vs = [
        _as_broadcast(torch.tensor(a) * margin / m, num_kv_heads, head_dim, f"{path} v_amax[{i}]")
        for i, a in enumerate(data["v_amax"])
    ]
    return StaticKVScales(ks, vs, source=str(path))


def save_calibration(
    path: str | Path,
    k_amax: list[torch.Tensor],
    v_amax: list[torch.Tensor],
    granularity: str,
    model: str,
    num_tokens: int,
    margin: float = 1.0,
) -> None:
    """Write per-layer amax (reduced to the granularity) as a calibration file."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")

    def reduce(a: torch.Tensor, is_v: bool) -> list:
        # [num_kv_heads, head_dim] per-channel amax; V stays per head at channel granularity
        if granularity == "layer":
            return [a.max().item()]
        if granularity == "head" or is_v:
            return a.amax(dim=-1).tolist()
        return a.reshape(-1).tolist()

    data = {
        "format": CALIBRATION_FORMAT,
        "model": model,
        "granularity": granularity,
        "num_tokens": num_tokens,
        "margin": margin,
        "k_amax": [reduce(a, False) for a in k_amax],
        "v_amax": [reduce(a, True) for a in v_amax],
    }
    Path(path).write_text(json.dumps(data, indent=1))
