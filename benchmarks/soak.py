"""Soak `infer8 serve` with mixed load and watch its memory (issue #18; a benchmark, not a test).

    python benchmarks/soak.py --duration-s 3600 [--model PATH] [--out soak.json] [--plot soak.png]

Clients (in this process, not the server's) send random prompts (10-400 tokens) for 1-200 output
tokens, streaming or not; 20% are cancelled part way; every 60 s a burst of 100 requests
overflows --max-waiting-requests. RSS of the server process and /metrics are sampled every 10 s.
At the end: failed requests other than the intended 503s, KV blocks still held, how flat RSS
stayed after warm-up (the first quarter of the run), and the RSS slope over the last half (least
squares, MB/min). Exits 1 when that slope is over --max-rss-slope-mb-per-min.

With --url and --server-pid it loads a server that is already running (one started with
`--max-waiting-requests 32`) instead of starting `infer8 serve`.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

WORDS = "the of and to in is was that for on with as by at from his her it an be this".split()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """Return one of /proc/PID/status's memory fields (VmRSS, RssAnon, RssFile) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def rss_slope_mb_per_min(samples: list[dict[str, float]]) -> float | None:
    """Return the least-squares slope of RSS over the last half of the samples, in MB/min."""
    if not samples:
        return None
    half_s = samples[-1]["t_s"] / 2
    points = [(s["t_s"] / 60, s["rss_mb"]) for s in samples if s["t_s"] >= half_s]
    if len(points) < 2:
        return None
    mean_t = sum(t for t, _ in points) / len(points)
    mean_rss = sum(r for _, r in points) / len(points)
    num = sum((t - mean_t) * (r - mean_rss) for t, r in points)
    den = sum((t - mean_t) ** 2 for t, _ in points)
    return num / den if den > 0 else None


def plot_rss(samples: list[dict[str, float]], path: str) -> None:
    """Plot RSS over the run, with the least-squares line of its last half."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot([s["t_s"] / 60 for s in samples], [s["rss_mb"] for s in samples], label="RSS")
    slope = rss_slope_mb_per_min(samples)
    if slope is not None:
        half = [s for s in samples if s["t_s"] >= samples[-1]["t_s"] / 2]
        mean_t = sum(s["t_s"] / 60 for s in half) / len(half)
        mean_rss = sum(s["rss_mb"] for s in half) / len(half)
        ends = [half[0]["t_s"] / 60, half[-1]["t_s"] / 60]
        fit = [mean_rss + slope * (t - mean_t) for t in ends]
        ax.plot(ends, fit, "--", label=f"last half: {slope:+.2f} MB/min")
        ax.legend(loc="best")
    ax.set_xlabel("minutes")
    ax.set_ylabel("server RSS (MB)")
    ax.set_title("infer8 serve under mixed load (soak)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def metric(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


class Counts:
    """Thread-safe tallies of what the clients saw."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: dict[str, int] = {}

    def add(self, key: str) -> None:
        with self.lock:
            self.values[key] = self.values.get(key, 0) + 1


def client_loop(url: str, stop: threading.Event, counts: Counts, seed: int) -> None:
    rng = random.Random(seed)
    with httpx.Client(timeout=300) as client:
        while not stop.is_set():
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 400)))
            body = {"prompt": prompt, "max_tokens": rng.randint(1, 200), "temperature": 0.8}
            cancel = rng.random() < 0.2
            try:
                if rng.random() < 0.5:
                    body["stream"] = True
                    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                        if r.status_code != 200:
                            counts.add(f"status_{r.status_code}")
                            continue
                        for i, _ in enumerate(r.iter_lines()):
                            if cancel and i >= 3:
                                break
                    counts.add("cancelled" if cancel else "ok")
                else:
                    timeout = rng.uniform(0.2, 2.0) if cancel else 300
                    r = client.post(f"{url}/v1/completions", json=body, timeout=timeout)
                    counts.add("ok" if r.status_code == 200 else f"status_{r.status_code}")
            except httpx.TimeoutException:
                counts.add("cancelled")
            except httpx.TransportError as e:
                counts.add(f"transport_{type(e).__name__}")


