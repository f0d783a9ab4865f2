"""`infer8 demo`'s comparison: static vs continuous batching, a 16-bit vs an FP8 KV cache.

The engines run in one process and take a step each in turn, so a drift of a shared machine
falls on all of them alike. What the headline states is counted, not timed (steps, padding,
tokens per step, KV capacity): no load can flip it. Times are kept per engine and round (the
sum of its own steps), and a timing ratio is given only with its spread over rounds, or not at
all when the machine is too busy for it to mean anything.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from infer8.attention.kv_cache import KVCacheSpec
from infer8.config import EngineArgs, KVCacheDType
from infer8.engine import LLMEngine
from infer8.logging_setup import only_warnings
from infer8.quant.fp8 import kv_dtype_name
from infer8.sampling_params import RequestOutputKind, SamplingParams

# (scheduler, kv_cache_dtype) of the three engines: the baseline first
GROUPS = (("static", "auto"), ("continuous", "auto"), ("continuous", "fp8_e4m3"))
# Rounds whose timing ratios differ by more than this factor: the machine is too busy to time.
SPREAD_LIMIT = 1.2


@dataclass
class EngineRun:
    """What one engine did in one round of the workload: its work, and the time of its steps."""

    num_steps: int = 0
    num_output_tokens: int = 0
    num_scheduled_tokens: int = 0  # real tokens computed: prompts and decodes
    num_padded_tokens: int = 0  # dummy tokens a static batch computes to stay rectangular
    time_s: float = 0.0

    @property
    def padding_pct(self) -> float:
        """Return the share of computed tokens that were padding, in percent."""
        total = self.num_padded_tokens + self.num_scheduled_tokens
        return 100.0 * self.num_padded_tokens / max(1, total)

    @property
    def tokens_per_step(self) -> float:
        """Return output tokens per engine step (the sessions that made progress, on average)."""
        return self.num_output_tokens / max(1, self.num_steps)


@dataclass(frozen=True)
class EngineGroup:
    """One engine of the comparison: its configuration, KV capacity and runs (one a round)."""

    scheduler: str
    kv_dtype: str  # as users know it: "bfloat16", "FP8 (E4M3)"
    capacity_tokens: int
    tail_bytes: int  # the FP8 exact tail's rings, taken from the same KV budget
    num_tail_rows: int
    runs: list[EngineRun]


@dataclass(frozen=True)
class Comparison:
    """The comparison's workload, each engine's results, and what the machine was doing."""

    num_seats: int
    output_lens: list[int]
    groups: list[EngineGroup]
    fp8_spec: KVCacheSpec
    load_average: float | None  # the highest 1-minute load average seen; None where unknown
    num_cpus: int
    num_threads: int  # the threads this process computes with

    @property
    def fp8_capacity_ratio(self) -> float:
        """Return the FP8 cache's tokens over a bf16 cache's in the same memory."""
        return fp8_capacity_ratio(self.fp8_spec)


def fp8_capacity_ratio(spec: KVCacheSpec) -> float:
    """Return how many times a bf16 cache's tokens an FP8 cache of `spec`'s format holds in the
    same memory: bf16's bytes per token over FP8's, scales included, of the same model.

    The exact tail's rings are left out: they cost per running request, not per token, so a
    ratio with them would move with max_num_seqs and the budget (512 MiB with 256 seats' rings
    read 1.64x where the tokens themselves give 1.94x).
    """
    fp8_bytes, bf16_bytes = bytes_per_token(spec)
    return bf16_bytes / fp8_bytes


def bytes_per_token(spec: KVCacheSpec) -> tuple[int, int]:
    """Return the K+V bytes of a token over all layers: FP8's (as `spec`) and bf16's."""
    assert spec.is_fp8, spec.dtype
    plain = dataclasses.replace(spec, exact_tail_tokens=0, exact_sink_tokens=0, hadamard=False)
    bf16 = dataclasses.replace(plain, dtype=torch.bfloat16)
    return plain.bytes_per_token, bf16.bytes_per_token


def num_seats_for(args: EngineArgs, num_requests: int) -> int:
    """Return the seats (max_num_seqs) of the comparison: a quarter of the requests, so they
    queue and a static batch's wait for its longest request shows, at most the user's limit."""
    return max(1, min(args.max_num_seqs, num_requests // 4))


def compare_engines(
    args: EngineArgs,
    questions: list[str],
    num_requests: int,
    output_lens: tuple[int, ...],
    num_rounds: int,
    load_average: Callable[[], float | None] | None = None,
    seed: int = 0,
) -> Comparison:
    """Run the same workload on the three engines of GROUPS, interleaved, num_rounds times."""
    read_load = load_average or _load_average
    num_seats = num_seats_for(args, num_requests)
    rng = random.Random(seed)
    lens = [rng.choice(output_lens) for _ in range(num_requests)]
    engines = [_quiet_engine(args, policy, kv, num_seats) for policy, kv in GROUPS]
    tokenizer = engines[0].tokenizer
    prompts = [
        tokenizer.encode_chat([{"role": "user", "content": questions[i % len(questions)]}])
        for i in range(num_requests)
    ]
    for engine in engines:  # fault the cache in now, not during the timed steps
        if engine.worker.kv_populate is not None:
            engine.worker.kv_populate.join()
    _run_round(engines, prompts[:num_seats], [2] * num_seats)  # a warm-up, not counted
    loads = [read_load()]
    runs: list[list[EngineRun]] = [[] for _ in engines]
    for i in range(num_rounds):
        for group_runs, run in zip(runs, _run_round(engines, prompts, lens)):
            group_runs.append(run)
        loads.append(read_load())
        times = ", ".join(f"{_label(p, k)} {r[-1].time_s:.2f} s" for (p, k), r in zip(GROUPS, runs))
        print(f"  round {i + 1} of {num_rounds}, each engine's steps: {times}", flush=True)
    known = [load for load in loads if load is not None]
    groups = [
        EngineGroup(
            scheduler=policy,
            kv_dtype=kv_dtype_name(engine.kv_spec.dtype),
            capacity_tokens=engine.num_blocks * engine.cache_config.block_size,
            tail_bytes=engine.kv_spec.tail_bytes(engine.num_tail_rows),
            num_tail_rows=engine.num_tail_rows,
            runs=group_runs,
        )
        for (policy, _), engine, group_runs in zip(GROUPS, engines, runs)
    ]
    return Comparison(
        num_seats=num_seats,
        output_lens=lens,
        groups=groups,
        fp8_spec=engines[2].kv_spec,
        load_average=max(known) if known else None,
        num_cpus=os.cpu_count() or 1,
        num_threads=torch.get_num_threads(),
    )


def _label(policy: str, kv: str) -> str:
    return "FP8" if KVCacheDType.parse(kv).is_fp8 else policy


def _quiet_engine(args: EngineArgs, policy: str, kv: str, num_seats: int) -> LLMEngine:
    """Build a comparison engine without its start-up lines (the chat's engine printed them)."""
    engine_args = dataclasses.replace(
        args,
        scheduler=policy,
        kv_cache_dtype=kv,
        max_num_seqs=num_seats,
        # a static batch never reuses a prefix, and every round repeats the prompts: off for all
        enable_prefix_caching=False,
    )
    with only_warnings():
        return LLMEngine(engine_args)


def _run_round(
    engines: list[LLMEngine], prompts: list[list[int]], output_lens: list[int]
) -> list[EngineRun]:
    """Give every engine the same requests, then step the engines in turn until all are done;
    each engine's time is the sum of its own steps."""
    for engine in engines:
        for prompt, num_tokens in zip(prompts, output_lens):
            params = SamplingParams(
                max_tokens=num_tokens,
                temperature=0.0,
                ignore_eos=True,
                output_kind=RequestOutputKind.DELTA,
            )
            engine.add_request(prompt, params)
    runs = [EngineRun() for _ in engines]
    while any(engine.has_unfinished_requests() for engine in engines):
        for engine, run in zip(engines, runs):
            if not engine.has_unfinished_requests():
                continue
            t0 = time.perf_counter()
            outputs = engine.step()
            run.time_s += time.perf_counter() - t0
            run.num_steps += 1
            run.num_output_tokens += sum(len(o.outputs[0].delta_token_ids) for o in outputs)
            run.num_scheduled_tokens += engine.last_stats.num_scheduled_tokens
            run.num_padded_tokens += engine.last_stats.num_padded_tokens
    return runs


def _load_average() -> float | None:
    """Return the machine's 1-minute load average; None where the platform has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def throughput_ratios(faster: list[EngineRun], base: list[EngineRun]) -> list[float]:
    """Return each round's output tokens per second of one engine over the base engine's."""
    return [
        (f.num_output_tokens / f.time_s) / (b.num_output_tokens / b.time_s)
        for f, b in zip(faster, base)
    ]


def too_busy_reason(
    ratios: dict[str, list[float]], load: float | None, num_cpus: int, num_threads: int
) -> str | None:
    """Return why the machine is too busy for timing ratios to mean anything, or None.

    Too busy: the load average exceeds both the core count and what this run alone puts there
    (its compute threads, plus one), or one comparison's rounds disagree by more than
    SPREAD_LIMIT.
    """
    reasons = []
    load_limit = max(num_cpus, num_threads + 1)
    if load is not None and load > load_limit:
        reasons.append(
            f"its load average is {load:.1f} on {num_cpus} cores, where this run alone "
            f"accounts for about {num_threads}"
        )
    apart = [
        f"{name} {min(values):.2f}x to {max(values):.2f}x"
        for name, values in ratios.items()
        if len(values) > 1 and max(values) / min(values) > SPREAD_LIMIT
    ]
    if apart:
        reasons.append(f"its rounds disagree by more than {SPREAD_LIMIT}x ({', '.join(apart)})")
    return "; ".join(reasons) or None
