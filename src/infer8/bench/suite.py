"""`infer8 bench suite`: W1/W2/W3 offline plus online serving, each against its matmul roofline.

One command, one engine configuration, one run: the offline workloads on one engine, then the
same engine's flags behind `infer8 serve` (its own process) for the online run. For every
workload the report gives the time its matmuls alone take on this machine (the model's own
projections timed at each step's size, see flops.matmul_roofline) and the share of that speed
the engine reached; online throughput is also given as a ratio to the offline run of the same
requests.
"""

from __future__ import annotations

import dataclasses
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from infer8.bench.flops import matmul_roofline
from infer8.bench.report import fmt, markdown_table
from infer8.bench.throughput import run_workload, warm_up
from infer8.bench.workload import BenchRequest, LengthSpec, make_requests
from infer8.config import EngineArgs
from infer8.engine import LLMEngine


@dataclass(frozen=True)
class Workload:
    """A named offline workload: how many requests, prompt and output lengths."""

    name: str
    num_requests: int
    input_len: LengthSpec
    output_len: LengthSpec

    def scaled(self, scale: float) -> Workload:
        """Return the workload with counts and lengths multiplied by `scale` (small runs)."""
        if scale == 1.0:
            return self

        def shrink(spec: LengthSpec) -> LengthSpec:
            def f(n: int) -> int:
                return max(2, round(n * scale))

            return dataclasses.replace(
                spec, value=f(spec.value), low=f(spec.low), high=max(f(spec.low), f(spec.high))
            )

        return Workload(
            self.name,
            max(2, round(self.num_requests * scale)),
            shrink(self.input_len),
            shrink(self.output_len),
        )


WORKLOADS = {
    "W1": Workload("W1", 64, LengthSpec.parse("128"), LengthSpec.parse("128")),
    "W2": Workload(
        "W2", 128, LengthSpec.parse("uniform:12:244"), LengthSpec.parse("uniform:12:244")
    ),
    "W3": Workload("W3", 32, LengthSpec.parse("2048"), LengthSpec.parse("128")),
}


def _offline(
    engine: LLMEngine, requests: list[BenchRequest], name: str, use_tqdm: bool
) -> dict[str, Any]:
    warm_up(engine, requests)
    run = run_workload(engine, requests, desc=name, use_tqdm=use_tqdm)
    roof = matmul_roofline(engine.worker.model, run["step_num_tokens"], run["step_num_samples"])
    return {
        "workload": name,
        "mode": "offline",
        "num_requests": len(requests),
        "elapsed_s": run["elapsed_s"],
        "output_tokens_per_s": run["output_tokens_per_s"],
        "ttft_p50_s": run["ttft_p50_s"],
        "tpot_p50_s": run["tpot_p50_s"],
        "num_steps": run["num_steps"],
        "matmul_only_s": roof["matmul_only_s"],
        "matmul_share": roof["matmul_only_s"] / run["elapsed_s"],
    }


def _serve_argv(args: EngineArgs, port: int) -> list[str]:
    """Return `infer8 serve` with the engine flags that matter for the comparison."""
    argv = [sys.executable, "-m", "infer8.cli", "serve"]
    argv += [args.model] if args.model else []
    flags = {
        "--dtype": args.dtype, "--kv-cache-dtype": args.kv_cache_dtype,
        "--max-num-seqs": args.max_num_seqs, "--max-num-batched-tokens": args.max_num_batched_tokens,
        "--kv-cache-memory-bytes": args.kv_cache_memory_bytes, "--max-model-len": args.max_model_len,
        "--block-size": args.block_size,
    }  # fmt: skip
    for flag, value in flags.items():
        if value is not None:
            argv += [flag, str(value)]
    return argv + ["--host", "127.0.0.1", "--port", str(port), "--uvicorn-log-level", "warning"]


