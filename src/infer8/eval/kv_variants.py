"""`infer8 eval kv --variants`: per-variant rows (E4M3 before, + tail, + sinks, + Hadamard, E5M2).

For each compute dtype and text, every variant's teacher-forced log-probabilities are compared
with the same model's 16/32-bit cache (kv_cache_dtype auto); greedy agreement runs a fixed set
of chat prompts together in one dtype (float32 by default: bf16 greedy outputs change with the
batch composition alone, which the noise row measures).
"""

from __future__ import annotations

import dataclasses
import gc
import math
from typing import Any

import torch

from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.eval.kv_accuracy import eval_args, load_text
from infer8.eval.scoring import score_tokens
from infer8.sampling_params import SamplingParams

# None leaves a flag on auto (the measured defaults of attention/exact_tail.py).
_E4M3 = dict(kv_cache_dtype="fp8_e4m3")
VARIANTS: dict[str, dict[str, Any]] = {
    "e4m3, no tail, no rotation (before)": _E4M3
    | dict(kv_cache_exact_tail_tokens=0, kv_cache_hadamard=False),
    "e4m3 + tail": _E4M3
    | dict(kv_cache_exact_tail_tokens=None, kv_cache_exact_sink_tokens=0, kv_cache_hadamard=False),
    "e4m3 + tail + sinks": _E4M3 | dict(kv_cache_exact_tail_tokens=None, kv_cache_hadamard=False),
    "e4m3 + Hadamard": _E4M3 | dict(kv_cache_exact_tail_tokens=0, kv_cache_hadamard=True),
    "e4m3 + tail + Hadamard": _E4M3
    | dict(kv_cache_exact_tail_tokens=None, kv_cache_exact_sink_tokens=0, kv_cache_hadamard=None),
    "e4m3 default (tail + sinks + Hadamard)": _E4M3
    | dict(kv_cache_exact_tail_tokens=None, kv_cache_hadamard=None),
    "e5m2 default (tail + sinks + Hadamard)": dict(
        kv_cache_dtype="fp8_e5m2", kv_cache_exact_tail_tokens=None, kv_cache_hadamard=None
    ),
}
TEXTS = ("areopagitica.txt", "hamlet_act1.txt")
CHAT_PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Explain what a hash table is to a beginner.",
    "List three tips for staying focused while studying.",
    "What causes the seasons on Earth?",
    "Write a Python function that reverses a string.",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
)
# Eval runs one sequence (or the chat prompts) at a time: few seats, so the tail's rings are small.
_EVAL_SEQS = 16


def _engine(args: EngineArgs, **changes: Any) -> LLMEngine:
    return LLMEngine(eval_args(args, max_num_seqs=_EVAL_SEQS, **changes))


def _compare(ref_lp: torch.Tensor, lp: torch.Tensor, tokens: list[int]) -> dict[str, float]:
    target = torch.tensor(tokens[1:])[:, None]
    nll_ref = -ref_lp[:-1].gather(1, target).mean().item()
    nll = -lp[:-1].gather(1, target).mean().item()
    return {
        "ref_perplexity": math.exp(nll_ref),
        "perplexity": math.exp(nll),
        "perplexity_delta_rel": math.exp(nll - nll_ref) - 1.0,
        "kl_mean": (ref_lp.exp() * (ref_lp - lp)).sum(-1).mean().item(),
        "top1_agreement": (ref_lp.argmax(-1) == lp.argmax(-1)).float().mean().item(),
    }


