"""Prefix caching on vs off: chat requests sharing a long system prompt (TTFT, tok/s, hit rate).

    python benchmarks/prefix_cache.py                       # the default model, 64 requests
    python benchmarks/prefix_cache.py --request-rate 4 --json prefix_cache.json

Every request is a chat whose system prompt (cut from a shipped public-domain text to
--system-prompt-tokens tokens) is the same and whose user turn differs. Both modes replay the
same arrival schedule on a fresh engine each, in one process; any engine flag (`--model`,
`--dtype`, `--max-num-seqs`, ...) applies to both.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infer8.core.sched_output import SchedulerStats
from infer8.engine import LLMEngine
from infer8.entrypoints.args import add_engine_args, engine_args_from
from infer8.eval.kv_accuracy import load_text
from infer8.sampling_params import SamplingParams
from infer8.tokenizer import Tokenizer

QUESTIONS = [
    "Summarize the argument above in two sentences.",
    "What is the author's main complaint?",
    "List three metaphors used in the text.",
    "Who is the intended audience?",
    "Explain the passage to a ten-year-old.",
    "What would a critic of this view say?",
    "Give the text a short title.",
    "Which sentence is the most persuasive, and why?",
]


@dataclass
class ModeResult:
    """One mode's measurements."""

    enable_prefix_caching: bool
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    output_tokens_per_s: float
    elapsed_s: float
    num_output_tokens: int
    num_prefill_tokens: int  # prompt tokens computed (not reused), recomputation included
    prefix_cache_hit_rate: float


def system_prompt(tokenizer: Tokenizer, num_tokens: int) -> str:
    """Return the longest word prefix of the shipped text that encodes to <= num_tokens."""
    words = load_text("areopagitica.txt").split()
    low, high = 1, len(words)
    while low < high:  # binary search on the number of words
        mid = (low + high + 1) // 2
        if len(tokenizer.encode(" ".join(words[:mid]), add_special_tokens=False)) <= num_tokens:
            low = mid
        else:
            high = mid - 1
    return " ".join(words[:low])


def build_prompts(tokenizer: Tokenizer, num_requests: int, system_tokens: int) -> list[list[int]]:
    """Return chat prompts sharing one system prompt, each with its own user turn."""
    system = system_prompt(tokenizer, system_tokens)
    return [
        tokenizer.encode_chat(
            [
                {"role": "system", "content": system},
                {"role": "user", "content": f"(#{i}) {QUESTIONS[i % len(QUESTIONS)]}"},
            ],
            add_generation_prompt=True,
        )
        for i in range(num_requests)
    ]


