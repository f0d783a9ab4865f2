"""What one engine-view viewer costs: output tokens/s with the console stream watched vs not.

One server (in this process, default model), one workload, rounds alternating between no viewer
and one viewer (a separate process reading /console/api/events, as a browser tab would), so
machine noise hits both sides alike. Prints a table and writes JSON.

    PYTHONPATH=$PWD python3 benchmarks/console_overhead.py --rounds 3 --json out/console.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.entrypoints.openai.cli_args import ServerConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.utils import start_server, stop_server  # noqa: E402

_VIEWER = """
import sys, httpx
n = 0
with httpx.stream("GET", sys.argv[1], timeout=None) as r:
    for line in r.iter_lines():
        if line == "event: step":
            n += 1
            if n % 10 == 0:
                print(n, flush=True)
"""


async def _workload(url: str, model: str, num_requests: int, max_tokens: int) -> float:
    """Run the requests concurrently; return output tokens per second."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def one(i: int) -> int:
            body = {
                "model": model,
                "prompt": f"Request {i}: tell a story about the number {i * 37 % 101}.",
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "temperature": 0.8,
                "seed": i,
            }
            response = await client.post("/v1/completions", json=body)
            response.raise_for_status()
            return int(response.json()["usage"]["completion_tokens"])

        start = time.perf_counter()
        num_tokens = sum(await asyncio.gather(*(one(i) for i in range(num_requests))))
        return num_tokens / (time.perf_counter() - start)


def recorder_cost() -> str:
    """Time the engine thread's share directly: 16 requests holding blocks of a 728-block cache."""
    from infer8.core.kv_cache_manager import KVCacheManager
    from infer8.entrypoints.console import StepRecorder
    from tests.unit.test_console_recorder import Clock, FakeEngine, _stats

    async def run() -> str:
        engine = FakeEngine()
        engine.num_blocks = 728
        engine.kv_cache_manager = KVCacheManager(728, 16, True)
        for i in range(16):
            engine.add(f"r{i}", list(range(i * 1000, i * 1000 + 300)), 300)
        clock = Clock()
        recorder = StepRecorder(engine, clock=clock)  # type: ignore[arg-type]
        stats = _stats(16, 16, tuple(f"r{i}" for i in range(16)))

        def per_call_s(n: int, dt_s: float) -> float:
            start = time.perf_counter()
            for _ in range(n):
                clock.now_s += dt_s
                recorder.on_step(stats)
            return (time.perf_counter() - start) / n

        idle_s = per_call_s(2000, 0.01)
        stream = recorder.stream(heartbeat_s=60)
        await stream.__anext__()
        await stream.__anext__()
        between_s = per_call_s(2000, 0.01)
        record_s = per_call_s(200, 0.2)
        await stream.aclose()  # type: ignore[attr-defined]
        return (
            f"engine thread: no viewer {idle_s * 1e6:.2f} us/step; one viewer "
            f"{between_s * 1e6:.1f} us/step between records, {record_s * 1e6:.0f} us per record"
        )

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="pairs of (no viewer, viewer) runs")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--recorder-cost-only", action="store_true")
    args = parser.parse_args()
    print(recorder_cost(), flush=True)
    if args.recorder_cost_only:
        return

    engine = LLMEngine(
        EngineArgs(
            model=None,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            max_num_seqs=args.max_num_seqs,
            kv_cache_dtype=args.kv_cache_dtype,
        )
    )
    server = start_server(engine, ServerConfig())
    model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    events_url = f"{server.url}/console/api/events"
    results: dict[str, list[float]] = {"none": [], "viewer": []}
    num_records: list[int] = []
    try:
        asyncio.run(_workload(server.url, model, args.num_requests, 8))  # warm-up
        for round_index in range(args.rounds):
            # Alternate which side goes first, so warm-up and drift fall on both alike.
            modes = ("none", "viewer") if round_index % 2 == 0 else ("viewer", "none")
            for mode in modes:
                viewer = None
                if mode == "viewer":
                    viewer = subprocess.Popen(
                        [sys.executable, "-c", _VIEWER, events_url],
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                    deadline = time.monotonic() + 30
                    while server_viewers(server) < 1:
                        assert time.monotonic() < deadline, "the viewer did not connect"
                        time.sleep(0.05)
                rate = asyncio.run(_workload(server.url, model, args.num_requests, args.max_tokens))
                results[mode].append(rate)
                if viewer is not None:
                    viewer.terminate()
                    out, _ = viewer.communicate(timeout=10)
                    counts = [int(x) for x in out.split()]
                    num_records.append(counts[-1] if counts else 0)
                print(f"{mode:>6}: {rate:8.1f} output tok/s", flush=True)
    finally:
        stop_server(server)
    none_median = statistics.median(results["none"])
    viewer_median = statistics.median(results["viewer"])
    change = 100 * (viewer_median / none_median - 1)
    # Each round's viewer run against the no-viewer run next to it: drift cancels in the ratio.
    pair_changes = [100 * (v / n - 1) for n, v in zip(results["none"], results["viewer"])]
    print()
    print("| viewers | output tok/s (median of runs) | runs |")
    print("|---|---|---|")
    print(f"| 0 | {none_median:.1f} | {', '.join(f'{r:.1f}' for r in results['none'])} |")
    print(f"| 1 | {viewer_median:.1f} | {', '.join(f'{r:.1f}' for r in results['viewer'])} |")
    print(
        f"\nper-round change: {', '.join(f'{c:+.1f}%' for c in pair_changes)}; "
        f"median {statistics.median(pair_changes):+.1f}%"
    )
    print(
        f"with one viewer: {change:+.1f}% output tokens/s; records received per run >= "
        f"{min(num_records) if num_records else 0}"
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "results": results,
            "change_percent": change,
            "pair_change_percent": pair_changes,
            "num_records_min": min(num_records, default=0),
        }
        args.json.write_text(json.dumps(payload, indent=2))


def server_viewers(server: object) -> int:
    """Return how many viewers the server's console has (read from its routes' recorder)."""
    engine = server.engine  # type: ignore[attr-defined]
    recorders = [log.__self__ for log in engine.stat_loggers if hasattr(log, "__self__")]
    return sum(r.num_viewers for r in recorders)


if __name__ == "__main__":
    main()
