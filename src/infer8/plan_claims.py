"""`infer8 plan --claim BASE:CLAIMED`: what a claimed bf16-KV -> fp8-KV session gain needs, in
the planner's own numbers (plan.py), and what FP8 KV and FP8 weights leave unexplained."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from infer8.plan import PlanInputs, plan_capacity
from infer8.plan_presets import GiB


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