def _greedy(engine: LLMEngine, prompts: list[list[int]], n: int, together: bool) -> list[list[int]]:
    """Return each prompt's n greedy tokens, run as one batch or one by one."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {}
    groups = [prompts] if together else [[p] for p in prompts]
    ids: list[str] = []
    for group in groups:
        ids += [engine.add_request(p, params) for p in group]
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = o.outputs[0].token_ids
    return [out[i] for i in ids]


def greedy_agreement(ref: list[list[int]], test: list[list[int]]) -> dict[str, float]:
    """Return mean tokens before the first difference and mean identical positions."""
    before, same = [], []
    for a, b in zip(ref, test):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        before.append(n)
        same.append(sum(x == y for x, y in zip(a, b)))
    return {
        "greedy_tokens_before_first_difference": sum(before) / len(before),
        "greedy_identical_tokens": sum(same) / len(same),
        "greedy_identical_prompts": sum(n == len(a) for n, a in zip(before, ref)) / len(ref),
    }


def run_kv_variants(
    args: EngineArgs,
    num_tokens: int = 2048,
    texts: tuple[str, ...] = TEXTS,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    variants: tuple[str, ...] = tuple(VARIANTS),
    greedy_tokens: int = 96,
    greedy_dtype: str | None = "float32",
) -> dict[str, Any]:
    """Score every variant on every text in every dtype; greedy agreement in greedy_dtype."""
    rows: list[dict[str, Any]] = []
    greedy: list[dict[str, Any]] = []
    for dtype in dtypes:
        ref = _engine(args, dtype=dtype, kv_cache_dtype="auto", kv_scale="dynamic")
        token_lists = {
            t: ref.tokenizer.encode(load_text(t), add_special_tokens=False)[:num_tokens]
            for t in texts
        }
        ref_lps = {t: score_tokens(ref, toks) for t, toks in token_lists.items()}
        chats: list[list[int]] = []
        ref_together: list[list[int]] = []
        if dtype == greedy_dtype:
            chats = [
                ref.tokenizer.encode_chat(
                    [{"role": "user", "content": c}], add_generation_prompt=True
                )
                for c in CHAT_PROMPTS
            ]
            ref_together = _greedy(ref, chats, greedy_tokens, together=True)
            one_by_one = _greedy(ref, chats, greedy_tokens, together=False)
            greedy.append(
                {"variant": "reference cache: one by one vs together (noise)", "dtype": dtype}
                | greedy_agreement(ref_together, one_by_one)
            )
        del ref
        gc.collect()
        for name in variants:
            engine = _engine(args, dtype=dtype, **VARIANTS[name])
            spec = engine.kv_spec
            for text, toks in token_lists.items():
                lp = score_tokens(engine, toks)
                rows.append(
                    {
                        "variant": name,
                        "dtype": dtype,
                        "text": text,
                        "exact_tail_tokens": spec.exact_tail_tokens,
                        "exact_sink_tokens": spec.exact_sink_tokens,
                        "hadamard": spec.hadamard,
                        "num_tokens_evaluated": len(toks) - 1,
                    }
                    | _compare(ref_lps[text], lp, toks)
                )
                print(format_row(rows[-1]), flush=True)
            if chats:
                test = _greedy(engine, chats, greedy_tokens, together=True)
                greedy.append(
                    {"variant": name, "dtype": dtype} | greedy_agreement(ref_together, test)
                )
            del engine
            gc.collect()
    return {
        "model": args.model or "default (SmolLM2-135M-Instruct)",
        "num_tokens": num_tokens,
        "greedy_tokens": greedy_tokens,
        "num_chat_prompts": len(CHAT_PROMPTS),
        "rows": rows,
        "greedy": greedy,
        "args": {k: v for k, v in dataclasses.asdict(args).items() if v is not None},
    }


def format_row(r: dict[str, Any]) -> str:
    """Return one markdown table row of a variant's scores."""
    return (
        f"| {r['variant']} | {r['dtype']} | {r['text']} | {r['exact_tail_tokens']} | "
        f"{r['exact_sink_tokens']} | "
        f"{'yes' if r['hadamard'] else 'no'} | {100 * r['top1_agreement']:.2f}% | "
        f"{r['kl_mean']:.2e} | {100 * r['perplexity_delta_rel']:+.3f}% |"
    )


def format_variants(r: dict[str, Any]) -> str:
    """Return the markdown tables of run_kv_variants' result."""
    head = (
        "| variant | dtype | text | tail | sinks | Hadamard | top-1 agreement | KL | perplexity |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head, *(format_row(row) for row in r["rows"])]
    if r["greedy"]:
        lines += [
            "",
            f"Greedy, {r['num_chat_prompts']} chat prompts x {r['greedy_tokens']} tokens, vs the "
            "reference cache's outputs with the prompts run together:",
            "",
            "| variant | dtype | tokens before first difference | identical tokens | "
            "identical prompts |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {g['variant']} | {g['dtype']} | {g['greedy_tokens_before_first_difference']:.1f} "
            f"| {g['greedy_identical_tokens']:.1f} | {100 * g['greedy_identical_prompts']:.0f}% |"
            for g in r["greedy"]
        ]
    return "\n".join(lines)