def arrival_offsets_s(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Return Poisson arrival offsets (all zero for an infinite rate: one burst)."""
    if request_rate == float("inf"):
        return [0.0] * num_requests
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(num_requests):
        offsets.append(t)
        t += rng.expovariate(request_rate)
    return offsets


def run_mode(
    engine: LLMEngine, prompts: list[list[int]], offsets_s: list[float], max_tokens: int
) -> ModeResult:
    """Replay the workload on a fresh engine; return TTFT, throughput and hit rate."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    # Warm up on an unrelated prompt, then forget it so the timed run starts cold.
    engine.add_request(list(reversed(prompts[0])), SamplingParams(max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()

    stats: list[SchedulerStats] = []
    engine.stat_loggers.append(stats.append)
    start_s = time.monotonic()
    arrivals = [start_s + o for o in offsets_s]
    first_token_s: dict[str, float] = {}
    arrival_by_id: dict[str, float] = {}
    num_output_tokens = 0
    next_request = 0
    while next_request < len(prompts) or engine.has_unfinished_requests():
        now_s = time.monotonic()
        while next_request < len(prompts) and arrivals[next_request] <= now_s:
            request_id = f"bench-{next_request}"
            arrival_by_id[request_id] = arrivals[next_request]
            engine.add_request(prompts[next_request], params, request_id, arrivals[next_request])
            next_request += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[next_request] - now_s))
            continue
        for output in engine.step():
            now_s = time.monotonic()
            first_token_s.setdefault(output.request_id, now_s)
            if output.finished:
                num_output_tokens += len(output.outputs[0].token_ids)
    elapsed_s = time.monotonic() - start_s
    ttfts = sorted(first_token_s[r] - arrival_by_id[r] for r in arrival_by_id)
    queries = sum(s.num_prefix_cache_queries for s in stats)
    hits = sum(s.num_prefix_cache_hits for s in stats)
    num_decode_tokens = num_output_tokens - len(prompts)  # the first token comes with prefill
    return ModeResult(
        enable_prefix_caching=engine.cache_config.enable_prefix_caching,
        ttft_p50_s=_percentile(ttfts, 50),
        ttft_p99_s=_percentile(ttfts, 99),
        ttft_mean_s=statistics.fmean(ttfts),
        output_tokens_per_s=num_output_tokens / elapsed_s,
        elapsed_s=elapsed_s,
        num_output_tokens=num_output_tokens,
        num_prefill_tokens=sum(s.num_scheduled_tokens for s in stats) - num_decode_tokens,
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
    )


def _percentile(sorted_values: list[float], q: float) -> float:
    """Return the q-th percentile with linear interpolation."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = (len(sorted_values) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (pos - low)


def format_table(results: list[ModeResult]) -> str:
    """Return a markdown table of both modes."""
    lines = [
        "| prefix caching | TTFT p50 (s) | TTFT p99 (s) | output tok/s | prefill tokens | hit rate |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {'on' if r.enable_prefix_caching else 'off'} | {r.ttft_p50_s:.3f} | "
            f"{r.ttft_p99_s:.3f} | {r.output_tokens_per_s:.1f} | {r.num_prefill_tokens} | "
            f"{100 * r.prefix_cache_hit_rate:.1f}% |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run both modes and print (and optionally write) the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser, positional_model=False)
    parser.set_defaults(kv_cache_memory_bytes=1 << 30)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--system-prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson req/s (inf: one burst)"
    )
    parser.add_argument("--workload-seed", type=int, default=0, help="seed of the arrivals")
    parser.add_argument("--json", default=None, help="write the results as JSON here")
    ns = parser.parse_args(argv)
    base_args = engine_args_from(ns)

    offsets = arrival_offsets_s(ns.num_requests, ns.request_rate, ns.workload_seed)
    prompts: list[list[int]] = []
    results = []
    for enable in (False, True):
        engine = LLMEngine(dataclasses.replace(base_args, enable_prefix_caching=enable))
        if not prompts:
            prompts = build_prompts(engine.tokenizer, ns.num_requests, ns.system_prompt_tokens)
            print(
                f"{ns.num_requests} chat requests: {_common_prefix_len(prompts)} shared prompt "
                f"tokens (system prompt <= {ns.system_prompt_tokens}), "
                f"{statistics.fmean(map(len, prompts)):.0f} prompt tokens on average, "
                f"{ns.max_tokens} output tokens each, request rate {ns.request_rate}/s",
                flush=True,
            )
        results.append(run_mode(engine, prompts, offsets, ns.max_tokens))
        print(f"prefix caching {'on' if enable else 'off'}: done", flush=True)
        del engine
        gc.collect()
    print(format_table(results))
    off, on = results
    print(
        f"TTFT p50 {off.ttft_p50_s / max(on.ttft_p50_s, 1e-9):.1f}x lower, "
        f"output tok/s {on.output_tokens_per_s / off.output_tokens_per_s:.2f}x"
    )
    if ns.json:
        report: dict[str, Any] = {
            "workload": {
                "num_requests": ns.num_requests,
                "system_prompt_tokens": ns.system_prompt_tokens,
                "shared_prefix_tokens": _common_prefix_len(prompts),
                "mean_prompt_tokens": statistics.fmean(map(len, prompts)),
                "max_tokens": ns.max_tokens,
                "request_rate": None if ns.request_rate == float("inf") else ns.request_rate,
                "seed": ns.workload_seed,
            },
            "engine_args": {  # both modes; only enable_prefix_caching differs
                k: v
                for k, v in dataclasses.asdict(base_args).items()
                if k != "enable_prefix_caching"
            },
            "results": [dataclasses.asdict(r) for r in results],
        }
        Path(ns.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {ns.json}")
    return 0


def _common_prefix_len(prompts: list[list[int]]) -> int:
    """Return how many leading tokens all prompts share."""
    first = prompts[0]
    n = len(first)
    for p in prompts[1:]:
        n = next((i for i, (a, b) in enumerate(zip(first[:n], p)) if a != b), min(n, len(p)))
    return n


if __name__ == "__main__":
    sys.exit(main())
