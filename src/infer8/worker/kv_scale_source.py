"""Where a rank's FP8 KV cache scales come from: none (not FP8), dynamic per-token scales, or
static scales from a calibration file or the checkpoint, sharded to this rank's KV heads.

Static mode without scales never falls back to a scale of 1.0: it says so loudly and uses
dynamic per-token scales instead.
"""

from __future__ import annotations

import logging

import torch

from infer8.config import CacheConfig
from infer8.distributed.sharding import TensorParallelShard
from infer8.quant import fp8, kv_scales

logger = logging.getLogger(__name__)

_MISSING = (
    "WARNING: --kv-scale static was requested but the checkpoint has no k_scale/v_scale "
    "tensors and no --kv-scales-path was given; NOT using a scale of 1.0: falling back "
    "to dynamic per-token scales. Run `infer8 calibrate-kv MODEL --out scales.json`."
)


def resolve_kv_scales(
    cache_config: CacheConfig,
    kv_dtype: torch.dtype,
    ckpt_scales: dict[int, dict[str, torch.Tensor]],
    shard: TensorParallelShard | None,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    is_driver: bool,
) -> tuple[kv_scales.StaticKVScales | None, str]:
    """Return this rank's static FP8 scales if asked for and found, and where scales come from:
    "none", "dynamic", "static (SOURCE)" or "dynamic (static scales missing)".

    num_kv_heads is this rank's; a calibration file covers the whole model's, and `shard`
    keeps this rank's share of it.
    """
    cfg = cache_config
    if kv_dtype not in fp8.FP8_DTYPES:
        if cfg.kv_scale == "static":
            logger.warning("--kv-scale static has no effect with a %s KV cache", kv_dtype)
        return None, "none"
    if cfg.kv_scale == "dynamic":
        return None, "dynamic"
    if cfg.kv_scales_path is not None:
        file_heads = num_kv_heads if shard is None else shard.config.num_key_value_heads
        scales = kv_scales.load_calibration(
            cfg.kv_scales_path, kv_dtype, num_layers, file_heads, head_dim
        )
        if shard is not None:
            scales = shard.shard_static_scales(scales)
    else:
        scales = kv_scales.from_checkpoint(ckpt_scales, num_layers, num_kv_heads, head_dim)
    if scales is None:
        if is_driver:
            logger.warning(_MISSING)
        return None, "dynamic (static scales missing)"
    return scales, f"static ({scales.source})"
