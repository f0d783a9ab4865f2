"""`infer8 eval kv` and `infer8 calibrate-kv`: what an FP8 KV cache costs in accuracy, on real text."""

from __future__ import annotations

import dataclasses
import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from infer8.config import EngineArgs, KVCacheDType
from infer8.engine import LLMEngine
from infer8.eval.scoring import score_tokens
from infer8.progress import progress_bar
from infer8.quant import kv_scales
from infer8.sampling_params import SamplingParams

EVAL_TEXT = "areopagitica.txt"
CALIBRATION_TEXT = "hamlet_act1.txt"
# The memory budget at which the two caches' capacities are compared.
CAPACITY_BUDGET_BYTES = 1 << 30
# Cache size for the evaluation runs themselves when none is given (one sequence at a time).
EVAL_KV_BYTES = 256 << 20


def eval_args(args: EngineArgs, **changes: Any) -> EngineArgs:
    """Return args with a modest default cache (eval needs little; the CPU default is 4 GiB)."""
    if args.kv_cache_memory_bytes is None:
        changes.setdefault("kv_cache_memory_bytes", EVAL_KV_BYTES)
    return dataclasses.replace(args, **changes)


def load_text(name_or_path: str) -> str:
    """Return a shipped text (by file name) or a user's text file."""
    path = Path(name_or_path)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    data = resources.files("infer8.eval").joinpath("data", name_or_path)
    if not data.is_file():
        raise ValueError(f"no text file {name_or_path!r} (give a path or one of the shipped texts)")
    return data.read_text(encoding="utf-8")


