"""`infer8 plan`: how a model fits a device (weights, KV budget, sessions, decode bound).

Pure arithmetic over a model's config.json shape; nothing is loaded and no torch is imported.
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

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infer8.attention.exact_tail import DEFAULT_EXACT_SINK_TOKENS, DEFAULT_EXACT_TAIL_TOKENS
from infer8.config import cuda_max_num_batched_tokens
from infer8.worker import memory

GiB = 1 << 30
ASSUMPTIONS = (
    "weights / TP per device (fp8 and int4 quantize the decoder's projections; embeddings, "
    "LM head and norms stay bf16; int4 adds a bf16 scale per 128 weights); usable memory = "
    "gpu_memory_utilization x device memory, minus weights and the activation reserve, is the "
    "KV budget; KV heads split across TP ranks (replicated past their count); every session "
    "is counted at the full context length; the decode bound reads all weights of a rank and "
    "the KV of every session once per step at peak bandwidth (no TP communication)."
)
BF16_BYTES = 2
INT4_GROUP_SIZE = 128

# The real Hugging Face config.json values (the fields the planner reads).
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "qwen2-72b-instruct": {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 8192,
        "intermediate_size": 29568,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    "qwen2-7b-instruct": {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    },
    "llama-3-70b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    },
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
}


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: memory as the CUDA driver reports it, and peak memory bandwidth."""

    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    has_e4m3: bool = True  # FP8 E4M3 (sm_89+): the engine's FP8 exact tail is on by default
    # a CPU host whose engine packs its linear weights for oneDNN (worker/cpu_linear.py) keeps
    # a packed copy of a tied LM head beside the embedding it shares
    packed_tied_lm_head: bool = False


def _device(
    name: str, memory_gib: float, bandwidth_gbps: float, has_e4m3: bool = True
) -> DeviceSpec:
    return DeviceSpec(name, int(memory_gib * GiB), bandwidth_gbps * 1e9, has_e4m3)


# Memory: torch.cuda.get_device_properties().total_memory (what the engine sees), not the
# nameplate; bandwidth: the vendor's peak (SXM parts for H100 / A100).
DEVICE_PRESETS: dict[str, DeviceSpec] = {
    "h100-80gb": _device("h100-80gb", 79.11, 3350),
    "h200-141gb": _device("h200-141gb", 139.80, 4800),
    "a100-80gb": _device("a100-80gb", 79.21, 2039, has_e4m3=False),
    "l4-24gb": _device("l4-24gb", 22.03, 300),
}
WEIGHT_DTYPES = ("bf16", "fp8", "int4")
# --kv-cache-dtype choices (as `infer8 serve`) -> element bytes; auto follows the bf16 weights.
KV_ELEMENT_BYTES: dict[str, int] = {
    "auto": 2,
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}


@dataclass(frozen=True)
class ModelShape:
    """The parts of a Llama-family config.json that decide memory."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str) -> ModelShape:
        """Parse a config.json dict (q/k/v biases default on for Qwen2, as the loader does)."""
        archs = cfg.get("architectures") or []
        is_qwen2 = cfg.get("model_type") == "qwen2" or "Qwen2ForCausalLM" in archs
        num_heads = cfg["num_attention_heads"]
        bias = cfg.get("attention_bias")
        return cls(
            name=name,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 if bias is None else bool(bias),
        )

    @property
    def num_linear_params(self) -> int:
        """Return the decoder's projection weights (what fp8 / int4 quantize)."""
        h, q_size = self.hidden_size, self.num_attention_heads * self.head_dim
        kv_size = self.num_key_value_heads * self.head_dim
        attn = h * (q_size + 2 * kv_size) + q_size * h
        mlp = 3 * h * self.intermediate_size
        return self.num_hidden_layers * (attn + mlp)

    @property
    def num_params(self) -> int:
        """Return all parameters: projections, q/k/v biases, norms, embedding and LM head."""
        q_size = self.num_attention_heads * self.head_dim
        kv_size = self.num_key_value_heads * self.head_dim
        biases = (q_size + 2 * kv_size) if self.attention_bias else 0
        norms = 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        per_layer_rest = biases + norms
        return (
            self.num_linear_params
            + self.num_hidden_layers * per_layer_rest
            + self.hidden_size  # final norm
            + embeddings
        )

    def weight_bytes(self, weight_dtype: str) -> int:
        """Return the bytes of all weights stored as `weight_dtype`."""
        linear = self.num_linear_params
        rest_bytes = (self.num_params - linear) * BF16_BYTES
        if weight_dtype == "bf16":
            return self.num_params * BF16_BYTES
        if weight_dtype == "fp8":
            return linear + rest_bytes
        if weight_dtype == "int4":
            scales = math.ceil(linear / INT4_GROUP_SIZE) * BF16_BYTES
            return math.ceil(linear / 2) + scales + rest_bytes
        raise ValueError(f"unknown weight dtype {weight_dtype!r}; choose one of {WEIGHT_DTYPES}")


