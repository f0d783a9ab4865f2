"""`infer8 bench compare`: {static, continuous} x {bf16, fp8} KV on one workload, in one run.

Every group serves the same prompts with the same model and KV memory budget. Output lengths
vary (the seed's example: one request stops after 20 tokens, another runs 150): requests are
sent with a `max_tokens` cap and stopped at their own length, as an end-of-sequence token
would stop them, so a static batch reserves the cap and keeps finished seats, while the
continuous scheduler frees them at once.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import platform
from pathlib import Path
from typing import Any

import torch

from infer8.bench.capacity import measure_capacity
from infer8.bench.flops import ModelFlops, measure_matmul_peak
from infer8.bench.report import bar_plot, cdf_plot, fmt, fmt_bytes, line_plot, markdown_table
from infer8.bench.throughput import add_flops, bench_engine_args, run_workload, warm_up
from infer8.bench.workload import LengthSpec, make_requests, workload_summary
from infer8.config import EngineArgs, KVCacheDType
from infer8.engine import LLMEngine, resolve_model_path

DEFAULT_KV_BYTES = 128 << 20
SCHEDULERS = ("static", "continuous")
KV_CACHE_DTYPES = ("bfloat16", "fp8_e4m3")


def group_label(g: dict[str, Any]) -> str:
    """Return "continuous / fp8_e4m3"-style names for tables and plots."""
    return f"{g['scheduler']} / {g['kv_cache_dtype']}"


def run_compare(
    args: EngineArgs,
    num_requests: int = 64,
    input_len: LengthSpec = LengthSpec("fixed", 128),
    output_len: LengthSpec = LengthSpec("uniform", 20, 20, 150),
    max_tokens: int | None = None,
    seed: int = 0,
    schedulers: tuple[str, ...] = SCHEDULERS,
    kv_cache_dtypes: tuple[str, ...] = KV_CACHE_DTYPES,
    hf_baseline: bool = False,
    hf_batch_size: int = 32,
    eval_tokens: int = 2048,
    eval_text: str = "areopagitica.txt",
    peak_matmul_size: int = 2048,
    use_tqdm: bool = True,
) -> dict[str, Any]:
    """Run every group on one workload and return the comparison (see the module docstring)."""
    if args.kv_cache_memory_bytes is None:
        args = bench_engine_args(args, kv_cache_memory_bytes=DEFAULT_KV_BYTES)
    cap = max_tokens if max_tokens is not None else output_len.max_len
    groups: list[dict[str, Any]] = []
    peaks: list[dict[str, Any]] = []
    requests = None
    flops = None
    hf_inputs: dict[str, Any] = {}
    for kv in kv_cache_dtypes:
        for sched in schedulers:
            group_args = bench_engine_args(args, scheduler=sched, kv_cache_dtype=kv)
            print(f"compare: {sched} scheduler, {kv} KV cache", flush=True)
            engine = LLMEngine(group_args)
            if requests is None:
                requests = make_requests(
                    engine.tokenizer, num_requests, input_len, output_len, seed, engine.vocab_size
                )
                flops = ModelFlops.from_arch(engine.worker.model.config)
                dtype, device = engine.model_config.dtype, engine.model_config.device
                hf_inputs = {
                    "dtype": dtype,
                    "device": device,
                    "pad_token_id": engine.tokenizer.eos_token_ids[0],
                }
                peaks.append(measure_matmul_peak(dtype, device, peak_matmul_size))
            warm_up(engine, requests)
            run = run_workload(engine, requests, True, cap, desc=f"{sched}/{kv}", use_tqdm=use_tqdm)
            groups.append(
                {
                    "scheduler": sched,
                    "kv_cache_dtype": kv,
                    "kv_storage_dtype": str(engine.kv_spec.dtype).removeprefix("torch."),
                    "kv_bytes_per_token": engine.kv_spec.bytes_per_token,
                    "num_kv_blocks": engine.num_blocks,
                    **run,
                }
            )
            del engine
            gc.collect()
    assert requests is not None and flops is not None
    peaks.append(measure_matmul_peak(hf_inputs["dtype"], hf_inputs["device"], peak_matmul_size))
    peak = max(peaks, key=lambda p: p["peak_flops_per_s"])
    summary = workload_summary(requests)
    context_len = round(summary["input_len_mean"] + summary["output_len_mean"])
    prompt_len = round(summary["input_len_mean"])
    model_dtype_name = str(hf_inputs["dtype"]).removeprefix("torch.")
    accuracy = _kv_accuracy(args, kv_cache_dtypes, hf_inputs["dtype"], eval_tokens, eval_text)
    for g in groups:
        add_flops(g, flops, peak)
        group_args = bench_engine_args(
            args, scheduler=g["scheduler"], kv_cache_dtype=g["kv_cache_dtype"]
        )
        g["capacity"] = measure_capacity(group_args, context_len, prompt_len, cap)
        g["max_concurrent_sessions"] = g["capacity"]["max_concurrent_sessions"]
        acc = accuracy.get(g["kv_cache_dtype"])
        g["accuracy_delta_pct"] = None if acc is None else acc["accuracy_delta_pct"]
        g["kv_eval"] = None if acc is None else acc.get("kv_eval")
    result: dict[str, Any] = {
        "bench": "compare",
        "model": resolve_model_path(args.model),
        "engine_args": dataclasses.asdict(args),
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "input_len": input_len.describe(),
        "output_len": output_len.describe(),
        "max_tokens": cap,
        "seed": seed,
        "workload": summary,
        "capacity_context_len": context_len,
        "matmul_peak": peak,
        "matmul_peak_samples": peaks,
        "machine": {**_machine(hf_inputs["device"]), "model_dtype": model_dtype_name},
        "eval_tokens": eval_tokens,
        "groups": groups,
    }
    if hf_baseline:
        from infer8.bench.hf_baseline import run_hf_baseline

        result["hf_baseline"] = run_hf_baseline(
            resolve_model_path(args.model),
            requests,
            hf_batch_size,
            flops=flops,
            peak_flops_per_s=peak["peak_flops_per_s"],
            use_tqdm=use_tqdm,
            **hf_inputs,
        )
    result["ratios"] = compare_ratios(result)
    return result


def _kv_accuracy(
    args: EngineArgs,
    kv_cache_dtypes: tuple[str, ...],
    model_dtype: torch.dtype,
    eval_tokens: int,
    eval_text: str,
) -> dict[str, float | dict[str, Any] | None]:
    """Run `infer8 eval kv` once per FP8 dtype against a cache in the model's dtype.

    A cache in the model's dtype is that reference (delta 0); another 16/32-bit cache has no
    measured delta (None).
    """
    accuracy: dict[str, Any] = {}
    if eval_tokens <= 0:
        return accuracy
    from infer8.eval.kv_accuracy import run_kv_eval

    for kv in kv_cache_dtypes:
        kv_dtype = KVCacheDType.parse(kv)
        if not kv_dtype.is_fp8:
            is_reference = kv_dtype.torch_dtype(model_dtype) == model_dtype
            accuracy[kv] = {"accuracy_delta_pct": 0.0 if is_reference else None}
            continue
        print(f"compare: eval kv ({kv} vs a {model_dtype} cache, {eval_tokens} tokens)", flush=True)
        eval_args = bench_engine_args(args, kv_cache_dtype=kv, scheduler="continuous")
        r = run_kv_eval(eval_args, num_tokens=eval_tokens, text=eval_text)
        accuracy[kv] = {"accuracy_delta_pct": 100.0 * r["perplexity_delta_rel"], "kv_eval": r}
        gc.collect()
    return accuracy


def _machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def compare_ratios(r: dict[str, Any]) -> dict[str, float]:
    """Return the headline ratios: continuous/static, fp8/bf16, best/worst, infer8/HF."""
    by_key = {(g["scheduler"], g["kv_cache_dtype"]): g for g in r["groups"]}
    scheds = list(dict.fromkeys(g["scheduler"] for g in r["groups"]))
    kvs = list(dict.fromkeys(g["kv_cache_dtype"] for g in r["groups"]))
    fp8 = [k for k in kvs if KVCacheDType.parse(k).is_fp8]
    wide = [k for k in kvs if not KVCacheDType.parse(k).is_fp8]
    ratios: dict[str, float] = {}

    def ratio(name: str, a: dict[str, Any], b: dict[str, Any], key: str) -> None:
        if b.get(key):
            ratios[name] = a[key] / b[key]

    if "static" in scheds and "continuous" in scheds:
        for kv in kvs:
            a, b = by_key[("continuous", kv)], by_key[("static", kv)]
            ratio(f"output_tokens_per_s continuous/static ({kv})", a, b, "output_tokens_per_s")
            ratio(f"sessions continuous/static ({kv})", a, b, "max_concurrent_sessions")
    for s in scheds:
        for k8 in fp8:
            for kw in wide:
                a, b = by_key[(s, k8)], by_key[(s, kw)]
                ratio(f"sessions {k8}/{kw} ({s})", a, b, "max_concurrent_sessions")
                ratio(f"output_tokens_per_s {k8}/{kw} ({s})", a, b, "output_tokens_per_s")
    sessions = [g["max_concurrent_sessions"] for g in r["groups"]]
    if min(sessions) > 0:
        ratios["sessions best/worst"] = max(sessions) / min(sessions)
    hf = r.get("hf_baseline")
    if hf:
        for kv in kvs:
            if ("continuous", kv) in by_key:
                ratio(
                    f"output_tokens_per_s continuous ({kv})/hf",
                    by_key[("continuous", kv)],
                    hf,
                    "output_tokens_per_s",
                )
    return ratios


def format_compare(r: dict[str, Any]) -> str:
    """Return docs/benchmarks.md-ready markdown of run_compare's result."""
    headers = [
        "engine",
        "sessions",
        "output tok/s",
        "padding waste",
        "compute util.",
        "TTFT p50 / p99 (ms)",
        "TPOT p50 / p99 (ms)",
        "preemptions",
        "ppl delta (eval kv)",
    ]
    rows = []
    for g in r["groups"]:
        rows.append(
            [
                f"infer8 {group_label(g)}",
                str(g["max_concurrent_sessions"]),
                fmt(g["output_tokens_per_s"]),
                f"{g['padding_waste_pct']:.1f}%",
                f"{g['compute_utilization_pct']:.1f}%",
                f"{fmt(g['ttft_p50_s'], 1e3, 0)} / {fmt(g['ttft_p99_s'], 1e3, 0)}",
                f"{fmt(g['tpot_p50_s'], 1e3)} / {fmt(g['tpot_p99_s'], 1e3)}",
                str(g["num_preemptions"]),
                "-" if g["accuracy_delta_pct"] is None else f"{g['accuracy_delta_pct']:+.3f}%",
            ]
        )
    hf = r.get("hf_baseline")
    if hf:
        rows.append(
            [
                f"HF transformers generate, batch {hf['batch_size']}",
                "-",
                fmt(hf["output_tokens_per_s"]),
                f"{hf['padding_waste_pct']:.1f}%",
                fmt(hf.get("compute_utilization_pct")) + "%",
                "-",
                "-",
                "-",
                "reference",
            ]
        )
    peak = r["matmul_peak"]
    w = r["workload"]
    m = r["machine"]
    lines = [
        "## infer8 bench compare",
        "",
        f"Model `{Path(r['model']).name}`, {m['device']} ({m['processor']}, {m['torch_threads']} "
        f"torch threads, torch {m['torch']}); KV budget "
        f"{fmt_bytes(r['kv_cache_memory_bytes'])} for every group. Workload: "
        f"{w['num_requests']} requests, prompts {r['input_len']} tokens (mean "
        f"{w['input_len_mean']:.0f}), outputs {r['output_len']} tokens (mean "
        f"{w['output_len_mean']:.0f}, {w['output_len_min']}..{w['output_len_max']}), "
        f"max_tokens {r['max_tokens']}, greedy, all queued at once, seed {r['seed']}.",
        "",
        markdown_table(headers, rows),
        "",
        "Ratios: " + "; ".join(f"{k} **{v:.2f}x**" for k, v in r["ratios"].items()) + ".",
        "",
        "How each column is measured:",
        f"- sessions: requests admitted at once into the same KV budget, sessions of "
        f"{r['capacity_context_len']} tokens (mean prompt + mean output); static reserves prompt "
        f"+ max_tokens ({r['max_tokens']}) per session up front (`infer8 bench capacity`).",
        "- output tok/s: generated tokens that requests asked for / wall time from queueing "
        "the first request to the last token.",
        "- padding waste: dummy tokens computed to keep static batches rectangular / all "
        "computed tokens (HF: tokens generated past a request's own length).",
        f"- compute util.: useful model FLOPs (2 x matmul parameters per token incl. LM head "
        f"rows sampled, + attention 4 x layers x heads x head_dim x context) per second / this "
        f"machine's {peak['dtype']} matmul peak measured in the same run "
        f"({peak['peak_flops_per_s'] / 1e9:.0f} GFLOP/s, {peak['size']}^3, best of "
        f"{peak['repeats']}); padding and recomputation after preemption are not useful work.",
        "- TTFT / TPOT: per request, from queueing to its first token / mean gap after it.",
        f"- ppl delta: perplexity change of the FP8 cache vs a cache in the model's dtype "
        f"({m['model_dtype']}) on public-domain text (`infer8 eval kv`, {r['eval_tokens']} "
        "tokens); rows in the model's dtype are that reference (+0).",
    ]
    return "\n".join(lines)


