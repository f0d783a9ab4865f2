"""Model FLOPs of served requests, and this machine's matmul peak measured in the same run."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from infer8.worker.cpu_linear import linear_matmul


@dataclass(frozen=True)
class ModelFlops:
    """FLOPs per token of a Llama-family decoder (matmuls only: norms, RoPE, SiLU ignored)."""

    # 2 x the decoder layers' matmul parameters (q/k/v/o, gate/up/down): every computed token
    layer_flops_per_token: int
    # 4 x layers x query heads x head_dim: QK^T and PV, times the context each token attends
    attn_flops_per_context_token: int
    # 2 x hidden x vocab: the LM head, only for positions that are sampled
    lm_head_flops_per_sample: int

    @classmethod
    def from_arch(cls, arch: Any) -> ModelFlops:
        """Build from a LlamaArchConfig-like object (hidden_size, num_hidden_layers, ...)."""
        h, inter = arch.hidden_size, arch.intermediate_size
        q = arch.num_attention_heads * arch.head_dim
        kv = arch.num_key_value_heads * arch.head_dim
        per_layer = h * (q + 2 * kv) + q * h + h * 2 * inter + inter * h
        return cls(
            layer_flops_per_token=2 * per_layer * arch.num_hidden_layers,
            attn_flops_per_context_token=4 * arch.num_hidden_layers * q,
            lm_head_flops_per_sample=2 * h * arch.vocab_size,
        )

    def request_flops(self, prompt_len: int, num_output_tokens: int) -> int:
        """Return the useful FLOPs of serving one request once (no padding, no recomputation).

        Positions 0 .. prompt_len + num_output_tokens - 2 go through the model (the last
        sampled token is never fed back); position p attends to p + 1 tokens; one LM-head
        row per sampled token.
        """
        if num_output_tokens < 1:
            return 0
        n = prompt_len + num_output_tokens - 1
        context_sum = n * (n + 1) // 2
        return (
            self.layer_flops_per_token * n
            + self.attn_flops_per_context_token * context_sum
            + self.lm_head_flops_per_sample * num_output_tokens
        )


def measure_matmul_peak(
    dtype: torch.dtype, device: torch.device, size: int = 2048, repeats: int = 5
) -> dict[str, Any]:
    """Time a [size x size] @ [size x size] matmul `repeats` times; return the best FLOP/s."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    torch.matmul(a, b, out=out)  # warm-up: thread pool, kernels
    best_s = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        torch.matmul(a, b, out=out)
        _sync(device)
        best_s = min(best_s, time.perf_counter() - t0)
    flops = 2 * size**3
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "size": size,
        "repeats": repeats,
        "best_s": best_s,
        "peak_flops_per_s": flops / best_s,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bucket_sizes(largest: int) -> list[int]:
    """Return 1, 2, 4, ... up to and including `largest` (the M values timed)."""
    sizes, m = [], 1
    while m < largest:
        sizes.append(m)
        m *= 2
    return [*sizes, largest]


def _time_s(fn: Any, device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _interpolate(sizes: list[int], times_s: list[float], m: int) -> float:
    """Return the time at m, linear between the timed sizes (m is within their range)."""
    if m <= 0:
        return 0.0
    for (m0, t0), (m1, t1) in zip(zip(sizes, times_s), zip(sizes[1:], times_s[1:])):
        if m <= m1:
            return t0 + (t1 - t0) * (m - m0) / (m1 - m0)
    return times_s[-1] * m / sizes[-1]


@torch.inference_mode()
def matmul_roofline(
    model: torch.nn.Module,
    step_num_tokens: list[int],
    step_num_samples: list[int],
    repeats: int = 3,
) -> dict[str, Any]:
    """Return how long a run's matmuls alone take on this machine, measured, not looked up.

    Times the model's own projections (one decoder layer's q/k/v, o, gate/up and down, times
    the layers) at M = 1, 2, 4, ... tokens up to the largest step, and its LM head at the
    sampled rows, then sums over the run's steps with linear interpolation between the timed
    sizes. Attention, norms and everything else count as zero: the run's elapsed time over
    this is the share of the machine's matmul speed the engine reached.
    """
    layer = model.layers[0]
    projections = [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
    projections += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
    num_layers = len(model.layers)
    param = model.embed_tokens.weight
    device, dtype = param.device, param.dtype

    def layer_matmuls(m: int) -> None:
        for proj in projections:
            x = torch.randn(m, proj.in_features, device=device, dtype=dtype)
            linear_matmul(proj, x)

    def head(m: int) -> None:
        x = torch.randn(m, model.config.hidden_size, device=device, dtype=dtype)
        linear_matmul(model.lm_head, x)

    token_sizes = _bucket_sizes(max(step_num_tokens, default=1))
    layer_s = [
        num_layers * _time_s(lambda m=m: layer_matmuls(m), device, repeats) for m in token_sizes
    ]
    sample_sizes = _bucket_sizes(max(step_num_samples, default=1))
    head_s = [_time_s(lambda m=m: head(m), device, repeats) for m in sample_sizes]
    total_s = sum(
        _interpolate(token_sizes, layer_s, n) + _interpolate(sample_sizes, head_s, s)
        for n, s in zip(step_num_tokens, step_num_samples)
    )
    return {"matmul_only_s": total_s, "timed_token_sizes": token_sizes, "layer_s": layer_s}
