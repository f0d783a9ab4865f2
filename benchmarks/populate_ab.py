"""W1's timed engine steps with the KV cache's background populate gated on idle steps (the
default), running beside the steps (no gate), or off, each in its own process, alternated.

    python benchmarks/populate_ab.py --rounds 3

Prints, per run, the seconds spent in engine steps (warm-up excluded) and the populate thread's
CPU seconds meanwhile.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time


def one_run(mode: str, kv_bytes: int) -> dict[str, float]:
    import infer8.worker.worker as worker_module
    from infer8.bench import throughput as tp
    from infer8.bench.workload import LengthSpec
    from infer8.config import EngineArgs
    from infer8.engine import LLMEngine
    from infer8.worker.kv_populate import populate_in_background

    if mode == "off":
        worker_module.populate_in_background = lambda caches, gate=None: None
    elif mode == "beside":
        worker_module.populate_in_background = lambda caches, gate=None: populate_in_background(
            caches
        )
    args = EngineArgs(dtype="bfloat16", kv_cache_memory_bytes=kv_bytes, max_num_batched_tokens=4096)
    engine = LLMEngine(args)
    spec = LengthSpec.parse("128")
    requests = tp.make_requests(engine.tokenizer, 64, spec, spec, 0, engine.vocab_size)
    tp.warm_up(engine, requests)

    def populate_cpu_s() -> float:
        for thread in threading.enumerate():
            if thread.name == "infer8-kv-populate":
                with open(f"/proc/self/task/{thread.native_id}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, clock ticks
        return 0.0

    cpu0, busy = populate_cpu_s(), 0.0
    step = engine.step

    def timed_step():  # type: ignore[no-untyped-def]
        nonlocal busy
        start = time.perf_counter()
        out = step()
        busy += time.perf_counter() - start
        return out

    engine.step = timed_step  # type: ignore[method-assign]
    tp.run_workload(engine, requests, True, None, use_tqdm=False)
    return {"steps_s": round(busy, 3), "populate_cpu_s": round(populate_cpu_s() - cpu0, 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=4 << 30)
    p.add_argument("--modes", default="gate,beside,off")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one, args.kv_cache_memory_bytes)))
        return 0
    modes = args.modes.split(",")
    for rnd in range(args.rounds):
        for mode in modes[rnd % len(modes) :] + modes[: rnd % len(modes)]:
            cmd = [sys.executable, __file__, "--one", mode,
                   "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"round {rnd + 1} {mode}: steps {result['steps_s']} s, "
                  f"populate thread {result['populate_cpu_s']} CPU s", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
