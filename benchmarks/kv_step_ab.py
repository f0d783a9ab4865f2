"""Step times of KV-cache configurations side by side in one process (this machine drifts 10-30%).

    python benchmarks/kv_step_ab.py auto:0 fp8_e4m3:0 fp8_e4m3:24          # decode, batch 32
    python benchmarks/kv_step_ab.py --prefill-tokens 2048 auto:0 fp8_e4m3:24
    python benchmarks/kv_step_ab.py --dtype auto --batch 64 auto:0 fp8_e4m3:24 fp8_e4m3:0
    python benchmarks/kv_step_ab.py --dtype auto --prefill-tokens 128 --prefill-prompts 32 \
        auto:0 fp8_e4m3:24                                       # W1's prefill step
    python benchmarks/kv_step_ab.py --dtype auto --w1 6 --batch 64 auto:0 fp8_e4m3:24
    python benchmarks/kv_step_ab.py --dtype auto --w1 6 --interleave auto:0 fp8_e4m3:24

Each configuration is KV_DTYPE:TAIL_TOKENS (`--kv-cache-exact-tail-tokens`; ignored for
16/32-bit caches); sinks and rotation stay on auto. Decode: every engine holds 32 (`--batch`) running requests of
a 128-token prompt; the engines take one step each in turn, 40 times, and the median step is
printed with its ratio to the first configuration's. Prefill: each engine prefills one prompt
of N tokens (or `--prefill-prompts` of them, in one step) in turn, 3 times; medians. W1
(`--w1 ROUNDS`): each engine runs the issue's W1 (64 requests, 128-token prompts, 128 greedy
output tokens, ignore_eos, 4,096 batched tokens; `--batch` running at most) in turn, ROUNDS
times after a short warm-up, its cache faulted in first; medians and the median of each
round's ratio to the first configuration; `--interleave`: all engines run a round's W1 at
once, a step each in turn, each timed by the sum of its own steps (this machine's drift over
a run then falls on every configuration alike), with the same ratio per phase (the prefill
steps, the first 40 decode steps, the rest). float32 compute (`--dtype`), the default model.
"""

from __future__ import annotations

import argparse
import statistics
import time

from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.sampling_params import SamplingParams


def _engine(
    config: str, max_num_seqs: int, dtype: str = "float32", batched_tokens: int | None = None
) -> LLMEngine:
    kv, tail = config.split(":")[:2]
    engine = LLMEngine(
        EngineArgs(
            dtype=dtype,
            kv_cache_dtype=kv,
            kv_cache_exact_tail_tokens=int(tail) if kv.startswith("fp8") else None,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=batched_tokens,
            kv_cache_memory_bytes=1 << 29,
            enable_prefix_caching=False,
        )
    )
    return engine


