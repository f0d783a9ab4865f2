"""`infer8 bench spec-decode`: speculative decoding against none, in one run.

Two workloads per method, each engine built in turn in this process:
- input-grounded requests at concurrency 1 (one at a time): chat prompts that ask the model to
  rewrite, annotate or fix a given code block or paragraph, and a multi-turn chat whose answer
  repeats an earlier one (the output copies much of the prompt); time per output token (TPOT),
  the drafts' acceptance rate and mean accepted length;
- W1 (random prompts, nothing to copy) at concurrency 32: output tokens per second.
Greedy throughout, so every method must give the same tokens (checked and reported).
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from importlib import resources
from typing import Any

from infer8.bench.report import markdown_table
from infer8.bench.throughput import bench_engine_args, run_workload, warm_up
from infer8.bench.workload import BenchRequest, LengthSpec, make_requests
from infer8.config import EngineArgs
from infer8.core.sched_output import SchedulerStats
from infer8.engine import LLMEngine
from infer8.progress import progress_bar
from infer8.sampling_params import SamplingParams

# what `--methods` names, and the --speculative-config each runs with
METHODS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": 5,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    },
    "suffix": {"method": "suffix"},  # vLLM's defaults (up to 24 drafts)
}

_CODE_TASKS = (
    "Rewrite this Python function with clearer variable names. Give the whole function.",
    "Add a comment above each line of this Python function. Give the whole function.",
    "Fix any bug in this Python function and return the corrected function in full.",
)
_TEXT_TASKS = (
    "Copy this paragraph, correcting its spelling to modern English:",
    "Repeat this paragraph, then summarise it in one sentence:",
)


def _code_blocks(num: int) -> list[str]:
    """Return `num` functions (prompt and solution) from the shipped HumanEval excerpt."""
    text = resources.files("infer8.eval").joinpath("data", "humaneval_solutions.py.txt")
    blocks = [b.strip() for b in text.read_text(encoding="utf-8").split("\n\n\n") if "def " in b]
    return [b for b in blocks if 200 <= len(b) <= 1200][:num]


def _paragraphs(num: int) -> list[str]:
    """Return `num` paragraphs of 300-900 characters from Areopagitica."""
    text = resources.files("infer8.eval").joinpath("data", "areopagitica.txt")
    paras = [" ".join(p.split()) for p in text.read_text(encoding="utf-8").split("\n\n")]
    return [p for p in paras if 300 <= len(p) <= 900][:num]


def grounded_conversations(num: int) -> list[list[dict[str, str]]]:
    """Return `num` chat conversations whose answers copy much of what they were given."""
    convs: list[list[dict[str, str]]] = []
    code, paras = _code_blocks(num), _paragraphs(num)
    for i in range(num):
        kind = i % 3
        if kind == 0 and code:
            block = code[i % len(code)]
            task = _CODE_TASKS[(i // 3) % len(_CODE_TASKS)]
            convs.append([{"role": "user", "content": f"{task}\n\n```python\n{block}\n```"}])
        elif kind == 1 and paras:
            para = paras[i % len(paras)]
            task = _TEXT_TASKS[(i // 3) % len(_TEXT_TASKS)]
            convs.append([{"role": "user", "content": f"{task}\n\n{para}"}])
        else:  # a multi-turn chat: the answer repeats an earlier one with a change
            block = code[i % len(code)] if code else paras[i % len(paras)]
            convs.append([
                {"role": "user", "content": "Write a Python function for this task."},
                {"role": "assistant", "content": f"```python\n{block}\n```"},
                {"role": "user", "content": "Show the same function again, with a docstring "
                 "example added."},
            ])  # fmt: skip
    return convs


def grounded_requests(tokenizer: Any, num: int, max_tokens: int) -> list[BenchRequest]:
    """Return the grounded chats as completion requests: the chat template's text (so any
    server tokenizes it as a completion) and its token ids."""
    out = []
    for conv in grounded_conversations(num):
        text = tokenizer.apply_chat_template(conv)
        out.append(BenchRequest(tokenizer.encode(text, add_special_tokens=False), text, max_tokens))
    return out


def _spec_totals(stats: list[SchedulerStats]) -> dict[str, float]:
    """Return the drafts, draft tokens and accepted tokens in these steps, and their rates."""
    drafts = sum(s.spec_decode.num_drafts for s in stats if s.spec_decode)
    tokens = sum(s.spec_decode.num_draft_tokens for s in stats if s.spec_decode)
    accepted = sum(s.spec_decode.num_accepted_tokens for s in stats if s.spec_decode)
    return {
        "num_drafts": drafts,
        "num_draft_tokens": tokens,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / tokens if tokens else 0.0,
        # vLLM's: tokens a drafting request gets per step, the sampled one included
        "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
    }


def _run_grounded(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, use_tqdm: bool, desc: str
) -> dict[str, Any]:
    """Serve the prompts one at a time; return TPOT per request, outputs and spec counters."""
    stats: list[SchedulerStats] = []
    engine.stat_loggers.append(stats.append)
    tpots, outputs = [], []
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    bar = progress_bar(total=len(prompts), desc=desc, disable=not use_tqdm, unit="req")
    try:
        for prompt in prompts:
            engine.add_request(prompt, params)
            first_s = last_s = None
            tokens: list[int] = []
            while engine.has_unfinished_requests():
                for out in engine.step():
                    now = time.perf_counter()
                    if out.outputs[0].delta_token_ids or out.outputs[0].token_ids:
                        first_s = now if first_s is None else first_s
                        last_s = now
                    tokens = list(out.outputs[0].token_ids)
            outputs.append(tokens)
            if len(tokens) >= 2 and first_s is not None and last_s is not None:
                tpots.append((last_s - first_s) / (len(tokens) - 1))
            bar.update(1)
    finally:
        bar.close()
        engine.stat_loggers.remove(stats.append)
    return {
        "tpot_ms_mean": 1e3 * statistics.fmean(tpots) if tpots else None,
        "num_output_tokens": sum(len(t) for t in outputs),
        "outputs": outputs,
        **_spec_totals(stats),
    }


def _run_method(
    args: EngineArgs, method: str, num_prompts: int, max_tokens: int, w1_requests: int,
    use_tqdm: bool,
) -> dict[str, Any]:  # fmt: skip
    """Build one method's engine and run both workloads on it (in a process of its own)."""
    spec = METHODS[method]
    engine = LLMEngine(
        bench_engine_args(args, speculative_config=None if spec is None else json.dumps(spec))
    )
    tokenizer = engine.tokenizer
    prompts = [tokenizer.encode_chat(c) for c in grounded_conversations(num_prompts)]
    room = engine.max_model_len - max_tokens
    if any(len(p) > room for p in prompts):
        raise ValueError(
            f"the grounded prompts need max_model_len >= {max(map(len, prompts)) + max_tokens} "
            f"for {max_tokens} output tokens; this engine's is {engine.max_model_len}"
        )
    w1 = make_requests(
        tokenizer, w1_requests, LengthSpec.parse("128"), LengthSpec.parse("128"),
        seed=args.seed, vocab_size=engine.vocab_size,
    ) if w1_requests else []  # fmt: skip
    warm_up(engine, w1 or [BenchRequest(p, "", max_tokens) for p in prompts])
    grounded = _run_grounded(engine, prompts, max_tokens, use_tqdm, f"{method}: grounded")
    w1_stats: list[SchedulerStats] = []
    w1_tok_s = None
    if w1:
        engine.stat_loggers.append(w1_stats.append)
        w1_result = run_workload(engine, w1, desc=f"{method}: W1 x{len(w1)}", use_tqdm=use_tqdm)
        w1_tok_s = w1_result["output_tokens_per_s"]
    return {
        "method": method,
        "speculative_config": spec,
        "grounded": grounded,
        "w1_output_tok_s": w1_tok_s,
        "w1_spec": _spec_totals(w1_stats),
    }