def load_model_shape(model: str) -> ModelShape:
    """Return a preset's shape, or read a config.json (or a directory holding one)."""
    if model in MODEL_PRESETS:
        return ModelShape.from_hf_config(MODEL_PRESETS[model], model)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"model {model!r} is neither a preset ({', '.join(MODEL_PRESETS)}) nor a "
            "config.json file or model directory"
        )
    return ModelShape.from_hf_config(json.loads(path.read_text()), str(model))


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
        tail = self.kv_cache_exact_tail_tokens
        if tail is None:
            auto = KV_ELEMENT_BYTES.get(self.kv_cache_dtype) == 1 and self.device.has_e4m3
            tail = DEFAULT_EXACT_TAIL_TOKENS if auto else 0
            object.__setattr__(self, "kv_cache_exact_tail_tokens", tail)
        if self.kv_cache_exact_sink_tokens is None:
            sinks = DEFAULT_EXACT_SINK_TOKENS if tail else 0
            object.__setattr__(self, "kv_cache_exact_sink_tokens", sinks)
        if self.max_num_batched_tokens is None:
            auto = cuda_max_num_batched_tokens(self.device.memory_bytes, self.device.name)
            object.__setattr__(self, "max_num_batched_tokens", auto)
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(
                f"unknown weight dtype {self.weight_dtype!r}; choose one of "
                f"{', '.join(WEIGHT_DTYPES)}"
            )
        if self.kv_cache_dtype not in KV_ELEMENT_BYTES:
            raise ValueError(
                f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose one of "
                f"{', '.join(KV_ELEMENT_BYTES)}"
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
        tp, m = self.tensor_parallel_size, self.model
        if tp < 1 or m.num_attention_heads % tp:
            raise ValueError(
                f"tensor_parallel_size {tp} does not divide the {m.num_attention_heads} "
                f"attention heads of {m.name}; choose a divisor of {m.num_attention_heads}"
            )
        kv = m.num_key_value_heads
        if (kv % tp) if tp <= kv else (tp % kv):
            raise ValueError(
                f"tensor_parallel_size {tp} cannot split or replicate the {kv} KV heads of "
                f"{m.name} evenly; choose a divisor or a multiple of {kv}"
            )

    @property
    def context_len(self) -> int:
        """Return the context length each session is planned for."""
        return self.max_model_len or self.model.max_position_embeddings

    @property
    def is_fp8_kv(self) -> bool:
        """Return whether KV elements are one byte."""
        return KV_ELEMENT_BYTES[self.kv_cache_dtype] == 1

    @property
    def num_kv_heads_per_device(self) -> int:
        """Return the KV heads one TP rank stores (replicated when TP exceeds them)."""
        return max(1, self.model.num_key_value_heads // self.tensor_parallel_size)


def kv_bytes_per_token(inputs: PlanInputs, num_kv_heads: int) -> int:
    """Return K+V bytes of one token over all layers for `num_kv_heads` heads."""
    m = inputs.model
    per_layer = 2 * num_kv_heads * m.head_dim * KV_ELEMENT_BYTES[inputs.kv_cache_dtype]
    if inputs.is_fp8_kv and inputs.use_kv_scales:
        per_layer += 2 * num_kv_heads * BF16_BYTES  # one bf16 scale per token per head, K and V
    return per_layer * m.num_hidden_layers


def exact_tail_bytes(inputs: PlanInputs) -> int:
    """Return one device's FP8 exact-tail stores: max_num_seqs x (N - 1 + S) residual tokens.

    A residual token costs what an FP8 token with scales does (E4M3 plus a bf16 scale per head).
    """
    if not inputs.is_fp8_kv or inputs.kv_cache_exact_tail_tokens < 1:
        return 0
    m = inputs.model
    heads = inputs.num_kv_heads_per_device
    per_token = 2 * heads * (m.head_dim + BF16_BYTES) * m.num_hidden_layers
    store = inputs.kv_cache_exact_tail_tokens - 1 + inputs.kv_cache_exact_sink_tokens
    return inputs.max_num_seqs * store * per_token


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


@dataclass(frozen=True)
class ClaimEvaluation:
    """What a claimed bf16-KV -> fp8-KV session gain needs, in the planner's numbers."""

    baseline_sessions: int
    claimed_sessions: int
    kv_factor: float  # bf16 / fp8 KV bytes per token
    weights_factor: float | None  # KV budget with these weights / with bf16 weights
    missing_factor: float  # what fp8 KV (and fp8 weights) leave unexplained
    max_context_for_claim: int  # tokens per session at which the claimed count fits
    lines: tuple[str, ...]

    def to_json_dict(self) -> dict[str, Any]:
        """Return the claim's part of the `--json` object."""
        return {
            "baseline_sessions": self.baseline_sessions,
            "claimed_sessions": self.claimed_sessions,
            "kv_factor": round(self.kv_factor, 3),
            "weights_factor": None
            if self.weights_factor is None
            else round(self.weights_factor, 3),
            "missing_factor": round(self.missing_factor, 3),
            "max_context_for_claim": self.max_context_for_claim,
            "lines": list(self.lines),
        }


def evaluate_claim(
    inputs: PlanInputs, baseline_sessions: int, claimed_sessions: int
) -> ClaimEvaluation:
    """Return what `baseline_sessions` (bf16 weights and KV) -> `claimed_sessions` needs."""
    if baseline_sessions < 1 or claimed_sessions < 1:
        raise ValueError("claimed session counts must be >= 1")
    base = plan_capacity(
        dataclasses.replace(inputs, weight_dtype="bf16", kv_cache_dtype="bfloat16")
    )
    same_weights_fp8 = plan_capacity(
        dataclasses.replace(inputs, weight_dtype="bf16", kv_cache_dtype="fp8_e4m3")
    )
    target = plan_capacity(dataclasses.replace(inputs, kv_cache_dtype="fp8_e4m3"))
    ctx, tp, w = inputs.context_len, inputs.tensor_parallel_size, inputs.weight_dtype
    claimed_factor = claimed_sessions / baseline_sessions
    kv_factor = base.kv_bytes_per_token / target.kv_bytes_per_token
    scales = "infer8's per-token scales included" if inputs.use_kv_scales else "scale-less"
    lines = [
        f"claim: {baseline_sessions} -> {claimed_sessions} sessions per replica "
        f"({claimed_factor:.2f}x), from bf16 to fp8 KV",
        f"  fp8 KV: {base.kv_bytes_per_token:,} -> {target.kv_bytes_per_token:,} bytes/token "
        f"({scales}) = {kv_factor:.2f}x at an equal KV budget: {baseline_sessions} -> "
        f"{int(baseline_sessions * kv_factor)} sessions",
    ]
    weights_factor: float | None = None
    target_budget = max(0, target.kv_budget_bytes)
    if base.kv_budget_bytes <= 0:
        lines.append(
            f"  bf16 weights at TP {tp}: {base.problems[0]}; no bf16-weight baseline of "
            f"{baseline_sessions} sessions can exist here"
        )
    elif w != "bf16":
        weights_factor = target_budget / base.kv_budget_bytes
        lines.append(
            f"  {w} weights: KV budget {base.kv_budget_bytes / GiB:.1f} -> "
            f"{target_budget / GiB:.1f} GiB per device at TP {tp} = {weights_factor:.2f}x"
        )
    else:
        fp8_w = plan_capacity(dataclasses.replace(inputs, weight_dtype="fp8"))
        lines.append(
            f"  bf16 weights kept (fp8 weights would grow the KV budget "
            f"{base.kv_budget_bytes / GiB:.1f} -> {max(0, fp8_w.kv_budget_bytes) / GiB:.1f} "
            f"GiB per device at TP {tp})"
        )
    explained = kv_factor * (weights_factor or 1.0)
    missing = claimed_factor / explained
    if missing > 1.0:
        lines += [
            f"  still missing: {claimed_factor:.2f} / {explained:.2f} = {missing:.2f}x, which "
            "needs one of:",
            f"    - reservation waste in the baseline: it reserved the full {ctx:,} tokens per "
            f"session (static batching) while paged sessions average <= "
            f"{int(ctx / missing):,} tokens (1/{missing:.2f} of the limit)",
            f"    - sessions {missing:.2f}x shorter in the claim than in the baseline",
        ]
    else:
        lines.append(f"  fp8 KV{' and weights' if weights_factor else ''} explain it")
    max_ctx = target.max_kv_tokens // claimed_sessions // inputs.block_size * inputs.block_size
    base_ctx = base.max_kv_tokens // baseline_sessions // inputs.block_size * inputs.block_size
    counts = (
        f"bf16 KV {base.max_concurrent_sessions}, fp8 KV {same_weights_fp8.max_concurrent_sessions}"
        " (bf16 weights)"
    )
    if w != "bf16":
        counts += f", fp8 KV with {w} weights {target.max_concurrent_sessions}"
    lines.append(
        f"  sessions of {ctx:,} tokens at TP {tp}: {counts}"
        + (f"; {w} weights: {target.problems[0]}" if target.problems and w != "bf16" else "")
    )
    if target.max_concurrent_sessions >= claimed_sessions:
        verdict = f"holds at {ctx:,} tokens/session ({target.max_concurrent_sessions} fit)"
    elif max_ctx == 0:
        verdict = (
            f"cannot hold: the KV cache holds {target.max_kv_tokens:,} tokens in all, less "
            f"than one block per session for {claimed_sessions} sessions"
        )
    else:
        verdict = (
            f"does not hold at {ctx:,} tokens/session; {claimed_sessions} fp8-KV sessions fit "
            f"only at <= {max_ctx:,} tokens each"
        )
        if base_ctx:
            verdict += f" ({baseline_sessions} bf16 sessions at <= {base_ctx:,})"
    lines.append(f"  verdict: {verdict}")
    return ClaimEvaluation(
        baseline_sessions=baseline_sessions,
        claimed_sessions=claimed_sessions,
        kv_factor=kv_factor,
        weights_factor=weights_factor,
        missing_factor=missing,
        max_context_for_claim=max_ctx,
        lines=tuple(lines),
    )


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    """Add the `infer8 plan` flags (engine flags named and defaulted as `infer8 serve` has them)."""
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help=f"a preset ({', '.join(MODEL_PRESETS)}) or a config.json / model directory "
        "(default: smollm2-135m)",
    )
    parser.add_argument(
        "--device",
        choices=list(DEVICE_PRESETS),
        default="h100-80gb",
        help="device preset (default: h100-80gb)",
    )
    parser.add_argument("--memory-gib", type=float, help="device memory, overriding the preset")
    parser.add_argument(
        "--bandwidth-gbps", type=float, help="peak memory bandwidth in GB/s, overriding the preset"
    )
    parser.add_argument(
        "--weight-dtype",
        nargs="+",
        choices=WEIGHT_DTYPES,
        default=["bf16"],
        help="weight storage; several values make a table (default: bf16)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        choices=list(KV_ELEMENT_BYTES),
        default=["auto"],
        help="KV cache element type; several values make a table (default: auto = bf16)",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        nargs="+",
        type=int,
        default=[1],
        help="devices per replica; several values make a table (default: 1)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length per session (default: the model's max_position_embeddings)",
    )
    parser.add_argument(
        "--kv-cache-exact-tail-tokens",
        type=int,
        default=None,
        help="FP8 KV: exact tail window; its stores (max_num_seqs x (N-1+S) FP8 residual "
        "tokens) come out of the KV budget (default: the engine's auto, "
        f"{DEFAULT_EXACT_TAIL_TOKENS} on GPUs with E4M3, 0 on A100s)",
    )
    parser.add_argument(
        "--kv-cache-exact-sink-tokens",
        type=int,
        default=None,
        help="FP8 KV with a tail: first tokens of each sequence kept at 16-bit precision "
        f"(S above; default {DEFAULT_EXACT_SINK_TOKENS} where the tail is on)",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="default: the engine's on that GPU (8192 with >= 70 GiB except A100s, else 2048)",
    )
    parser.add_argument(
        "--activation-reserve-gib",
        type=float,
        default=None,
        help="memory kept per device for activations (default: the engine's estimate from "
        "--max-num-batched-tokens and --max-num-seqs)",
    )
    parser.add_argument(
        "--kv-scales",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="count infer8's per-token FP8 KV scales (--no-kv-scales: vLLM-style, scale-less)",
    )
    parser.add_argument(
        "--claim",
        metavar="BASE:CLAIMED",
        help="evaluate a claimed bf16-KV -> fp8-KV session gain, e.g. 64:384",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def plan_inputs_from(ns: argparse.Namespace) -> list[PlanInputs]:
    """Return one PlanInputs per combination of the multi-valued flags."""
    model = load_model_shape(ns.model)
    preset = DEVICE_PRESETS[ns.device]
    device = DeviceSpec(
        name=preset.name
        if ns.memory_gib is None and ns.bandwidth_gbps is None
        else f"{preset.name} (custom)",
        memory_bytes=preset.memory_bytes if ns.memory_gib is None else int(ns.memory_gib * GiB),
        bandwidth_bytes_per_s=preset.bandwidth_bytes_per_s
        if ns.bandwidth_gbps is None
        else ns.bandwidth_gbps * 1e9,
    )
    if device.memory_bytes <= 0 or device.bandwidth_bytes_per_s <= 0:
        raise ValueError("--memory-gib and --bandwidth-gbps must be positive")
    reserve = None
    if ns.activation_reserve_gib is not None:
        reserve = int(ns.activation_reserve_gib * GiB)
    return [
        PlanInputs(
            model=model,
            device=device,
            weight_dtype=weight_dtype,
            kv_cache_dtype=kv_cache_dtype,
            gpu_memory_utilization=ns.gpu_memory_utilization,
            tensor_parallel_size=tp,
            max_model_len=ns.max_model_len,
            block_size=ns.block_size,
            max_num_seqs=ns.max_num_seqs,
            max_num_batched_tokens=ns.max_num_batched_tokens,
            activation_reserve_bytes=reserve,
            use_kv_scales=ns.kv_scales,
            kv_cache_exact_tail_tokens=ns.kv_cache_exact_tail_tokens,
            kv_cache_exact_sink_tokens=ns.kv_cache_exact_sink_tokens,
        )
        for weight_dtype in ns.weight_dtype
        for kv_cache_dtype in ns.kv_cache_dtype
        for tp in ns.tensor_parallel_size
    ]


def _parse_claim(value: str) -> tuple[int, int]:
    try:
        base, claimed = (int(v) for v in value.split(":"))
    except ValueError:
        raise ValueError(
            f"--claim takes BASE:CLAIMED session counts, e.g. 64:384; got {value!r}"
        ) from None
    return base, claimed


def _reserve_note(inputs: PlanInputs) -> str:
    if inputs.activation_reserve_bytes is not None:
        return "given by --activation-reserve-gib"
    return (
        f"engine estimate for {inputs.max_num_batched_tokens} batched tokens and "
        f"{inputs.max_num_seqs} seqs; --activation-reserve-gib overrides"
    )


def _kv_note(plan: Plan) -> str:
    i = plan.inputs
    if not i.is_fp8_kv:
        return "auto = bfloat16" if i.kv_cache_dtype == "auto" else i.kv_cache_dtype
    elements = plan.kv_bytes_per_token
    if i.use_kv_scales:
        scales = 2 * i.model.num_key_value_heads * BF16_BYTES * i.model.num_hidden_layers
        return (
            f"{i.kv_cache_dtype}: {elements - scales:,} in 1-byte elements + {scales:,} in "
            "infer8's per-token bf16 scales"
        )
    return f"{i.kv_cache_dtype}, scale-less (vLLM-style per-tensor scales)"


def format_plan(plan: Plan) -> str:
    """Return the detailed text report of one configuration."""
    i, m = plan.inputs, plan.inputs.model
    bound = plan.decode_tokens_per_s_bound
    lines = [
        f"{m.name} ({m.num_params / 1e9:.2f} B params) on {i.device.name} "
        f"({i.device.memory_bytes / GiB:.2f} GiB, {i.device.bandwidth_bytes_per_s / 1e9:.0f} "
        f"GB/s) x TP {i.tensor_parallel_size}",
        f"  weights             {i.weight_dtype}: {plan.weight_bytes_per_device / GiB:.2f} GiB "
        "per device",
        f"  usable memory       {i.gpu_memory_utilization} x {i.device.memory_bytes / GiB:.2f} GiB"
        f" = {plan.usable_bytes / GiB:.2f} GiB per device",
        f"  activation reserve  {plan.activation_reserve_bytes / GiB:.2f} GiB ({_reserve_note(i)})",
        f"  KV budget           {max(0, plan.kv_budget_bytes) / GiB:.2f} GiB per device",
        f"  KV bytes/token      {plan.kv_bytes_per_token:,} ({_kv_note(plan)}); "
        f"{plan.kv_bytes_per_token_per_device:,} per device "
        f"({i.num_kv_heads_per_device} of {m.num_key_value_heads} KV heads)",
        f"  max KV tokens       {plan.max_kv_tokens:,} (blocks of {i.block_size})",
        f"  sessions            {plan.max_concurrent_sessions:,} at {i.context_len:,} tokens each",
    ]
    tail_bytes = exact_tail_bytes(i)
    if tail_bytes:
        lines.insert(
            -2,
            f"  exact tail          {tail_bytes / GiB:.2f} GiB per device before the blocks "
            f"({i.max_num_seqs} seats x ({i.kv_cache_exact_tail_tokens} - 1 + "
            f"{i.kv_cache_exact_sink_tokens}) FP8 residual tokens)",
        )
    if bound is None:
        lines.append("  decode bound        n/a (no session fits)")
    else:
        assert plan.decode_step_s is not None
        lines.append(
            f"  decode bound        <= {bound:,.0f} tokens/s at batch {plan.decode_batch} "
            f"(step >= {plan.decode_step_s * 1e3:.1f} ms reading the weights and "
            f"{plan.decode_batch} x {i.context_len:,} tokens of KV at peak bandwidth)"
        )
    if plan.fits:
        lines.append("  fits                yes")
    else:
        lines += [f"  DOES NOT FIT: {p}" for p in plan.problems]
        tp = smallest_fitting_tp(i)
        if tp is not None:
            lines.append(f"  smallest tensor-parallel size that fits: {tp}")
        else:
            lines.append("  no tensor-parallel size up to 64 fits")
    return "\n".join(lines)


def format_table(plans: list[Plan]) -> str:
    """Return a Markdown table, one row per configuration."""
    first = plans[0].inputs
    head = (
        f"{first.model.name} on {first.device.name} "
        f"({first.device.memory_bytes / GiB:.2f} GiB, "
        f"{first.device.bandwidth_bytes_per_s / 1e9:.0f} GB/s), gpu_memory_utilization "
        f"{first.gpu_memory_utilization}, {first.context_len:,} tokens/session, "
        f"max_num_seqs {first.max_num_seqs}, max_num_batched_tokens "
        f"{first.max_num_batched_tokens}"
    )
    rows = [
        head,
        "",
        "| weights | KV | TP | weights GiB/dev | act. reserve GiB | KV budget GiB/dev "
        "| KV B/token (/dev) | max KV tokens | sessions | decode tok/s bound @ batch | fits |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in plans:
        i = p.inputs
        bound = p.decode_tokens_per_s_bound
        rows.append(
            f"| {i.weight_dtype} | {i.kv_cache_dtype} | {i.tensor_parallel_size} "
            f"| {p.weight_bytes_per_device / GiB:.2f} | {p.activation_reserve_bytes / GiB:.2f} "
            f"| {max(0, p.kv_budget_bytes) / GiB:.2f} "
            f"| {p.kv_bytes_per_token:,} ({p.kv_bytes_per_token_per_device:,}) "
            f"| {p.max_kv_tokens:,} | {p.max_concurrent_sessions:,} "
            f"| {'n/a' if bound is None else f'{bound:,.0f} @ {p.decode_batch}'} "
            f"| {'yes' if p.fits else 'NO'} |"
        )
    return "\n".join(rows)


def run_plan(ns: argparse.Namespace) -> int:
    """Print the plan (text, table or JSON); return 0 when every configuration fits, else 1."""
    all_inputs = plan_inputs_from(ns)
    plans = [plan_capacity(i) for i in all_inputs]
    claim = None
    if ns.claim is not None:
        if len(plans) != 1:
            raise ValueError("--claim evaluates one configuration; give single-valued flags")
        claim = evaluate_claim(all_inputs[0], *_parse_claim(ns.claim))
    if ns.json:
        out: dict[str, Any] = (
            plans[0].to_json_dict()
            if len(plans) == 1
            else {"plans": [p.to_json_dict() for p in plans]}
        )
        if claim is not None:
            out["claim"] = claim.to_json_dict()
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(plans[0]) if len(plans) == 1 else format_table(plans))
        if claim is not None:
            print("\n" + "\n".join(claim.lines))
        print("\nassumptions: " + ASSUMPTIONS)
    return 0 if all(p.fits for p in plans) else 1