def decode(
    configs: list[str], steps: int = 40, dtype: str = "float32", batch: int = 32
) -> list[float]:
    """Return each configuration's median decode step (seconds) at `batch`."""
    params = SamplingParams(max_tokens=steps + 16, temperature=0.0, ignore_eos=True)
    engines = []
    for c in configs:
        e = _engine(c, batch, dtype)
        for i in range(batch):
            e.add_request([(i * 7 + j) % 30000 + 100 for j in range(128)], params)
        for _ in range(6):  # the prefill steps and a few decodes
            e.step()
        engines.append(e)
    times: list[list[float]] = [[] for _ in engines]
    for _ in range(steps):
        for e, ts in zip(engines, times):
            t0 = time.perf_counter()
            e.step()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def prefill(
    configs: list[str], num_tokens: int, rounds: int = 3, dtype: str = "float32", prompts: int = 1
) -> list[float]:
    """Return each configuration's median time to prefill `prompts` prompts of num_tokens
    tokens (seconds): one step when they fit in max_num_batched_tokens (raised to them)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    batched = max(prompts * num_tokens, 2048)
    engines = [_engine(c, max(prompts, 8), dtype, batched) for c in configs]
    times: list[list[float]] = [[] for _ in engines]
    for r in range(rounds):
        for e, ts in zip(engines, times):
            for i in range(prompts):
                prompt = [(r * 13 + i * 131 + j * 7) % 30000 + 100 for j in range(num_tokens)]
                e.add_request(prompt, params)
            t0 = time.perf_counter()
            while e.has_unfinished_requests():
                e.step()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def w1(
    configs: list[str],
    rounds: int,
    max_num_seqs: int,
    dtype: str = "float32",
    interleave: bool = False,
    steps: list[list[list[float]]] | None = None,
) -> list[list[float]]:
    """Return each configuration's W1 times (seconds), one per round, engines in turn (or,
    with `interleave`, all of a round's runs at once, the engines taking a step each in turn:
    each time is the sum of its engine's steps, so a drift of the machine over a round falls
    on every configuration alike; `steps`, if given, gets each configuration's list of step
    times per round)."""
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    engines = [_engine(c, max_num_seqs, dtype, 4096) for c in configs]  # the W1
    for e in engines:
        populate = e.executor.driver_worker.kv_populate  # type: ignore[attr-defined]
        if populate is not None:
            populate.join()
    times: list[list[float]] = [[] for _ in engines]
    if steps is not None:
        steps[:] = [[] for _ in engines]
    for r in range(rounds + 1):  # round 0: a warm-up of 8 requests
        if interleave:
            for e in engines:
                for i in range(64 if r else 8):
                    e.add_request(
                        [(r * 131 + i * 7 + j * 13) % 30000 + 100 for j in range(128)], params
                    )
            spent: list[list[float]] = [[] for _ in engines]
            while any(e.has_unfinished_requests() for e in engines):
                for k, e in enumerate(engines):
                    if e.has_unfinished_requests():
                        t0 = time.perf_counter()
                        e.step()
                        spent[k].append(time.perf_counter() - t0)
            if r:
                for k, (ts, st) in enumerate(zip(times, spent)):
                    ts.append(sum(st))
                    if steps is not None:
                        steps[k].append(st)
            continue
        for e, ts in zip(engines, times):
            for i in range(64 if r else 8):
                e.add_request(
                    [(r * 131 + i * 7 + j * 13) % 30000 + 100 for j in range(128)], params
                )
            t0 = time.perf_counter()
            while e.has_unfinished_requests():
                e.step()
            if r:
                ts.append(time.perf_counter() - t0)
    return times


def _phases(steps: list[list[float]], base: list[list[float]]) -> str:
    """The median over rounds of a phase's time / the first configuration's, per phase of W1:
    its two prefill steps (64 prompts in 4,096-token steps; the second with 32 decodes), the
    next 40 steps (all decodes, contexts up to ~170) and the rest."""
    phases = {"prefill steps": (0, 2), "decode steps 3-42": (2, 42), "steps 43-": (42, None)}
    out = []
    for name, (a, b) in phases.items():
        ratios = [sum(s[a:b]) / sum(s0[a:b]) for s, s0 in zip(steps, base)]
        out.append(f"{name} {statistics.median(ratios):.3f}x")
    return ", ".join(out)


def main() -> None:
    """Print one line per configuration."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+", help="KV_DTYPE:TAIL_TOKENS")
    parser.add_argument("--prefill-tokens", type=int, default=0, help="time prefill instead")
    parser.add_argument("--dtype", default="float32", help="compute dtype (auto: bf16 on CPUs "
                        "with bf16 units)")  # fmt: skip
    parser.add_argument("--w1", type=int, default=0, metavar="ROUNDS", help="time W1 instead")
    parser.add_argument(
        "--interleave", action="store_true", help="W1: the engines' runs step by step in turn"
    )
    parser.add_argument("--prefill-prompts", type=int, default=1, help="prompts per prefill")
    parser.add_argument("--batch", type=int, default=0, help="decode batch (default 32) or "
                        "W1's max_num_seqs (default 64)")  # fmt: skip
    ns = parser.parse_args()
    if ns.w1:
        steps: list[list[list[float]]] = []
        runs = w1(ns.configs, ns.w1, ns.batch or 64, ns.dtype, ns.interleave, steps)
        first = statistics.median(runs[0])
        for k, (config, ts) in enumerate(zip(ns.configs, runs)):
            m = statistics.median(ts)
            pairs = statistics.median(t / t0 for t, t0 in zip(ts, runs[0]))
            print(f"{config}: W1 {m:.2f} s = {64 * 128 / m:.1f} output tok/s ({m / first:.3f}x "
                  f"the first's time; rounds {pairs:.3f}x) {' '.join(f'{t:.2f}' for t in ts)}",
                  flush=True)  # fmt: skip
            if k and ns.interleave:  # the same phases of each round, as ratios
                print("    " + _phases(steps[k], steps[0]), flush=True)
        return
    if ns.prefill_tokens:
        medians = prefill(ns.configs, ns.prefill_tokens, dtype=ns.dtype, prompts=ns.prefill_prompts)
    else:
        medians = decode(ns.configs, dtype=ns.dtype, batch=ns.batch or 32)
    for config, m in zip(ns.configs, medians):
        print(f"{config}: {m * 1e3:.1f} ms ({m / medians[0]:.3f}x the first)", flush=True)


if __name__ == "__main__":
    main()
