"""A layer's element-wise passes native (csrc/elementwise.c) against torch ops, in one process.

    python benchmarks/elementwise_ab.py                     # decode steps at batch 32
    python benchmarks/elementwise_ab.py --prefill 2048      # prefill steps of 2 x 2,048 tokens

Two engines (default model, float32, --kv-cache-dtype as given): one runs RMSNorm with the
residual add, RoPE and silu * up natively, the other the torch ops (its modules' kernels
cleared), stepping in turn. Decode: 32 requests of 128-token prompts, the median of --steps
steps each. Prefill: each engine prefills two prompts of N tokens in one step, --rounds times.
Prints each engine's median and their ratio, and whether both produced the same greedy tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.layers.elementwise import TorchElementwise
from infer8.sampling_params import SamplingParams


def _engine(kv: str, native: bool, batched_tokens: int) -> LLMEngine:
    engine = LLMEngine(
        EngineArgs(
            dtype="float32",
            kv_cache_dtype=kv,
            max_num_seqs=32,
            max_num_batched_tokens=batched_tokens,
            kv_cache_memory_bytes=1 << 30,
            enable_prefix_caching=False,
        )
    )
    if not native:
        engine.worker.model.set_elementwise_ops(TorchElementwise())
    return engine


def decode(kv: str, steps: int) -> None:
    params = SamplingParams(max_tokens=steps + 16, temperature=0.0, ignore_eos=True)
    engines = {name: _engine(kv, name == "native", 2048) for name in ("native", "torch")}
    tokens: dict[str, list[list[int]]] = {}
    for e in engines.values():
        for i in range(32):
            e.add_request([(i * 7 + j) % 30000 + 100 for j in range(128)], params)
        for _ in range(4):  # the prefill, then decodes
            e.step()
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(steps):
        for name, e in engines.items():
            t0 = time.perf_counter()
            outs = e.step()
            times[name].append(time.perf_counter() - t0)
            for o in outs:
                tokens.setdefault(name, []).append(list(o.outputs[0].token_ids))
    _report(times, tokens, "decode step at batch 32")


def prefill(kv: str, length: int, rounds: int) -> None:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engines = {name: _engine(kv, name == "native", 2 * length) for name in ("native", "torch")}
    times: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(rounds):
        for name, e in engines.items():
            for i in range(2):
                e.add_request(
                    [(r * 13 + i * 5 + j * 7) % 30000 + 100 for j in range(length)], params
                )
            t0 = time.perf_counter()
            while e.has_unfinished_requests():
                for o in e.step():
                    tokens.setdefault(name, []).append(list(o.outputs[0].token_ids))
            times[name].append(time.perf_counter() - t0)
    _report(times, tokens, f"prefill of 2 x {length} tokens")


def _report(times: dict[str, list[float]], tokens: dict[str, list[list[int]]], what: str) -> None:
    native, torch_ops = (statistics.median(times[n]) for n in ("native", "torch"))
    print(
        f"{what}: native {native * 1e3:.1f} ms, torch ops {torch_ops * 1e3:.1f} ms "
        f"({native / torch_ops:.3f}x); same greedy tokens: "
        f"{tokens.get('native') == tokens.get('torch')}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prefill", type=int, default=0, metavar="N", help="prefill 2 x N tokens")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.prefill:
        prefill(args.kv_cache_dtype, args.prefill, args.rounds)
    else:
        decode(args.kv_cache_dtype, args.steps)


if __name__ == "__main__":
    main()
