"""`infer8 demo`: chat with the default model, then compare static and continuous batching."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import random
import time

import torch

from infer8.config import EngineArgs
from infer8.core.sched_output import SchedulerStats
from infer8.entrypoints.llm import LLM
from infer8.quant.fp8 import kv_dtype_name
from infer8.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Name three primary colors.",
    "Write a haiku about the sea.",
]


def _run_workload(
    llm: LLM, num_requests: int, seed: int, output_lens: tuple[int, ...]
) -> dict[str, float]:
    """Run requests with variable output lengths; return throughput and padding."""
    rng = random.Random(seed)
    tok = llm.get_tokenizer()
    prompts = [
        tok.encode_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        for i in range(num_requests)
    ]
    params = [
        SamplingParams(max_tokens=rng.choice(output_lens), temperature=0.0, ignore_eos=True)
        for _ in range(num_requests)
    ]
    stats: list[SchedulerStats] = []
    llm.engine.stat_loggers.append(stats.append)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    llm.engine.stat_loggers.remove(stats.append)
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    padded = sum(s.num_padded_tokens for s in stats)
    real = sum(s.num_scheduled_tokens for s in stats)
    return {
        "output_tokens_per_s": num_out / elapsed,
        "padding_waste_pct": 100.0 * padded / max(1, padded + real),
        "elapsed_s": elapsed,
        "steps": len(stats),
    }


def run_demo(
    args: EngineArgs,
    num_requests: int = 16,
    output_lens: tuple[int, ...] = (16, 32, 64, 128),
    chat_max_tokens: int = 48,
) -> int:
    """Chat with the model, then compare static/continuous batching and 16-bit/fp8 KV caches."""
    # one fixed KV budget for every group, so capacities compare at equal memory
    if args.kv_cache_memory_bytes is None:
        args = dataclasses.replace(args, kv_cache_memory_bytes=512 << 20)
    llm = LLM(**dataclasses.asdict(args))
    greedy = SamplingParams(max_tokens=chat_max_tokens, temperature=0.0)
    print(f"\n== Chat (greedy: temperature 0, {_over_defaults(llm)}) ==")
    for q, out in zip(
        QUESTIONS, llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], greedy)
    ):
        print(f"> {q}\n{out.outputs[0].text.strip()}\n")

    lens = f"{min(output_lens)}..{max(output_lens)}"
    print(f"== {num_requests} requests, output lengths {lens} tokens, same KV memory ==")
    groups = [("static", "auto"), ("continuous", "auto"), ("continuous", "fp8_e4m3")]
    rows = []
    for policy, kv in groups:
        group_args = dataclasses.replace(args, scheduler=policy, kv_cache_dtype=kv)
        group_llm = llm if group_args == args else _quiet_llm(group_args)
        engine = group_llm.engine
        capacity = engine.num_blocks * engine.cache_config.block_size
        kv_name = kv_dtype_name(engine.kv_spec.dtype)
        rows.append(
            (policy, kv_name, capacity, _run_workload(group_llm, num_requests, 0, output_lens))
        )
    print(
        f"{'scheduler':<12}{'kv dtype':<15}{'KV tokens':>10}{'output tok/s':>14}{'padding %':>11}"
    )
    for policy, kv, capacity, r in rows:
        print(
            f"{policy:<12}{kv:<15}{capacity:>10}{r['output_tokens_per_s']:>14.1f}"
            f"{r['padding_waste_pct']:>11.1f}"
        )
    static, cont, f8 = (r[3]["output_tokens_per_s"] for r in rows)
    print(
        f"continuous / static throughput: {cont / static:.2f}x; "
        f"{_capacity_ratio(llm, rows[2][2], rows[1][1], rows[1][2])} "
        f"at {f8 / cont:.2f}x the throughput"
    )
    print(
        f"(one short run of {num_requests} requests: the throughput ratios move by +-10% between "
        "runs on a shared machine; docs/benchmarks.md has repeated, larger runs)"
    )
    return 0


def _quiet_llm(args: EngineArgs) -> LLM:
    """Build another engine without its start-up lines (the first engine printed them once)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return LLM(**dataclasses.asdict(args))


def _over_defaults(llm: LLM) -> str:
    """Return what the demo's greedy sampling replaces: the model's defaults, or none."""
    defaults = llm.engine.default_sampling
    if not defaults:
        return "the API's default"
    listed = ", ".join(f"{k} {v}" for k, v in defaults.items())
    return f"set by the demo over the model's defaults ({listed})"


def _capacity_ratio(llm: LLM, fp8_tokens: int, base_dtype: str, base_tokens: int) -> str:
    """Return the FP8 cache's capacity against a bf16 cache of the same memory (the README's
    baseline), and against this run's own 16-bit or 32-bit cache when that is not bf16."""
    engine = llm.engine
    memory_bytes = engine.num_blocks * engine.kv_spec.bytes_per_block
    bf16_spec = dataclasses.replace(
        engine.kv_spec, dtype=torch.bfloat16, exact_tail_tokens=0, exact_sink_tokens=0
    )
    bf16_tokens = bf16_spec.num_blocks_for(memory_bytes) * engine.cache_config.block_size
    ratio = f"fp8 KV capacity: {fp8_tokens / bf16_tokens:.2f}x a bfloat16 cache's"
    if base_dtype != "bfloat16":
        ratio += f" ({fp8_tokens / base_tokens:.2f}x this run's {base_dtype} cache's)"
    return ratio
