"""The runs behind `infer8 bench ...` (flags: cli.py): each builds its engines or clients, runs,
prints the markdown report and writes the JSON, markdown and plots asked for."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from infer8.entrypoints.args import engine_args_from


def _emit(ns: argparse.Namespace, result: dict[str, Any], markdown: str) -> None:
    """Print the markdown and write the files asked for."""
    from infer8.bench.report import write_json, write_text

    print("\n" + markdown)
    if ns.json:
        write_json(ns.json, result)
        print(f"\nwrote {ns.json}")
    if ns.markdown:
        write_text(ns.markdown, markdown)
        print(f"wrote {ns.markdown}")


def _print_plots(paths: list[Path]) -> None:
    for path in paths:
        print(f"wrote {path}")


def cmd_throughput(ns: argparse.Namespace) -> int:
    from infer8.bench.report import cdf_plot, line_plot
    from infer8.bench.throughput import format_throughput, run_throughput

    result = run_throughput(
        engine_args_from(ns),
        ns.num_requests,
        ns.input_len,
        ns.output_len,
        ns.seed,
        ns.ignore_eos,
        ns.max_tokens,
        measure_peak=ns.peak_matmul_size > 0,
        peak_matmul_size=ns.peak_matmul_size,
        use_tqdm=not ns.disable_tqdm,
    )
    _emit(ns, result, format_throughput(result))
    if ns.plot_dir:
        d = Path(ns.plot_dir)
        label = f"{result['scheduler']} / {result['kv_cache_dtype']}"
        ttft = [r["ttft_s"] for r in result["requests"] if r["ttft_s"] is not None]
        timeline = result["timeline"]
        _print_plots(
            [
                cdf_plot(
                    d / "throughput_ttft_cdf.png", {label: ttft}, "Time to first token", "seconds"
                ),
                line_plot(
                    d / "throughput_running.png",
                    {label: (timeline["time_s"], timeline["num_running"])},
                    "Requests running after each step",
                    "seconds",
                    "requests",
                ),
            ]
        )
    return 0


def cmd_lora(ns: argparse.Namespace) -> int:
    from infer8.bench.lora import format_lora, run_lora_bench

    result = run_lora_bench(
        engine_args_from(ns), ns.num_adapters, ns.rank, ns.num_requests, ns.rounds,
        use_tqdm=not ns.disable_tqdm,
    )  # fmt: skip
    _emit(ns, result, format_lora(result))
    return 0


def cmd_spec_decode(ns: argparse.Namespace) -> int:
    from infer8.bench.spec_decode import format_spec_decode, run_spec_decode_bench

    result = run_spec_decode_bench(
        engine_args_from(ns), ns.methods, ns.num_prompts, ns.max_tokens, ns.w1_requests,
        use_tqdm=not ns.disable_tqdm,
    )  # fmt: skip
    _emit(ns, result, format_spec_decode(result))
    return 0


def load_tokenizer(path: str | None) -> Any:
    """Load the tokenizer of an HF directory or GGUF file (None: the default model's)."""
    from infer8.engine import resolve_model_path
    from infer8.tokenizer import Tokenizer

    model_path = Path(resolve_model_path(path))
    if model_path.is_dir():
        return Tokenizer.from_dir(model_path)
    from infer8.models.gguf_loader import load_gguf_tokenizer

    return load_gguf_tokenizer(model_path)


def cmd_serve(ns: argparse.Namespace) -> int:
    from infer8.bench.report import cdf_plot
    from infer8.bench.workload import make_requests

    try:
        from infer8.bench.serve import ServeConfig, format_serve, parse_goodput, run_serve
    except ImportError as e:
        raise RuntimeError(f"bench serve needs {e.name}: pip install 'infer8[bench]'") from None

    config = ServeConfig(
        base_url=ns.base_url,
        endpoint=ns.endpoint,
        model=ns.model,
        api_key=ns.api_key,
        request_rate=ns.request_rate,
        burstiness=ns.burstiness,
        max_concurrency=ns.max_concurrency,
        ignore_eos=ns.ignore_eos,
        temperature=ns.temperature,
        seed=ns.seed,
        timeout_s=ns.timeout_s,
        stream_usage=not ns.no_stream_usage,
        goodput_slos_ms=parse_goodput(ns.goodput),
        extra_body=ns.extra_body,
    )
    tokenizer = load_tokenizer(ns.tokenizer)
    if ns.sessions_slo:
        return _sessions_at_slo(ns, config, tokenizer)
    if ns.dataset_name == "grounded":
        from infer8.bench.spec_decode import grounded_requests

        requests = grounded_requests(tokenizer, ns.num_requests, ns.output_len.max_len)
    else:
        requests = make_requests(tokenizer, ns.num_requests, ns.input_len, ns.output_len, ns.seed)
    result = run_serve(config, requests, tokenizer, use_tqdm=not ns.disable_tqdm)
    result["input_len"], result["output_len"] = ns.input_len.describe(), ns.output_len.describe()
    _emit(ns, result, format_serve(result))
    if ns.plot_dir:
        d = Path(ns.plot_dir)
        ok = [r for r in result["requests"] if r["success"]]
        _print_plots(
            [
                cdf_plot(
                    d / "serve_latency_cdf.png",
                    {
                        "TTFT": [r["ttft_s"] for r in ok if r["ttft_s"] is not None],
                        "E2E": [r["e2el_s"] for r in ok if r["e2el_s"] is not None],
                    },
                    "Request latency",
                    "seconds",
                ),
                cdf_plot(
                    d / "serve_itl_cdf.png",
                    {"ITL": [x for r in ok for x in r["itl_s"]]},
                    "Inter-token latency",
                    "seconds",
                ),
            ]
        )
    return 0 if result["completed"] else 1


def _sessions_at_slo(ns: argparse.Namespace, config: Any, tokenizer: Any) -> int:
    from infer8.bench.sessions import SessionSLO, find_max_sessions, format_sessions

    slo = SessionSLO(
        ttft_p99_ms=ns.slo_ttft_p99_ms,
        tpot_p99_ms=ns.slo_tpot_p99_ms,
        num_turns=ns.session_turns,
        first_len=ns.session_first_len,
        turn_len=ns.session_turn_len,
        output_len=ns.session_output_len,
        think_time_s=ns.think_time_s,
        warmup_s=ns.warmup_s,
        window_s=ns.window_s,
        max_sessions=ns.max_sessions,
        max_probes=ns.max_probes,
    )
    result = find_max_sessions(config, slo, tokenizer, log=not ns.disable_tqdm)
    _emit(ns, result, format_sessions(result))
    return 0 if result["max_sessions_within_slo"] > 0 else 1


def cmd_suite(ns: argparse.Namespace) -> int:
    from infer8.bench.suite import format_suite, run_suite

    result = run_suite(
        engine_args_from(ns),
        list(ns.workloads),
        scale=ns.scale,
        online_concurrency=ns.online_concurrency or None,
        seed=ns.seed,  # the engine's --seed also seeds the workload
        use_tqdm=not ns.disable_tqdm,
        repeats=ns.repeats,
    )
    _emit(ns, result, format_suite(result))
    return 0 if all(r.get("failed", 0) == 0 for r in result["rows"]) else 1


def cmd_capacity(ns: argparse.Namespace) -> int:
    from infer8.bench.capacity import format_capacity, run_capacity
    from infer8.bench.report import bar_plot, fmt_bytes

    result = run_capacity(
        engine_args_from(ns),
        ns.context_len,
        ns.prompt_len,
        ns.max_tokens,
        ns.schedulers,
        ns.kv_cache_dtypes,
    )
    _emit(ns, result, format_capacity(result))
    if ns.plot_dir:
        groups = result["groups"]
        _print_plots(
            [
                bar_plot(
                    Path(ns.plot_dir) / "capacity_sessions.png",
                    [f"{g['scheduler']} / {g['kv_cache_dtype']}" for g in groups],
                    [g["max_concurrent_sessions"] for g in groups],
                    f"Sessions of {result['context_len']} tokens in "
                    f"{fmt_bytes(result['kv_cache_memory_bytes'])} KV",
                    "sessions",
                )
            ]
        )
    return 0


def cmd_compare(ns: argparse.Namespace) -> int:
    from infer8.bench.compare import compare_plots, format_compare, run_compare

    result = run_compare(
        engine_args_from(ns),
        num_requests=ns.num_requests,
        input_len=ns.input_len,
        output_len=ns.output_len,
        max_tokens=ns.max_tokens,
        seed=ns.seed,
        schedulers=ns.schedulers,
        kv_cache_dtypes=ns.kv_cache_dtypes,
        hf_baseline=ns.hf_baseline,
        hf_batch_size=ns.hf_batch_size,
        eval_tokens=ns.eval_tokens,
        eval_text=ns.eval_text,
        peak_matmul_size=ns.peak_matmul_size,
        use_tqdm=not ns.disable_tqdm,
    )
    _emit(ns, result, format_compare(result))
    if ns.plot_dir:
        _print_plots(compare_plots(result, ns.plot_dir))
    return 0
