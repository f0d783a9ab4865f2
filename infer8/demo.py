"""`infer8 demo`: chat with the default model, then compare static and continuous batching."""

from __future__ import annotations

import dataclasses
import random
import time

from infer8.config import EngineArgs
from infer8.core.sched_output import SchedulerStats
from infer8.entrypoints.llm import LLM
from infer8.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Name three primary colors.",
    "Write a haiku about the sea.",
]


def _run_workload(llm: LLM, num_requests: int, seed: int) -> dict[str, float]:
    """Run requests with variable output lengths; return throughput and padding."""
    rng = random.Random(seed)
    tok = llm.get_tokenizer()
    prompts = [
        tok.encode_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        for i in range(num_requests)
    ]
    params = [
        SamplingParams(max_tokens=rng.choice([16, 32, 64, 128]), temperature=0.0, ignore_eos=True)
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


def run_demo(args: EngineArgs, num_requests: int = 16) -> int:
    """Chat with the model, then compare static/continuous batching and 16-bit/fp8 KV caches."""
    # one fixed KV budget for every group, so capacities compare at equal memory
    if args.kv_cache_memory_bytes is None:
        args = dataclasses.replace(args, kv_cache_memory_bytes=512 << 20)
    llm = LLM(**dataclasses.asdict(args))
    greedy = SamplingParams(max_tokens=48, temperature=0.0)
    print("\n== Chat (greedy) ==")
    for q, out in zip(
        QUESTIONS, llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], greedy)
    ):
        print(f"> {q}\n{out.outputs[0].text.strip()}\n")

    print(f"== {num_requests} requests, output lengths 16..128 tokens, same KV memory ==")
    groups = [("static", "auto"), ("continuous", "auto"), ("continuous", "fp8_e4m3")]
    rows = []
    for policy, kv in groups:
        group_args = dataclasses.replace(args, scheduler=policy, kv_cache_dtype=kv)
        group_llm = llm if group_args == args else LLM(**dataclasses.asdict(group_args))
        engine = group_llm.engine
        capacity = engine.num_blocks * engine.cache_config.block_size
        kv_name = str(engine.kv_spec.dtype).removeprefix("torch.")
        rows.append((policy, kv_name, capacity, _run_workload(group_llm, num_requests, seed=0)))
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
        f"continuous / static throughput: {cont / static:.2f}x; fp8 / {rows[1][1]} KV capacity: "
        f"{rows[2][2] / rows[1][2]:.2f}x at {f8 / cont:.2f}x the throughput"
    )
    print(
        f"(one short run of {num_requests} requests: the throughput ratios move by +-10% between "
        "runs on a shared machine; docs/benchmarks.md has repeated, larger runs)"
    )
    return 0