def _greedy_prefix_match(
    ref: LLMEngine, test: LLMEngine, prompts: list[list[int]], max_tokens: int
) -> list[int]:
    """Return, per prompt, how many greedy tokens the two engines share before diverging."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = []
    for engine in (ref, test):
        ids = [engine.add_request(p, params) for p in prompts]
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
        outs.append([done[i] for i in ids])
    matches = []
    for a, b in zip(*outs):
        n = 0
        while n < len(a) and n < len(b) and a[n] == b[n]:
            n += 1
        matches.append(n)
    return matches


def run_kv_eval(
    args: EngineArgs,
    num_tokens: int = 2048,
    text: str = EVAL_TEXT,
    num_prompts: int = 8,
    prompt_tokens: int = 64,
    greedy_tokens: int = 32,
) -> dict[str, Any]:
    """Compare an engine with args.kv_cache_dtype against the same model with a cache in its
    compute dtype (--kv-cache-dtype float32 over bf16 compute measures the noise floor)."""
    kv_dtype = KVCacheDType.parse(args.kv_cache_dtype)
    if kv_dtype.value == "auto":
        raise ValueError(
            "eval kv compares a cache (--kv-cache-dtype fp8_e4m3, fp8_e5m2, float32, ...) with one "
            "in the compute dtype; got auto, which is the reference itself"
        )
    ref_args = eval_args(args, kv_cache_dtype="auto", kv_scale="dynamic", kv_scales_path=None)
    bar = progress_bar(total=4, desc="eval kv", unit="phase")
    ref = LLMEngine(ref_args)
    test = LLMEngine(eval_args(args))
    bar.update(1)
    tokens = ref.tokenizer.encode(load_text(text), add_special_tokens=False)
    if len(tokens) < num_tokens:
        raise ValueError(f"the text has only {len(tokens)} tokens, fewer than {num_tokens}")
    tokens = tokens[:num_tokens]
    ref_lp = score_tokens(ref, tokens)
    bar.update(1)
    test_lp = score_tokens(test, tokens)
    bar.update(1)
    target = torch.tensor(tokens[1:])
    nll_ref = -ref_lp[:-1].gather(1, target[:, None]).mean().item()
    nll = -test_lp[:-1].gather(1, target[:, None]).mean().item()
    kl = (ref_lp.exp() * (ref_lp - test_lp)).sum(-1)
    top1 = (ref_lp.argmax(-1) == test_lp.argmax(-1)).float().mean().item()
    stride = (len(tokens) - prompt_tokens) // max(1, num_prompts)
    prompts = [tokens[i * stride : i * stride + prompt_tokens] for i in range(num_prompts)]
    matches = _greedy_prefix_match(ref, test, prompts, greedy_tokens)
    bar.update(1)
    bar.close()
    ref_spec, spec = ref.kv_spec, test.kv_spec
    return {
        "model": ref.model_config.model,
        "dtype": str(ref.model_config.dtype).removeprefix("torch."),
        "text": text,
        "kv_cache_dtype": kv_dtype.value,
        "kv_scale": test.kv_scale_source,
        "ref_kv_cache_dtype": str(ref_spec.dtype).removeprefix("torch."),
        "ref_perplexity": math.exp(nll_ref),
        "perplexity": math.exp(nll),
        "perplexity_delta_rel": math.exp(nll - nll_ref) - 1.0,
        "kl_mean": kl.mean().item(),
        "kl_max": kl.max().item(),
        "top1_agreement": top1,
        "greedy_match_tokens_mean": sum(matches) / len(matches),
        "greedy_tokens": greedy_tokens,
        "greedy_full_match_fraction": sum(m == greedy_tokens for m in matches) / len(matches),
        "num_tokens_evaluated": len(tokens) - 1,
        "kv_budget_bytes": CAPACITY_BUDGET_BYTES,
        "kv_tokens_capacity_ref": CAPACITY_BUDGET_BYTES // ref_spec.bytes_per_token,
        "kv_tokens_capacity": CAPACITY_BUDGET_BYTES // spec.bytes_per_token,
        "kv_saturated_values": sum(test.kv_saturation_counts()),
    }


def format_kv_report(r: dict[str, Any]) -> str:
    """Return a short human-readable summary of run_kv_eval's result."""
    return (
        f"{r['kv_cache_dtype']} ({r['kv_scale']}) vs {r['ref_kv_cache_dtype']} cache on "
        f"{r['num_tokens_evaluated']} tokens of {r['text']}:\n"
        f"  perplexity {r['perplexity']:.3f} vs {r['ref_perplexity']:.3f} "
        f"({100 * r['perplexity_delta_rel']:+.3f}%)\n"
        f"  KL mean {r['kl_mean']:.2e}, top-1 agreement {100 * r['top1_agreement']:.2f}%\n"
        f"  greedy: {r['greedy_match_tokens_mean']:.1f} of {r['greedy_tokens']} tokens match on average\n"
        f"  capacity at 1 GiB: {r['kv_tokens_capacity']} vs {r['kv_tokens_capacity_ref']} tokens "
        f"({r['kv_tokens_capacity'] / r['kv_tokens_capacity_ref']:.2f}x)"
    )


def calibrate_kv(
    args: EngineArgs,
    out: str | Path,
    num_tokens: int = 2048,
    text: str = CALIBRATION_TEXT,
    granularity: str = "head",
    margin: float = 1.0,
) -> dict[str, Any]:
    """Run sample text through the model, record K/V amax per layer (and head), write a file."""
    engine = LLMEngine(
        eval_args(args, kv_cache_dtype="auto", kv_scale="dynamic", kv_scales_path=None)
    )
    spec = engine.kv_spec
    for cache in engine.worker.kv_caches:
        cache.k_amax = torch.zeros(spec.num_kv_heads, spec.head_dim, device=cache.k.device)
        cache.v_amax = torch.zeros(spec.num_kv_heads, spec.head_dim, device=cache.k.device)
    tokens = engine.tokenizer.encode(load_text(text), add_special_tokens=False)[:num_tokens]
    window = engine.max_model_len
    for start in progress_bar(range(0, len(tokens), window), desc="calibrate-kv"):
        score_tokens(engine, tokens[start : start + window])
    k_amax = [c.k_amax for c in engine.worker.kv_caches]  # type: ignore[misc]
    v_amax = [c.v_amax for c in engine.worker.kv_caches]  # type: ignore[misc]
    kv_scales.save_calibration(
        out, k_amax, v_amax, granularity, engine.model_config.model, len(tokens), margin
    )
    return json.loads(Path(out).read_text())
