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
import subprocess
import sys
import time
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
    argv = [sys.executable, "-m", "infer8.entrypoints.cli", "serve"]
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


def _online(
    args: EngineArgs, requests: list[BenchRequest], concurrency: int, tokenizer: Any
) -> dict[str, Any]:
    from infer8.bench.serve import ServeConfig, run_serve
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
        config = ServeConfig(base_url=url, max_concurrency=concurrency, ignore_eos=True)
        run_serve(config, requests[: min(4, len(requests))], tokenizer, use_tqdm=False)  # warm-up
        result = run_serve(config, requests, tokenizer, use_tqdm=False)
    finally:
        proc.terminate()
        proc.wait(60)
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
) -> dict[str, Any]:
    """Run the named offline workloads on one engine, then W1's requests online; return rows."""
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workloads {unknown}; choose from {sorted(WORKLOADS)}")
    engine = LLMEngine(args)
    rows, w1_requests = [], None
    for name in names:
        w = WORKLOADS[name].scaled(scale)
        requests = make_requests(
            engine.tokenizer, w.num_requests, w.input_len, w.output_len, seed, engine.vocab_size
        )
        rows.append(_offline(engine, requests, name, use_tqdm))
        if name == "W1":
            w1_requests = requests
    if online_concurrency:
        if w1_requests is None:
            w = WORKLOADS["W1"].scaled(scale)
            w1_requests = make_requests(
                engine.tokenizer, w.num_requests, w.input_len, w.output_len, seed, engine.vocab_size
            )
            rows.append(_offline(engine, w1_requests, "W1", use_tqdm))
        offline_w1 = next(r for r in rows if r["workload"] == "W1")
        tokenizer = engine.tokenizer
        del engine  # the server process loads its own copy
        online = _online(args, w1_requests, online_concurrency, tokenizer)
        online["vs_offline"] = online["output_tokens_per_s"] / offline_w1["output_tokens_per_s"]
        rows.append(online)
    return {"bench": "suite", "engine_args": dataclasses.asdict(args), "scale": scale, "rows": rows}


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
        "excluded); 'share': that time over the elapsed time.\n\n" + markdown_table(headers, table)
    )