def burst(url: str, counts: Counts, num: int = 100) -> None:
    def one() -> None:
        try:
            r = httpx.post(
                f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 8}, timeout=60
            )
            counts.add("burst_ok" if r.status_code == 200 else f"burst_{r.status_code}")
        except httpx.TransportError as e:
            counts.add(f"burst_transport_{type(e).__name__}")

    threads = [threading.Thread(target=one) for _ in range(num)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--duration-s", type=float, default=3600)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--sample-s", type=float, default=10)
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument(
        "--max-rss-slope-mb-per-min",
        type=float,
        default=1.0,
        help="exit 1 when RSS grows faster than this over the last half of the run",
    )
    parser.add_argument("--url", default=None, help="load this running server instead")
    parser.add_argument("--server-pid", type=int, default=None, help="its process id (RSS)")
    args = parser.parse_args()
    if (args.url is None) != (args.server_pid is None):
        parser.error("--url and --server-pid go together")
    proc: subprocess.Popen[bytes] | None = None
    if args.url is not None:
        url, server_pid = args.url.rstrip("/"), args.server_pid
    else:
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "infer8.cli", "serve"]
        argv += [args.model] if args.model else []
        argv += ["--host", "127.0.0.1", "--port", str(port), "--uvicorn-log-level", "warning"]
        argv += ["--kv-cache-memory-bytes", str(256 << 20), "--max-num-seqs", "16"]
        argv += ["--max-waiting-requests", "32"]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        server_pid = proc.pid
    deadline = time.monotonic() + 300
    while True:
        assert proc is None or proc.poll() is None, "server exited"
        assert time.monotonic() < deadline, "server did not start"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.3)
    stop = threading.Event()
    counts = Counts()
    clients = [
        threading.Thread(target=client_loop, args=(url, stop, counts, i), daemon=True)
        for i in range(args.clients)
    ]
    for t in clients:
        t.start()
    samples = []
    start = time.monotonic()
    next_burst = start + 60
    try:
        while time.monotonic() - start < args.duration_s:
            time.sleep(args.sample_s)
            text = httpx.get(f"{url}/metrics", timeout=30).text
            samples.append(
                {
                    "t_s": round(time.monotonic() - start, 1),
                    "rss_mb": rss_bytes(server_pid) / 1e6,
                    "rss_anon_mb": rss_bytes(server_pid, "RssAnon") / 1e6,
                    "rss_file_mb": rss_bytes(server_pid, "RssFile") / 1e6,
                    "running": metric(text, "vllm:num_requests_running"),
                    "waiting": metric(text, "vllm:num_requests_waiting"),
                    "kv_usage": metric(text, "vllm:kv_cache_usage_perc"),
                    "generation_tokens": metric(text, "vllm:generation_tokens_total"),
                }
            )
            print(json.dumps(samples[-1]), flush=True)
            if time.monotonic() > next_burst:  # in its own thread: sampling goes on meanwhile
                threading.Thread(target=burst, args=(url, counts), daemon=True).start()
                next_burst += 60
        stop.set()
        for t in clients:
            t.join(timeout=120)
        time.sleep(2)
        final = httpx.get(f"{url}/metrics", timeout=30).text
        kv_usage_end = metric(final, "vllm:kv_cache_usage_perc")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
    warm = [s["rss_mb"] for s in samples if s["t_s"] >= args.duration_s / 4]
    result = {
        "duration_s": args.duration_s,
        "counts": counts.values,
        "rss_mb_first": samples[0]["rss_mb"] if samples else None,
        "rss_mb_after_warmup_min": min(warm) if warm else None,
        "rss_mb_after_warmup_max": max(warm) if warm else None,
        "rss_growth_after_warmup_pct": 100 * (max(warm) / min(warm) - 1) if warm else None,
        "rss_slope_last_half_mb_per_min": rss_slope_mb_per_min(samples),
        "kv_cache_usage_at_end": kv_usage_end,
        "samples": samples,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    if args.plot and samples:
        plot_rss(samples, args.plot)
    slope = result["rss_slope_last_half_mb_per_min"]
    if slope is not None and slope > args.max_rss_slope_mb_per_min:
        print(
            f"RSS grew {slope:.2f} MB/min over the last half of the run "
            f"(limit {args.max_rss_slope_mb_per_min} MB/min)",
            file=sys.stderr,
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
