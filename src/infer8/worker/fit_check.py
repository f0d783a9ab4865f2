"""Refuse, before anything is allocated, a model that cannot fit this machine: one line naming
the config.json fields.

The fit uses the planner's arithmetic (plan_presets.ModelShape counts the parameters) and the
worker's (worker/memory.py: the device's memory, the activation reserve, the KV budget), so a
config of 100,000 layers is refused in a millisecond, not after minutes of building modules.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infer8.plan_presets import ModelShape
from infer8.worker import memory

if TYPE_CHECKING:
    from infer8.config import EngineConfig


def weight_bytes(shape: ModelShape, dtype_bytes: int, is_fp8: bool, tp: int = 1) -> int:
    """Return one rank's weight bytes in the compute dtype (FP8: the projections one byte)."""
    linear = shape.num_linear_params
    rope = shape.max_position_embeddings * shape.head_dim  # the cos and sin tables
    rest = shape.num_params - linear + rope
    return math.ceil((linear * (1 if is_fp8 else dtype_bytes) + rest * dtype_bytes) / tp)


def config_source(model_path: str) -> str:
    """Return what a message names as the model's config: its config.json, or the GGUF file."""
    if not model_path:
        return "the default model's config.json"
    path = Path(model_path)
    return str(path / "config.json") if path.is_dir() else model_path


def check_fits_memory(config: EngineConfig, hf_config: dict[str, Any]) -> None:
    """Refuse, before anything is allocated, a model whose weights cannot fit the device (with
    the largest step's activations, on CPU), whose KV budget on CPU then holds no block, or
    beside which RAM cannot hold the host KV tier; the message names the fields."""
    from infer8.attention.kv_cache import KVCacheSpec
    from infer8.host_memory import check_host_tier
    from infer8.models.fp8_weights import fp8_checkpoint_scheme

    model_config, cache_config = config.model_config, config.cache_config
    sched, tp = config.scheduler_config, config.parallel_config.tensor_parallel_size
    device, dtype = model_config.device, model_config.dtype
    is_cpu = device.type == "cpu"
    source = config_source(config.model_config.model)
    shape = ModelShape.from_hf_config(hf_config, source)
    is_fp8 = config.quantization == "fp8" or fp8_checkpoint_scheme(hf_config) is not None
    weights = weight_bytes(shape, dtype.itemsize, is_fp8, tp)
    # On CUDA the worker measures a step instead: only the weights are certain to be needed.
    activations = 0
    if is_cpu:
        activations = memory.estimate_activation_bytes(
            shape.hidden_size,
            math.ceil(shape.intermediate_size / tp),
            shape.vocab_size,
            sched.max_num_batched_tokens,
            sched.max_num_seqs,
        )
    device_bytes = memory.device_memory_bytes(device)
    utilization = cache_config.gpu_memory_utilization
    usable = int(utilization * device_bytes)
    if weights + activations > usable:
        reserve = f" and a {_gib(activations)} activation reserve" if activations else ""
        raise ValueError(
            f"{source}: {_shape_fields(shape)} make {_gib(weights)} of {dtype_name(dtype)} "
            f"weights{' per rank' if tp > 1 else ''}{reserve}, more than the {_gib(usable)} "
            f"usable of {'RAM' if is_cpu else 'device memory'} ({utilization} x "
            f"{_gib(device_bytes)})"
        )
    kv_bytes = 0
    if is_cpu or cache_config.kv_cache_memory_bytes is not None:
        kv_spec = KVCacheSpec(
            num_layers=shape.num_hidden_layers,
            num_kv_heads=max(1, shape.num_key_value_heads // tp),
            head_dim=shape.head_dim,
            block_size=cache_config.block_size,
            dtype=cache_config.kv_cache_dtype.torch_dtype(dtype),
            exact_tail_tokens=cache_config.kv_cache_exact_tail_tokens or 0,
            exact_sink_tokens=cache_config.kv_cache_exact_sink_tokens or 0,
            hadamard=bool(cache_config.kv_cache_hadamard),
        )
        max_len = model_config.max_model_len or shape.max_position_embeddings
        num_blocks_needed = sched.max_num_seqs * -(-max_len // cache_config.block_size)
        plan = memory.plan_kv_memory(
            device_bytes, utilization, weights, activations,
            num_blocks_needed * kv_spec.bytes_per_block, is_cpu,
            cache_config.kv_cache_memory_bytes,
        )  # fmt: skip
        kv_bytes = plan.kv_bytes
        if kv_spec.num_blocks_for(kv_bytes) < 1:
            raise ValueError(
                f"{source}: num_hidden_layers {shape.num_hidden_layers:,} x num_key_value_heads "
                f"{shape.num_key_value_heads} x head_dim {shape.head_dim} make one KV block of "
                f"{cache_config.block_size} tokens {_gib(kv_spec.bytes_per_block)}, more than "
                f"the KV cache budget of {_gib(kv_bytes)}"
            )
    if cache_config.kv_offloading_size and cache_config.enable_prefix_caching:
        ram_bytes = (weights + activations + kv_bytes) * tp if is_cpu else 0
        check_host_tier(cache_config.kv_offloading_size, ram_bytes)


def _shape_fields(shape: ModelShape) -> str:
    """Name the fields that size the weights, the larger share first."""
    layers = (
        f"num_hidden_layers {shape.num_hidden_layers:,} (hidden_size {shape.hidden_size:,}, "
        f"intermediate_size {shape.intermediate_size:,})"
    )
    embeddings = f"vocab_size {shape.vocab_size:,} x hidden_size {shape.hidden_size:,}"
    rope = f"max_position_embeddings {shape.max_position_embeddings:,}"
    shares = [
        (shape.num_linear_params, layers),
        (shape.vocab_size * shape.hidden_size, embeddings),
        (shape.max_position_embeddings * shape.head_dim, rope),
    ]
    return " and ".join(text for _, text in sorted(shares, key=lambda s: -s[0])[:2])


def dtype_name(dtype: Any) -> str:
    """Return "bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / memory.GiB:.2f} GiB"
