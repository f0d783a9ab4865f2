"""Serve in this process under tracemalloc, load it with soak.py, and diff heap snapshots.

    python benchmarks/heap_trace.py --duration-s 600 --every-s 120 [serve flags...]

Tells Python-heap growth (tracemalloc sees it) from allocator or native growth (RSS and glibc's
heap grow while tracemalloc stays flat). Every --every-s: RSS, tracemalloc's traced bytes,
glibc's mallinfo2 (bytes in use vs free in the heap), RSS before and after a malloc_trim(0)
(freed heap pages still resident since the server's last trim), object counts by type, and the
top allocation sites that grew since the first snapshot (taken after a warm-up). Serve flags default
to the soak's: a 256 MiB KV cache, --max-num-seqs 16, --max-waiting-requests 32.
A script's own folder, not the working directory, comes first on sys.path: where infer8 is
installed from another checkout, run it with PYTHONPATH=. to trace this one.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import ctypes.util
import gc
import os
import subprocess
import sys
import threading
import time
import tracemalloc
import weakref
from pathlib import Path

import uvicorn

from infer8.engine import LLMEngine
from infer8.entrypoints.openai.cli_args import make_serve_parser, serve_args_from
from infer8.entrypoints.openai.http_server import make_config
from infer8.entrypoints.openai.server import create_app

SOAK_DEFAULTS = ["--kv-cache-memory-bytes", str(256 << 20), "--max-num-seqs", "16"]
SOAK_DEFAULTS += ["--max-waiting-requests", "32", "--uvicorn-log-level", "warning"]


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
        "keepcost".split()
    ]


def mallinfo_mb() -> dict[str, float]:
    """Return glibc's heap in MB: arena (all), in use, free (empty where not glibc)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.mallinfo2.restype = MallInfo2
    except (OSError, AttributeError, TypeError):
        return {}
    info = libc.mallinfo2()
    return {
        "heap_mb": info.arena / 1e6,
        "in_use_mb": info.uordblks / 1e6,
        "free_mb": info.fordblks / 1e6,
        "mmap_mb": info.hblkhd / 1e6,
    }


def trim_report() -> str:
    """Call malloc_trim(0) and say how much RSS it gave back: what stayed resident in freed
    heap memory since the server's last trim (fragmentation), as opposed to memory in use."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):
        return "malloc_trim: not available"
    before_mb = rss_mb()
    start_s = time.perf_counter()
    trim(0)
    took_ms = 1e3 * (time.perf_counter() - start_s)
    after_mb = rss_mb()
    return f"malloc_trim(0): RSS {before_mb:.1f} -> {after_mb:.1f} MB in {took_ms:.1f} ms"


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1e3
    return 0.0


def type_counts() -> collections.Counter[str]:
    """Count live gc-tracked objects by type, and weak references by what they point to."""
    counts: collections.Counter[str] = collections.Counter()
    for o in gc.get_objects():
        counts[type(o).__qualname__] += 1
        if issubclass(type(o), weakref.ref):  # type(), not isinstance: no lazy __class__
            callback = getattr(o.__callback__, "__qualname__", None)
            counts[f"weakref to {type(o()).__qualname__} (callback {callback})"] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=600)
    parser.add_argument("--every-s", type=float, default=120)
    parser.add_argument("--warmup-s", type=float, default=60)
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--top", type=int, default=25)
    args, serve_argv = parser.parse_known_args()
    ns = make_serve_parser(prog="heap_trace").parse_args(SOAK_DEFAULTS + serve_argv)
    engine_args, server_config = serve_args_from(ns)
    sys.setswitchinterval(0.001)  # as run_server does
    engine = LLMEngine(engine_args)
    app = create_app(engine, server_config)
    server = uvicorn.Server(make_config(app, server_config, host="127.0.0.1", port=0))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    tracemalloc.start(args.frames)
    soak = Path(__file__).with_name("soak.py")
    load = subprocess.Popen(
        [sys.executable, str(soak), "--url", url, "--server-pid", str(os.getpid())]
        + ["--duration-s", str(args.duration_s + 30), "--max-rss-slope-mb-per-min", "1e9"],
        stdout=subprocess.DEVNULL,
    )
    try:
        time.sleep(args.warmup_s)
        gc.collect()
        base = tracemalloc.take_snapshot()
        base_types = type_counts()
        start = time.monotonic()
        report(0.0, base, base, base_types, base_types, args.top)
        while time.monotonic() - start < args.duration_s and load.poll() is None:
            time.sleep(args.every_s)
            gc.collect()
            snap = tracemalloc.take_snapshot()
            report(time.monotonic() - start, base, snap, base_types, type_counts(), args.top)
    finally:
        load.terminate()
        load.wait()
        server.should_exit = True
        thread.join(30)


def report(
    t_s: float,
    base: tracemalloc.Snapshot,
    snap: tracemalloc.Snapshot,
    base_types: collections.Counter[str],
    types: collections.Counter[str],
    top: int,
) -> None:
    traced_mb = tracemalloc.get_traced_memory()[0] / 1e6
    heap = " ".join(f"{k} {v:.1f}" for k, v in mallinfo_mb().items())
    print(f"\n=== t={t_s / 60:.1f} min  RSS {rss_mb():.1f} MB  traced {traced_mb:.1f} MB  {heap}")
    print(trim_report())
    grown = sorted(((n, types[n] - base_types.get(n, 0)) for n in types), key=lambda x: -x[1])[:10]
    print("objects grown:", ", ".join(f"{n} +{d}" for n, d in grown if d > 0))
    stats = snap.compare_to(base, "traceback")  # sorted by the size of the change, +/-
    grown_sites = sorted((s for s in stats if s.size_diff > 0), key=lambda s: -s.size_diff)
    for stat in grown_sites[:top]:
        frames = " <- ".join(
            f"{Path(f.filename).name}:{f.lineno}" for f in stat.traceback[-1:-6:-1]
        )
        print(f"{stat.size_diff / 1e3:+10.1f} kB {stat.count_diff:+7d}  {frames}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
