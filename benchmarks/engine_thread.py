"""Decode-step time on the main thread against a second thread, as the server runs the engine.

    python benchmarks/engine_thread.py              # 3 rounds of 8 steps per placement

One engine (default model, float32, batch 32, 128-token prompts) steps in turn on the main
thread, on a fresh thread after the main thread has computed (the server before
infer8/cpu_threads.py), and on a fresh thread after `release_openmp_workers()` (the server now).
Prints the median wall and thread-CPU time of a step for each placement.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

from infer8.config import EngineArgs
from infer8.cpu_threads import release_openmp_workers
from infer8.engine import LLMEngine
from infer8.sampling_params import SamplingParams

Timings = list[tuple[float, float]]  # (wall s, thread CPU s) per step


def _steps(engine: LLMEngine, num_steps: int, out: Timings) -> None:
    for _ in range(num_steps):
        wall_s, cpu_s = time.perf_counter(), time.thread_time()
        engine.step()
        out.append((time.perf_counter() - wall_s, time.thread_time() - cpu_s))


def _on_thread(run: Callable[[], None]) -> None:
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    engine = LLMEngine(
        EngineArgs(
            dtype="float32",
            max_num_seqs=32,
            kv_cache_memory_bytes=1 << 29,
            enable_prefix_caching=False,
        )
    )
    max_tokens = 8 + 3 * args.rounds * args.steps
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(32):
        engine.add_request([(i * 7 + j) % 30000 + 100 for j in range(128)], params)
    for _ in range(6):  # the prefill steps and a few decodes
        engine.step()
    placements: dict[str, Timings] = {"main": [], "thread": [], "thread, released": []}
    for _ in range(args.rounds):
        _steps(engine, args.steps, placements["main"])  # the main thread's pool exists now
        _on_thread(lambda: _steps(engine, args.steps, placements["thread"]))
        _steps(engine, 1, [])
        release_openmp_workers()
        _on_thread(lambda: _steps(engine, args.steps, placements["thread, released"]))
    print("| placement | step wall p50 | step thread CPU p50 |\n|---|---|---|")
    for name, timings in placements.items():
        wall_ms = 1e3 * statistics.median(t[0] for t in timings)
        cpu_ms = 1e3 * statistics.median(t[1] for t in timings)
        print(f"| {name} | {wall_ms:.1f} ms | {cpu_ms:.1f} ms |")


if __name__ == "__main__":
    main()
