"""`infer8 bench throughput`: offline requests through LLMEngine, timed per token and per step."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from infer8.bench.flops import ModelFlops, measure_matmul_peak
from infer8.bench.report import fmt, markdown_table, summarize
from infer8.bench.workload import BenchRequest, LengthSpec, make_requests, workload_summary
from infer8.config import EngineArgs
from infer8.core.sched_output import SchedulerStats
from infer8.engine import LLMEngine
from infer8.lora.config import LoRARequest
from infer8.progress import progress_bar
from infer8.sampling_params import SamplingParams


@dataclass
class RequestTiming:
    """When one request's tokens arrived, relative to the moment all requests were queued."""

    prompt_len: int
    num_output_tokens: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    finish_s: float | None = None
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        """Return the mean time per output token after the first (None with < 2 tokens)."""
        if self.num_output_tokens < 2 or self.first_token_s is None or self.finish_s is None:
            return None
        return (self.finish_s - self.first_token_s) / (self.num_output_tokens - 1)


def bench_engine_args(args: EngineArgs, **changes: Any) -> EngineArgs:
    """Return args with changes applied, skipping options this engine version does not have.

    A static-scheduler group runs first come, first served whatever --scheduling-policy says
    (the baseline has no other policy).
    """
    if changes.get("scheduler") == "static":
        changes = {**changes, "scheduling_policy": "fcfs"}
    known = set(EngineArgs.field_names())
    return dataclasses.replace(args, **{k: v for k, v in changes.items() if k in known})


