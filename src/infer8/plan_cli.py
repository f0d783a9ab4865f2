"""`infer8 plan`'s command line: its flags (named and defaulted as `infer8 serve` has them), the
configurations they expand to, and the plan printed as text, a table or JSON."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from infer8.attention.tail_defaults import DEFAULT_EXACT_SINK_TOKENS, DEFAULT_EXACT_TAIL_TOKENS
from infer8.config import KVCacheDType
from infer8.entrypoints.arg_parser import did_you_mean
from infer8.plan_presets import (
    BF16_BYTES,
    DEVICE_PRESETS,
    MODEL_PRESETS,
    WEIGHT_DTYPES,
    DeviceSpec,
    GiB,
    device_preset_name,
    load_model_shape,
)

if TYPE_CHECKING:
    from infer8.plan import Plan, PlanInputs


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    """Add the `infer8 plan` flags (engine flags named and defaulted as `infer8 serve` has them)."""
    parser.add_argument(
        "model_tag", nargs="?", metavar="MODEL", help="the model, as `infer8 serve MODEL` takes it"
    )
    parser.add_argument(
        "--model",
        default=None,
        help=f"a preset ({', '.join(MODEL_PRESETS)}; also as a Hugging Face id or plain name, "
        "e.g. Qwen/Qwen2-72B-Instruct, qwen2-72b) or a config.json / model directory "
        "(default: smollm2-135m)",
    )
    parser.add_argument(
        "--device",
        type=_device_name,
        default="h100-80gb",
        metavar="{" + ",".join(DEVICE_PRESETS) + "}",
        help="device preset, in any case, with or without its memory: H100, h200-141gb "
        "(default: h100-80gb)",
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
        choices=KVCacheDType.choices(),
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


def _device_name(value: str) -> str:
    """Return the device preset `value` names (argparse type; the error names the closest)."""
    preset = device_preset_name(value)
    if preset is None:
        names = list(DEVICE_PRESETS)
        hint = did_you_mean(value.lower(), [*names, *(n.split("-", 1)[0] for n in names)])
        raise argparse.ArgumentTypeError(
            f"unknown device {value!r}{hint}; choose from {', '.join(names)}"
        )
    return preset


def plan_inputs_from(ns: argparse.Namespace) -> list[PlanInputs]:
    """Return one PlanInputs per combination of the multi-valued flags."""
    from infer8.plan import PlanInputs  # torch: not for `--help`

    if ns.model_tag and ns.model and ns.model_tag != ns.model:
        raise ValueError(f"two models given: {ns.model_tag!r} and --model {ns.model!r}")
    model = load_model_shape(ns.model_tag or ns.model or "smollm2-135m")
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
    from infer8.plan import exact_tail_bytes, ways_to_fit

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
        ways = ways_to_fit(i)
        if ways:
            lines.append(f"  ways to fit ({i.context_len:,} tokens a session):")
            lines += [f"    {describe_way(i, way)}" for way in ways]
        else:
            lines.append("  nothing fits: neither FP8 weights nor a tensor-parallel size up to 64")
    return "\n".join(lines)


def describe_way(inputs: PlanInputs, way: Plan) -> str:
    """Return one way to fit as the flags it changes and the sessions it gives."""
    changes = []
    if way.inputs.weight_dtype != inputs.weight_dtype:
        changes.append(f"{way.inputs.weight_dtype.upper()} weights (--quantization fp8)")
    if way.inputs.tensor_parallel_size != inputs.tensor_parallel_size:
        changes.append(f"--tensor-parallel-size {way.inputs.tensor_parallel_size}")
    return f"{' + '.join(changes)}: {way.max_concurrent_sessions:,} sessions"


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
    from infer8.plan import ASSUMPTIONS, plan_capacity, ways_to_fit
    from infer8.plan_claims import evaluate_claim

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
        if len(plans) == 1 and not plans[0].fits:
            out["ways_to_fit"] = [
                {
                    "weight_dtype": way.inputs.weight_dtype,
                    "tensor_parallel_size": way.inputs.tensor_parallel_size,
                    "sessions": way.max_concurrent_sessions,
                }
                for way in ways_to_fit(all_inputs[0])
            ]
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(plans[0]) if len(plans) == 1 else format_table(plans))
        if claim is not None:
            print("\n" + "\n".join(claim.lines))
        print("\nassumptions: " + ASSUMPTIONS)
    return 0 if all(p.fits for p in plans) else 1