def compare_plots(r: dict[str, Any], plot_dir: str | Path) -> list[Path]:
    """Save the comparison's PNG plots; return their paths."""
    plot_dir = Path(plot_dir)
    groups = r["groups"]
    labels = [group_label(g) for g in groups]
    tps = [g["output_tokens_per_s"] for g in groups]
    util = [g["compute_utilization_pct"] for g in groups]
    hf = r.get("hf_baseline")
    if hf:
        labels_hf = [*labels, f"HF generate b{hf['batch_size']}"]
        tps_hf = [*tps, hf["output_tokens_per_s"]]
        util_hf = [*util, hf.get("compute_utilization_pct")]
    else:
        labels_hf, tps_hf, util_hf = labels, tps, util
    return [
        bar_plot(
            plot_dir / "compare_output_tokens_per_s.png",
            labels_hf,
            tps_hf,
            "Output tokens/s",
            "tokens/s",
        ),
        bar_plot(
            plot_dir / "compare_sessions.png",
            labels,
            [g["max_concurrent_sessions"] for g in groups],
            f"Concurrent sessions of {r['capacity_context_len']} tokens in "
            f"{fmt_bytes(r['kv_cache_memory_bytes'])} KV",
            "sessions",
        ),
        bar_plot(
            plot_dir / "compare_padding_waste.png",
            labels,
            [g["padding_waste_pct"] for g in groups],
            "Padding waste",
            "% of computed tokens",
        ),
        bar_plot(
            plot_dir / "compare_compute_utilization.png",
            labels_hf,
            util_hf,
            "Compute utilization (useful FLOP/s / measured matmul peak)",
            "%",
        ),
        cdf_plot(
            plot_dir / "compare_ttft_cdf.png",
            {
                group_label(g): [x["ttft_s"] for x in g["requests"] if x["ttft_s"] is not None]
                for g in groups
            },
            "Time to first token",
            "seconds",
        ),
        line_plot(
            plot_dir / "compare_running.png",
            {
                group_label(g): (g["timeline"]["time_s"], g["timeline"]["num_running"])
                for g in groups
            },
            "Requests running after each step",
            "seconds",
            "requests",
        ),
    ]
