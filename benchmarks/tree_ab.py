"""This tree against an older checkout (and optionally vLLM's CPU build), W1 and W3, alternated round by round.

Each round runs every engine once per workload in a rotated order, so drift on a shared machine falls on all of
them alike; a figure is the median over rounds of a ratio taken within one round. The JSON is rewritten after every
run. Usage:

    git worktree add /tmp/base bc142df
    python benchmarks/tree_ab.py --base /tmp/base --rounds 6 --vllm-dir DIR --json tree_ab.json

`--vllm-dir` is the directory `../shared/tools/vllm-cpu-yardstick.sh DIR` installed vLLM into.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
WORKLOADS = {"W1": (64, 128, 128), "W3": (16, 2048, 64)}  # requests, prompt tokens, output tokens
YARDSTICK = HERE.parent / "shared" / "tools" / "vllm-cpu-yardstick.sh"
MODEL_DIR = Path.home() / ".cache" / "infer8" / "models" / "SmolLM2-135M-Instruct"


def source_root(tree: Path) -> Path:
    """Return the folder that holds a tree's infer8 package (src/ layout, or the tree itself)."""
    return tree / "src" if (tree / "src" / "infer8").is_dir() else tree


def infer8_command(tree: Path, args, workload: str, json_path: str) -> list[str]:
    n, inp, out = WORKLOADS[workload]
    package = source_root(tree) / "infer8"
    module = "infer8.cli" if (package / "cli.py").exists() else "infer8.entrypoints.cli"
    return [
        sys.executable,
        "-m",
        module,
        "bench",
        "throughput",
        "--dtype",
        args.dtype,
        "--kv-cache-memory-bytes",
        str(args.kv_cache_memory_bytes),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--kv-cache-dtype",
        args.kv_cache_dtype,
        "--disable-tqdm",
        "--num-requests",
        str(n),
        "--input-len",
        str(inp),
        "--output-len",
        str(out),
        "--json",
        json_path,
    ]


def run_infer8(tree: Path, args, workload: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.json")
        env = dict(os.environ, PYTHONPATH=str(source_root(tree)))
        done = subprocess.run(
            infer8_command(tree, args, workload, path),
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{tree} {workload} exited {done.returncode}:\n{done.stderr[-2000:]}"
            )
        with open(path) as f:
            data = json.load(f)
    return float(data.get("result", data)["output_tokens_per_s"])


def run_vllm(args, workload: str) -> float:
    n, inp, out = WORKLOADS[workload]
    cmd = [
        "bash",
        str(YARDSTICK),
        args.vllm_dir,
        "vllm",
        "bench",
        "throughput",
        "--model",
        str(args.model_dir),
        "--dataset-name",
        "random",
        "--num-prompts",
        str(n),
        "--random-input-len",
        str(inp),
        "--random-output-len",
        str(out),
        "--dtype",
        args.dtype,
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    found = re.search(r"Throughput: .*?([\d.]+) output tokens/s", done.stdout + done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(
            f"vllm {workload} exited {done.returncode}:\n{(done.stdout + done.stderr)[-2000:]}"
        )
    return float(found.group(1))


def ratios(runs: dict, a: str, b: str) -> list[float]:
    return [x / y for x, y in zip(runs[a], runs[b]) if x is not None and y is not None]


def summary(report: dict) -> dict:
    pairs = [("head", "base")] + (
        [("head", "vllm"), ("base", "vllm")] if report["engines"][-1] == "vllm" else []
    )
    out = {}
    for workload, runs in report["output_tokens_per_s"].items():
        for a, b in pairs:
            r = ratios(runs, a, b)
            if r:
                out[f"{workload} {a}/{b}"] = {
                    "median": round(statistics.median(r), 3),
                    "min": round(min(r), 3),
                    "max": round(max(r), 3),
                    "rounds": len(r),
                }
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, required=True, help="a checkout of the older commit")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--workloads", default="W1,W3")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=4 << 30)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--kv-cache-dtype", default="auto", help="infer8's trees only")
    p.add_argument(
        "--vllm-dir", default=None, help="where vllm-cpu-yardstick.sh installed vLLM (optional)"
    )
    p.add_argument(
        "--model-dir", type=Path, default=MODEL_DIR, help="the model directory vLLM loads"
    )
    p.add_argument("--timeout", type=int, default=1200)
    p.add_argument("--json", default="tree_ab.json")
    args = p.parse_args(argv)
    engines = ["head", "base"] + (["vllm"] if args.vllm_dir else [])
    trees = {"head": HERE, "base": args.base.resolve()}
    commits = {
        name: subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=t, capture_output=True, text=True
        ).stdout.strip()
        for name, t in trees.items()
    }
    workloads = args.workloads.split(",")
    report = {
        "commits": commits,
        "engines": engines,
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "order": [],
        "workloads": {w: "{} x {} / {}".format(*WORKLOADS[w]) for w in workloads},
        "output_tokens_per_s": {w: {e: [] for e in engines} for w in workloads},
    }
    for rnd in range(args.rounds):
        order = engines[rnd % len(engines) :] + engines[: rnd % len(engines)]
        for workload in workloads:
            for engine in order:
                tps = (
                    run_vllm(args, workload)
                    if engine == "vllm"
                    else run_infer8(trees[engine], args, workload)
                )
                report["output_tokens_per_s"][workload][engine].append(round(tps, 2))
                report["order"].append(f"{rnd + 1} {workload} {engine}")
                report["summary"] = summary(report)
                Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
                print(f"round {rnd + 1} {workload} {engine}: {tps:.1f} output tok/s", flush=True)
    for key, value in report["summary"].items():
        print(
            f"{key}: median {value['median']} ({value['min']}-{value['max']}, {value['rounds']} rounds)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