def warm_up(engine: LLMEngine, requests: list[BenchRequest]) -> None:
    """Run the workload's largest step shapes once, untimed: one full prefill step, then decode
    at the full batch, so one-time costs (compilation, thread pools, first-touch allocations at
    the largest sizes) fall outside the timed run. The warm-up's blocks carry their own cache
    salt, so the timed run gets no prefix-cache hit from them.
    """
    config = engine.scheduler_config
    count = max(1, min(config.max_num_seqs, len(requests), config.max_num_batched_tokens))
    prompt_len = max(1, config.max_num_batched_tokens // count)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for r in requests[:count]:
        engine.add_request(r.prompt_token_ids[:prompt_len], params, cache_salt="warm-up")
    while engine.has_unfinished_requests():
        engine.step()


def run_workload(
    engine: LLMEngine,
    requests: list[BenchRequest],
    ignore_eos: bool = True,
    max_tokens: int | None = None,
    desc: str = "requests",
    use_tqdm: bool = True,
    lora_requests: list[LoRARequest | None] | None = None,
) -> dict[str, Any]:
    """Queue every request at once, step until all finish; return throughput, latency, steps.

    Each request generates its `output_len` tokens. With `max_tokens`, requests are sent with
    that larger cap and stopped after `output_len` tokens, as an end-of-sequence token would
    stop them: the engine cannot know the length in advance (static batching reserves the cap
    and keeps the seat; continuous batching frees the blocks at once).
    Per-request times are stamped when a step returns a request's tokens; TTFT includes the
    time a request waited to be admitted, as a user of a loaded server would see it.
    `lora_requests`: each request's LoRA adapter (None: the base model).
    """
    longest = max(r.output_len for r in requests)
    if max_tokens is not None and max_tokens < longest:
        raise ValueError(f"max_tokens {max_tokens} is below the longest output ({longest})")
    params = [
        SamplingParams(
            max_tokens=max_tokens or r.output_len, temperature=0.0, ignore_eos=ignore_eos
        )
        for r in requests
    ]
    targets: dict[str, int] = {}
    stats: list[SchedulerStats] = []
    engine.stat_loggers.append(stats.append)
    timings: dict[str, RequestTiming] = {}
    step_times_s: list[float] = []
    step_num_samples: list[int] = []  # rows that got a token each step (the LM head's rows)
    bar = progress_bar(total=len(requests), desc=desc, disable=not use_tqdm, unit="req")
    try:
        t0 = time.perf_counter()
        for i, (r, p) in enumerate(zip(requests, params)):
            lora = None if lora_requests is None else lora_requests[i]
            req_id = engine.add_request(r.prompt_token_ids, p, lora_request=lora)
            timings[req_id] = RequestTiming(r.prompt_len)
            targets[req_id] = r.output_len
        num_done = 0
        while num_done < len(requests):
            outputs = engine.step()
            now = time.perf_counter() - t0
            step_times_s.append(now)
            step_num_samples.append(sum(1 for o in outputs if o.outputs[0].delta_token_ids))
            stopped = []
            for out in outputs:
                timing = timings[out.request_id]
                completion = out.outputs[0]
                if completion.delta_token_ids:
                    if timing.first_token_s is None:
                        timing.first_token_s = now
                    else:
                        assert timing.last_token_s is not None
                        timing.itl_s.append(now - timing.last_token_s)
                    timing.last_token_s = now
                num_tokens = len(completion.token_ids)
                if not out.finished and num_tokens >= targets[out.request_id]:
                    stopped.append(out.request_id)
                if out.finished or num_tokens >= targets[out.request_id]:
                    timing.finish_s = now
                    timing.num_output_tokens = num_tokens
                    num_done += 1
                    bar.update(1)
            if stopped:
                engine.abort_request(stopped)
        elapsed_s = time.perf_counter() - t0
    finally:
        bar.close()
        engine.stat_loggers.remove(stats.append)
        unfinished = [i for i, t in timings.items() if t.finish_s is None]
        if unfinished:
            engine.abort_request(unfinished)
    result = summarize_run(list(timings.values()), stats, step_times_s, elapsed_s)
    result["step_num_tokens"] = [s.num_scheduled_tokens + s.num_padded_tokens for s in stats]
    result["step_num_samples"] = step_num_samples
    return result


def summarize_run(
    timings: list[RequestTiming],
    stats: list[SchedulerStats],
    step_times_s: list[float],
    elapsed_s: float,
) -> dict[str, Any]:
    """Return the metrics of one offline run (see run_workload)."""
    num_in = sum(t.prompt_len for t in timings)
    num_out = sum(t.num_output_tokens for t in timings)
    scheduled = sum(s.num_scheduled_tokens for s in stats)
    padded = sum(s.num_padded_tokens for s in stats)
    batch_sizes = [len(s.scheduled_req_ids) for s in stats if s.scheduled_req_ids]
    result: dict[str, Any] = {
        "num_requests": len(timings),
        "elapsed_s": elapsed_s,
        "input_tokens": num_in,
        "output_tokens": num_out,
        "requests_per_s": len(timings) / elapsed_s,
        "output_tokens_per_s": num_out / elapsed_s,
        "total_tokens_per_s": (num_in + num_out) / elapsed_s,
        "num_steps": len(stats),
        "num_scheduled_tokens": scheduled,
        "num_padded_tokens": padded,
        "padding_waste_pct": 100.0 * padded / max(1, scheduled + padded),
        "num_preemptions": sum(s.num_preemptions for s in stats),
        "mean_batch_size": sum(batch_sizes) / max(1, len(batch_sizes)),
        "max_batch_size": max(batch_sizes, default=0),
        "peak_kv_cache_usage_pct": 100.0 * max((s.kv_cache_usage for s in stats), default=0.0),
    }
    result |= summarize([t.first_token_s for t in timings if t.first_token_s is not None], "ttft")
    result |= summarize([t.tpot_s for t in timings if t.tpot_s is not None], "tpot")
    result |= summarize([x for t in timings for x in t.itl_s], "itl")
    result |= summarize([t.finish_s for t in timings if t.finish_s is not None], "e2el")
    result["requests"] = [
        {
            "prompt_len": t.prompt_len,
            "output_len": t.num_output_tokens,
            "ttft_s": t.first_token_s,
            "tpot_s": t.tpot_s,
            "e2el_s": t.finish_s,
        }
        for t in timings
    ]
    result["timeline"] = {
        "time_s": step_times_s,
        "num_running": [s.num_running for s in stats],
        "kv_cache_usage_pct": [100.0 * s.kv_cache_usage for s in stats],
    }
    return result


def add_flops(
    result: dict[str, Any], flops: ModelFlops, peak: dict[str, Any] | None
) -> dict[str, Any]:
    """Add achieved useful model FLOP/s (and utilization of the measured peak) to a run."""
    useful = sum(flops.request_flops(r["prompt_len"], r["output_len"]) for r in result["requests"])
    result["model_flops"] = useful
    result["model_flops_per_s"] = useful / result["elapsed_s"]
    if peak is not None:
        result["compute_utilization_pct"] = (
            100.0 * result["model_flops_per_s"] / (peak["peak_flops_per_s"])
        )
    return result


def run_throughput(
    args: EngineArgs,
    num_requests: int,
    input_len: LengthSpec,
    output_len: LengthSpec,
    seed: int = 0,
    ignore_eos: bool = True,
    max_tokens: int | None = None,
    measure_peak: bool = True,
    peak_matmul_size: int = 2048,
    use_tqdm: bool = True,
) -> dict[str, Any]:
    """Build an engine, warm it up, run the workload; return config, workload and metrics."""
    engine = LLMEngine(args)
    requests = make_requests(
        engine.tokenizer, num_requests, input_len, output_len, seed, engine.vocab_size
    )
    warm_up(engine, requests)
    run = run_workload(
        engine, requests, ignore_eos, max_tokens, desc="throughput", use_tqdm=use_tqdm
    )
    peak = None
    if measure_peak:
        peak = measure_matmul_peak(
            engine.model_config.dtype, engine.model_config.device, peak_matmul_size
        )
    add_flops(run, ModelFlops.from_arch(engine.worker.model.config), peak)
    return {
        "bench": "throughput",
        "engine_args": dataclasses.asdict(args),
        "scheduler": engine.scheduler_config.scheduler,
        "kv_cache_dtype": str(engine.kv_spec.dtype).removeprefix("torch."),
        "num_kv_blocks": engine.num_blocks,
        "block_size": engine.cache_config.block_size,
        "input_len": input_len.describe(),
        "output_len": output_len.describe(),
        "seed": seed,
        "ignore_eos": ignore_eos,
        "max_tokens": max_tokens,
        "workload": workload_summary(requests),
        "matmul_peak": peak,
        **run,
    }


def format_throughput(r: dict[str, Any]) -> str:
    """Return a markdown report of run_throughput's result."""
    rows = [
        ["requests/s", fmt(r["requests_per_s"], digits=2)],
        ["output tokens/s", fmt(r["output_tokens_per_s"])],
        ["total tokens/s", fmt(r["total_tokens_per_s"])],
        [
            "requests (input / output tokens)",
            f"{r['num_requests']} ({r['input_tokens']} / {r['output_tokens']})",
        ],
        ["elapsed", f"{r['elapsed_s']:.2f} s"],
        ["TTFT mean / p50 / p99", _ms3(r, "ttft")],
        ["TPOT mean / p50 / p99", _ms3(r, "tpot")],
        ["ITL mean / p50 / p99", _ms3(r, "itl")],
        ["E2E latency mean / p50 / p99", _ms3(r, "e2el")],
        ["steps", str(r["num_steps"])],
        ["mean / max batch size", f"{r['mean_batch_size']:.1f} / {r['max_batch_size']}"],
        ["padded tokens (waste)", f"{r['num_padded_tokens']} ({r['padding_waste_pct']:.1f}%)"],
        ["preemptions", str(r["num_preemptions"])],
        ["peak KV cache usage", f"{r['peak_kv_cache_usage_pct']:.1f}%"],
        ["model GFLOP/s (useful)", fmt(r["model_flops_per_s"], 1e-9)],
    ]
    if r.get("matmul_peak"):
        peak = r["matmul_peak"]
        rows.append(
            [
                "compute utilization",
                f"{r['compute_utilization_pct']:.1f}% of {peak['peak_flops_per_s'] / 1e9:.0f} "
                f"GFLOP/s ({peak['dtype']} {peak['size']}^3 matmul, best of {peak['repeats']})",
            ]
        )
    title = (
        f"## infer8 bench throughput: {r['scheduler']} scheduler, {r['kv_cache_dtype']} KV cache\n\n"
        f"Workload: {r['num_requests']} requests, input {r['input_len']}, output "
        f"{r['output_len']} tokens (max_tokens {r['max_tokens'] or '= output length'}), seed "
        f"{r['seed']}, ignore_eos {r['ignore_eos']}; "
        f"{r['num_kv_blocks']} KV blocks of {r['block_size']} tokens.\n\n"
    )
    return title + markdown_table(["metric", "value"], rows)


def _ms3(r: dict[str, Any], name: str) -> str:
    return " / ".join(fmt(r[f"{name}_{k}_s"], 1e3) for k in ("mean", "p50", "p99")) + " ms"
