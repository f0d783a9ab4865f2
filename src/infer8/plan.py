"""`infer8 plan`: how a model fits a device (weights, KV budget, sessions, decode bound).

Pure arithmetic over a model's config.json shape (plan_presets.py): no weights are read and no
device is touched; the command line is plan_cli.py.
Assumptions (printed with every plan):
- Memory: `gpu_memory_utilization x device memory` must hold the weights, an activation reserve
  and the KV cache, as in LLMEngine. The reserve defaults to the engine's own estimate for the
  largest step (`max_num_batched_tokens`, `max_num_seqs`); `--activation-reserve-gib` overrides
  it. The rest of the device (1 - utilization) is left for the CUDA context and fragmentation.
- Weights: bf16 is 2 bytes a parameter. fp8 / int4 quantize the decoder's linear layers
  (q/k/v/o, gate/up/down); embeddings, LM head, norms and biases stay bf16. int4 adds a bf16
  scale per group of 128 weights. Tensor parallelism splits every weight N ways.
- KV: K and V for every layer and KV head; infer8's FP8 cache adds a bf16 scale per token per
  KV head for K and for V (`--no-kv-scales` gives vLLM-style per-tensor, scale-less numbers).
  KV heads are split across TP ranks, replicated when N exceeds them. Blocks are allocated whole.
- Decode bound: one step reads every weight of a rank once plus the KV of every running
  session at full context, at the device's peak bandwidth (a floor on step time; real kernels
  reach ~70-90% of peak; TP communication is ignored).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from infer8.attention.exact_tail import resolve_exact_tail
from infer8.attention.kv_cache import KVCacheSpec
from infer8.config import KVCacheDType, cuda_max_num_batched_tokens
from infer8.distributed.sharding import check_tensor_parallel_size, kv_heads_per_rank
from infer8.plan_presets import (
    BF16_BYTES,
    WEIGHT_DTYPES,
    DeviceSpec,
    GiB,
    ModelShape,
)
from infer8.worker import memory

ASSUMPTIONS = (
    "weights / TP per device (fp8 and int4 quantize the decoder's projections; embeddings, "
    "LM head and norms stay bf16; int4 adds a bf16 scale per 128 weights); usable memory = "
    "gpu_memory_utilization x device memory, minus weights and the activation reserve, is the "
    "KV budget; KV heads split across TP ranks (replicated past their count); every session "
    "is counted at the full context length; the decode bound reads all weights of a rank and "
    "the KV of every session once per step at peak bandwidth (no TP communication)."
)


@dataclass(frozen=True)
class PlanInputs:
    """One configuration to plan: model, device and the engine flags that decide memory."""

    model: ModelShape
    device: DeviceSpec
    weight_dtype: str = "bf16"
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: the engine's auto for this GPU
    activation_reserve_bytes: int | None = None  # None: the engine's estimate
    use_kv_scales: bool = True
    # FP8 exact tail: max_num_seqs stores of N - 1 + S FP8 residual tokens (None: the engine's
    # auto, which keeps a tail for FP8 caches on GPUs with E4M3)
    kv_cache_exact_tail_tokens: int | None = None
    kv_cache_exact_sink_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.kv_cache_dtype in KVCacheDType.choices():  # the engine's auto (the worker's rule)
            tail = resolve_exact_tail(
                self.kv_cache_exact_tail_tokens,
                None,
                is_fp8=self.is_fp8_kv,
                kernels_read_tail=self.device.has_e4m3,
                has_static_scales=not self.use_kv_scales,
                head_dim=self.model.head_dim,
                sink_tokens=self.kv_cache_exact_sink_tokens,
                block_size=self.block_size,
            )
            object.__setattr__(self, "kv_cache_exact_tail_tokens", tail.tokens)
            object.__setattr__(self, "kv_cache_exact_sink_tokens", tail.sink_tokens)
        if self.max_num_batched_tokens is None:
            auto = cuda_max_num_batched_tokens(self.device.memory_bytes, self.device.name)
            object.__setattr__(self, "max_num_batched_tokens", auto)
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(
                f"unknown weight dtype {self.weight_dtype!r}; choose one of "
                f"{', '.join(WEIGHT_DTYPES)}"
            )
        if self.kv_cache_dtype not in KVCacheDType.choices():
            raise ValueError(
                f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose one of "
                f"{', '.join(KVCacheDType.choices())}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.activation_reserve_bytes is not None and self.activation_reserve_bytes < 0:
            raise ValueError("the activation reserve must be >= 0")
        check_tensor_parallel_size(self.model, self.tensor_parallel_size)  # the engine's rule

    @property
    def context_len(self) -> int:
        """Return the context length each session is planned for."""
        return self.max_model_len or self.model.max_position_embeddings

    @property
    def is_fp8_kv(self) -> bool:
        """Return whether KV elements are one byte."""
        return KVCacheDType.parse(self.kv_cache_dtype).is_fp8

    @property
    def num_kv_heads_per_device(self) -> int:
        """Return the KV heads one TP rank stores (replicated when TP exceeds them)."""
        return kv_heads_per_rank(self.model.num_key_value_heads, self.tensor_parallel_size)


def kv_cache_spec(inputs: PlanInputs, num_kv_heads: int) -> KVCacheSpec:
    """Return the KVCacheSpec the engine would build for `num_kv_heads` KV heads (its bytes per
    token and tail bytes are the engine's own rules). Without per-token scales
    (`use_kv_scales` False) the cache is costed as with static ones."""
    m = inputs.model
    dtype = KVCacheDType.parse(inputs.kv_cache_dtype).torch_dtype(torch.bfloat16)
    return KVCacheSpec(
        m.num_hidden_layers, num_kv_heads, m.head_dim, inputs.block_size, dtype,
        inputs.kv_cache_exact_tail_tokens or 0, inputs.kv_cache_exact_sink_tokens or 0,
        kv_scale="dynamic" if inputs.use_kv_scales else "static",
    )  # fmt: skip


def kv_bytes_per_token(inputs: PlanInputs, num_kv_heads: int) -> int:
    """Return K+V bytes of one token over all layers for `num_kv_heads` heads."""
    return kv_cache_spec(inputs, num_kv_heads).bytes_per_token


def exact_tail_bytes(inputs: PlanInputs) -> int:
    """Return one device's FP8 exact-tail stores: max_num_seqs x (N - 1 + S) residual tokens."""
    return kv_cache_spec(inputs, inputs.num_kv_heads_per_device).tail_bytes(inputs.max_num_seqs)


def estimate_activation_bytes(inputs: PlanInputs) -> int:
    """Return the engine's activation reserve for the largest step, per TP rank."""
    m = inputs.model
    return memory.estimate_activation_bytes(
        m.hidden_size,
        m.intermediate_size // inputs.tensor_parallel_size,
        m.vocab_size,
        inputs.max_num_batched_tokens,
        inputs.max_num_seqs,
    )


@dataclass(frozen=True)
class Plan:
    """The planner's answer for one configuration (bytes; GiB only in the printed forms)."""

    inputs: PlanInputs
    weight_bytes_per_device: int
    usable_bytes: int
    activation_reserve_bytes: int
    kv_budget_bytes: int  # may be negative: the shortfall
    kv_bytes_per_token: int  # whole model, all KV heads
    kv_bytes_per_token_per_device: int
    max_kv_tokens: int
    max_concurrent_sessions: int
    decode_batch: int
    decode_step_s: float | None
    problems: tuple[str, ...]

    @property
    def fits(self) -> bool:
        """Return whether weights, reserve and at least one full-length session fit."""
        return not self.problems

    @property
    def decode_tokens_per_s_bound(self) -> float | None:
        """Return the bandwidth bound on decode tokens/s at `decode_batch`."""
        if self.decode_step_s is None:
            return None
        return self.decode_batch / self.decode_step_s

    def to_json_dict(self) -> dict[str, Any]:
        """Return the `--json` object."""
        i = self.inputs
        bound = self.decode_tokens_per_s_bound
        return {
            "fits": self.fits,
            "problems": list(self.problems),
            "model": i.model.name,
            "num_params": i.model.num_params,
            "device": i.device.name,
            "device_memory_gib": round(i.device.memory_bytes / GiB, 2),
            "bandwidth_gbps": round(i.device.bandwidth_bytes_per_s / 1e9, 1),
            "weight_dtype": i.weight_dtype,
            "kv_cache_dtype": i.kv_cache_dtype,
            "kv_scales_included": i.is_fp8_kv and i.use_kv_scales,
            "gpu_memory_utilization": i.gpu_memory_utilization,
            "tensor_parallel_size": i.tensor_parallel_size,
            "max_model_len": i.context_len,
            "block_size": i.block_size,
            "max_num_seqs": i.max_num_seqs,
            "kv_cache_exact_tail_tokens": i.kv_cache_exact_tail_tokens,
            "kv_cache_exact_sink_tokens": i.kv_cache_exact_sink_tokens,
            "kv_exact_tail_bytes_per_device": exact_tail_bytes(i),
            "max_num_batched_tokens": i.max_num_batched_tokens,
            "weights_gib_per_device": _gib(self.weight_bytes_per_device),
            "usable_gib_per_device": _gib(self.usable_bytes),
            "activation_reserve_gib": _gib(self.activation_reserve_bytes),
            "kv_budget_gib": _gib(max(0, self.kv_budget_bytes)),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes_per_token_per_device": self.kv_bytes_per_token_per_device,
            "max_kv_tokens": self.max_kv_tokens,
            "max_concurrent_sessions": self.max_concurrent_sessions,
            "decode_batch": self.decode_batch,
            "decode_step_ms_floor": None
            if self.decode_step_s is None
            else round(self.decode_step_s * 1e3, 2),
            "decode_tokens_per_s_bound": None if bound is None else round(bound, 1),
        }


def _gib(num_bytes: int) -> float:
    return round(num_bytes / GiB, 2)


def plan_capacity(inputs: PlanInputs) -> Plan:
    """Return weights, KV budget, capacity and the decode bound for one configuration."""
    tp = inputs.tensor_parallel_size
    weights = math.ceil(inputs.model.weight_bytes(inputs.weight_dtype) / tp)
    m = inputs.model
    if inputs.device.packed_tied_lm_head and m.tie_word_embeddings:
        weights += math.ceil(m.vocab_size * m.hidden_size * BF16_BYTES / tp)
    usable = int(inputs.gpu_memory_utilization * inputs.device.memory_bytes)
    reserve = inputs.activation_reserve_bytes
    if reserve is None:
        reserve = estimate_activation_bytes(inputs)
    kv_budget = memory.left_for_kv_bytes(
        inputs.device.memory_bytes, inputs.gpu_memory_utilization, weights, reserve
    )
    per_token = kv_bytes_per_token(inputs, inputs.model.num_key_value_heads)
    per_token_device = kv_bytes_per_token(inputs, inputs.num_kv_heads_per_device)
    tail_bytes = exact_tail_bytes(inputs)
    num_blocks = max(0, kv_budget - tail_bytes) // (per_token_device * inputs.block_size)
    max_kv_tokens = num_blocks * inputs.block_size
    blocks_per_session = math.ceil(inputs.context_len / inputs.block_size)
    sessions = num_blocks // blocks_per_session
    problems: list[str] = []
    if inputs.weight_dtype == "int4":  # the planner sizes it; the engine cannot run it
        problems.append(
            "infer8 runs bf16 and fp8 weights only: int4 is planned for comparison, not servable"
        )
    where = (
        f"{usable / GiB:.2f} GiB usable per device ({inputs.gpu_memory_utilization} x "
        f"{inputs.device.memory_bytes / GiB:.2f} GiB)"
    )
    if weights + reserve > usable:
        problems.append(
            f"weights ({inputs.weight_dtype}) need {weights / GiB:.2f} GiB per device and the "
            f"activation reserve {reserve / GiB:.2f} GiB, but there are only {where}"
        )
    elif sessions < 1:
        problems.append(
            f"one {inputs.context_len}-token session needs "
            f"{blocks_per_session * inputs.block_size * per_token_device / GiB:.2f} GiB of KV "
            f"per device; only {max(0, kv_budget) / GiB:.2f} GiB is left of {where}"
        )
    batch = min(sessions, inputs.max_num_seqs)
    step_s = None
    if batch:
        step_bytes = weights + batch * inputs.context_len * per_token_device
        step_s = step_bytes / inputs.device.bandwidth_bytes_per_s
    return Plan(
        inputs=inputs,
        weight_bytes_per_device=weights,
        usable_bytes=usable,
        activation_reserve_bytes=reserve,
        kv_budget_bytes=kv_budget,
        kv_bytes_per_token=per_token,
        kv_bytes_per_token_per_device=per_token_device,
        max_kv_tokens=max_kv_tokens,
        max_concurrent_sessions=sessions,
        decode_batch=batch,
        decode_step_s=step_s,
        problems=tuple(problems),
    )


def smallest_fitting_tp(inputs: PlanInputs, limit: int = 64) -> int | None:
    """Return the smallest valid tensor-parallel size that fits, or None up to `limit`."""
    for tp in range(1, limit + 1):
        try:
            candidate = dataclasses.replace(inputs, tensor_parallel_size=tp)
        except ValueError:
            continue
        if plan_capacity(candidate).fits:
            return tp
    return None


def ways_to_fit(inputs: PlanInputs, limit: int = 64) -> list[Plan]:
    """Return a fitting plan for each way out of a configuration that does not fit.

    FP8 weights at the same tensor-parallel size, the smallest tensor-parallel size that fits,
    and both: FP8 weights at the smallest size where they fit (at the previous one's size when
    FP8 weights alone fit).
    """
    ways: list[PlanInputs] = []
    fp8 = dataclasses.replace(inputs, weight_dtype="fp8") if inputs.weight_dtype == "bf16" else None
    if fp8 is not None and plan_capacity(fp8).fits:
        ways.append(fp8)
    tp = smallest_fitting_tp(inputs, limit)
    if tp is not None:
        ways.append(dataclasses.replace(inputs, tensor_parallel_size=tp))
    if fp8 is not None:
        both_tp = smallest_fitting_tp(fp8, limit)
        if both_tp == inputs.tensor_parallel_size:
            both_tp = tp
        if both_tp is not None and both_tp != inputs.tensor_parallel_size:
            ways.append(dataclasses.replace(fp8, tensor_parallel_size=both_tp))
    return [plan_capacity(way) for way in ways]