def run_spec_decode_bench(
    args: EngineArgs,
    methods: tuple[str, ...] = ("none", "ngram", "suffix"),
    num_prompts: int = 12,
    max_tokens: int = 128,
    w1_requests: int = 32,
    use_tqdm: bool = True,
) -> dict[str, Any]:
    """Run each method's engine over both workloads; return rows and the ratios to the first.

    Each engine runs in a fresh process, one after the other: an engine left in this process
    would keep its memory and its idle threads while the next one is timed.
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {sorted(METHODS)}")
    rows: list[dict[str, Any]] = []
    spawn = multiprocessing.get_context("spawn")
    for method in methods:
        with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
            job = (args, method, num_prompts, max_tokens, w1_requests, use_tqdm)
            rows.append(pool.submit(_run_method, *job).result())
    base = rows[0]
    for row in rows:
        g, bg = row["grounded"], base["grounded"]
        row["grounded_speedup"] = (
            bg["tpot_ms_mean"] / g["tpot_ms_mean"] if g["tpot_ms_mean"] else None
        )
        row["w1_ratio"] = row["w1_output_tok_s"] / base["w1_output_tok_s"] if w1_requests else None
        row["same_outputs"] = g["outputs"] == bg["outputs"]
        row["num_same_outputs"] = sum(a == b for a, b in zip(g["outputs"], bg["outputs"]))
    return {"rows": rows, "num_prompts": num_prompts, "max_tokens": max_tokens,
            "w1_requests": w1_requests, "dtype": args.dtype}  # fmt: skip


def format_spec_decode(result: dict[str, Any]) -> str:
    """Return the markdown table of a run."""
    table = [
        [
            r["method"],
            f"{r['grounded']['tpot_ms_mean']:.1f}",
            f"{r['grounded_speedup']:.2f}x",
            f"{r['grounded']['acceptance_rate']:.2f}" if r["method"] != "none" else "-",
            f"{r['grounded']['mean_accepted_length']:.2f}" if r["method"] != "none" else "-",
            f"{r['num_same_outputs']}/{result['num_prompts']}",
            "-" if r["w1_ratio"] is None else f"{r['w1_output_tok_s']:.0f}",
            "-" if r["w1_ratio"] is None else f"{r['w1_ratio']:.2f}x",
        ]
        for r in result["rows"]
    ]
    header = ["method", "grounded TPOT ms (c=1)", "speedup", "acceptance", "mean accepted len",
              "same tokens", f"W1 tok/s (c={result['w1_requests']})", "W1 ratio"]  # fmt: skip
    return markdown_table(header, table)