@contextmanager
def _served(args: EngineArgs) -> Iterator[str]:
    """Run `infer8 serve` with these engine flags in its own process; yield its URL."""
    from infer8.entrypoints.preflight import check_port

    sock = check_port("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen(_serve_argv(args, port), stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"infer8 serve exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("infer8 serve did not start within 300 s")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def _online(
    url: str,
    requests: list[BenchRequest],
    warm_up_requests: list[BenchRequest],
    concurrency: int,
    tokenizer: Any,
) -> dict[str, Any]:
    """Run W1's requests against the server at `concurrency`, after a warm-up like offline's:
    a full batch of other prompts of the same lengths (no prefix-cache hit), 4 tokens each."""
    from infer8.bench.serve import ServeConfig, run_serve

    config = ServeConfig(base_url=url, max_concurrency=concurrency, ignore_eos=True)
    warm = [dataclasses.replace(r, output_len=4) for r in warm_up_requests[:concurrency]]
    run_serve(config, warm, tokenizer, use_tqdm=False)
    result = run_serve(config, requests, tokenizer, use_tqdm=False)
    return {
        "workload": f"online c={concurrency}",
        "mode": "online",
        "num_requests": len(requests),
        "elapsed_s": result["duration_s"],
        "output_tokens_per_s": result["output_throughput"],
        "ttft_p50_s": result["ttft_p50_s"],
        "tpot_p50_s": result["tpot_p50_s"],
        "failed": result["failed"],
    }


def run_suite(
    args: EngineArgs,
    names: list[str],
    scale: float = 1.0,
    online_concurrency: int | None = 32,
    seed: int = 0,
    use_tqdm: bool = True,
    repeats: int = 1,
) -> dict[str, Any]:
    """Run the named offline workloads on one engine, then W1's requests online; return rows.

    With repeats > 1, offline W1 and online W1 then run again, alternating, `repeats` pairs in
    all (both the engine and the server stay loaded): this machine's run-to-run noise (10-30%)
    is larger than the online/offline gap, so the ratio is judged per pair and by its median.
    """
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workloads {unknown}; choose from {sorted(WORKLOADS)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    engine = LLMEngine(args)
    tokenizer = engine.tokenizer
    w1 = WORKLOADS["W1"].scaled(scale)

    def w1_requests_seeded(s: int) -> list[BenchRequest]:
        return make_requests(
            tokenizer, w1.num_requests, w1.input_len, w1.output_len, s, engine.vocab_size
        )

    w1_requests = w1_requests_seeded(seed)
    rows = []
    for name in names:
        w = WORKLOADS[name].scaled(scale)
        requests = make_requests(
            tokenizer, w.num_requests, w.input_len, w.output_len, seed, engine.vocab_size
        )
        rows.append(_offline(engine, requests, name, use_tqdm))
    result: dict[str, Any] = {
        "bench": "suite", "engine_args": dataclasses.asdict(args), "scale": scale, "rows": rows
    }  # fmt: skip
    if not online_concurrency:
        return result
    offline_w1 = next((r for r in rows if r["workload"] == "W1"), None)
    if offline_w1 is None:
        offline_w1 = _offline(engine, w1_requests, "W1", use_tqdm)
        rows.append(offline_w1)
    # Each pair runs prompts neither engine has seen (another seed): a repeat of the same
    # prompts would be served from the prefix cache.
    batches = [w1_requests] + [w1_requests_seeded(seed + 1000 * i) for i in range(1, repeats)]
    warm_up_requests = w1_requests_seeded(seed + 7919)  # never timed
    if repeats == 1:
        del engine  # the server process loads its own copy
    pairs = []
    with _served(args) as url:
        online = _online(url, batches[0], warm_up_requests, online_concurrency, tokenizer)
        online["vs_offline"] = online["output_tokens_per_s"] / offline_w1["output_tokens_per_s"]
        rows.append(online)
        pairs.append(_pair(offline_w1, online))
        for i in range(1, repeats):
            offline = _offline(engine, batches[i], f"W1 #{i + 1}", use_tqdm)
            on = _online(url, batches[i], warm_up_requests, online_concurrency, tokenizer)
            pairs.append(_pair(offline, on))
    result["online_vs_offline_pairs"] = pairs
    result["online_vs_offline_median"] = statistics.median(p["ratio"] for p in pairs)
    return result


def _pair(offline: dict[str, Any], online: dict[str, Any]) -> dict[str, float]:
    off, on = offline["output_tokens_per_s"], online["output_tokens_per_s"]
    return {"offline_tokens_per_s": off, "online_tokens_per_s": on, "ratio": on / off}


def format_suite(result: dict[str, Any]) -> str:
    """Return the suite's markdown table."""
    table = []
    for r in result["rows"]:
        share = f"{100 * r['matmul_share']:.0f}%" if "matmul_share" in r else "-"
        online = f"{r['vs_offline']:.2f}x offline W1" if "vs_offline" in r else ""
        table.append(
            [
                r["workload"], str(r["num_requests"]), fmt(r["elapsed_s"], digits=2),
                fmt(r["output_tokens_per_s"]), fmt(r["ttft_p50_s"], 1e3, 0),
                fmt(r["tpot_p50_s"], 1e3, 1), fmt(r.get("matmul_only_s"), digits=2), share, online,
            ]
        )  # fmt: skip
    headers = [
        "workload", "requests", "elapsed s", "output tok/s", "TTFT p50 ms", "TPOT p50 ms",
        "matmuls alone s", "share of matmul speed", "online",
    ]  # fmt: skip
    return (
        "## infer8 bench suite\n\n"
        "'matmuls alone': the model's projections and LM head timed on this machine at each "
        "step's token count, summed over the run's steps (attention and everything else "
        "excluded); 'share': that time over the elapsed time.\n\n"
        + markdown_table(headers, table)
        + _format_pairs(result.get("online_vs_offline_pairs", []))
    )


def _format_pairs(pairs: list[dict[str, float]]) -> str:
    if len(pairs) < 2:
        return ""
    each = ", ".join(
        f"{p['online_tokens_per_s']:.1f}/{p['offline_tokens_per_s']:.1f} = {p['ratio']:.2f}x"
        for p in pairs
    )
    median = statistics.median(p["ratio"] for p in pairs)
    return (
        f"\n\nOnline vs offline W1, {len(pairs)} alternating pairs (online/offline tok/s): "
        f"{each}; median {median:.2f}x.\n"
    )
