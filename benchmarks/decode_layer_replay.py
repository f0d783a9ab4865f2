"""Time one native decode-layer call per KV-cache configuration, replayed, with caches flushed.

A decode step's time on these 2-core machines moves +-3% within a process and +-15% between
processes; a decode layer's native call (csrc/decode_attention.c: write, attention, tail
stores) is ~0.6 ms of it. This captures the last decode layer's call of each configuration's
engine (batch B, prompts of P tokens, a few decode steps in) and replays those calls in turn,
each after touching a buffer larger than the last-level cache (a model step's weights evict
the KV cache between layers, so the reads come from memory as in the engine). With --lib,
each configuration's call also runs under other builds of the native library (compile
another tree's infer8/kernels/cpu/csrc/*.c with build.py's flags), outputs compared with the first's.

    python benchmarks/decode_layer_replay.py --batch 64 auto fp8_e4m3:24 fp8_e4m3:0
    python benchmarks/decode_layer_replay.py auto fp8_e4m3:24 --lib /tmp/other.so

A configuration is KV_DTYPE[:TAIL_TOKENS[:SINK_TOKENS]] (auto or left out: the defaults).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from pathlib import Path

import torch

from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.kernels.cpu.decode import DecodeKernels
from infer8.kernels.cpu.library import NativeLibrary
from infer8.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("configs", nargs="+", help="KV_DTYPE[:TAIL[:SINKS]], the first the base")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="decode steps before the capture")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--flush-mib", type=int, default=48)
    parser.add_argument("--lib", action="append", default=[], help="another native build")
    parser.add_argument(
        "--cold-inputs",
        dest="warm_inputs",
        action="store_false",
        help="leave q / k / v and the metadata flushed too (by default they are read again)",
    )
    args = parser.parse_args()

    captured: dict[int, tuple] = {}
    current = [0]
    layer = DecodeKernels.decode_layer

    def capture(self, *a, **k):  # type: ignore[no-untyped-def]
        captured[current[0]] = (self, a, k)
        return layer(self, *a, **k)

    DecodeKernels.decode_layer = capture  # type: ignore[method-assign]
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, 30000) for _ in range(args.prompt_len)] for _ in range(args.batch)
    ]
    params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
    for i, config in enumerate(args.configs):
        kv, tail, sinks = (config.split(":") + ["auto", "auto"])[:3]
        fp8 = kv.startswith("fp8")
        engine = LLMEngine(
            EngineArgs(
                dtype="auto",
                kv_cache_dtype=kv,
                max_num_seqs=max(args.batch, 1),
                kv_cache_memory_bytes=1 << 30,
                kv_cache_exact_tail_tokens=int(tail) if fp8 and tail != "auto" else None,
                kv_cache_exact_sink_tokens=int(sinks) if fp8 and sinks != "auto" else None,
                max_num_batched_tokens=max(8192, args.batch * args.prompt_len),
                enable_prefix_caching=False,
            )
        )
        populate = engine.executor.driver_worker.kv_populate  # type: ignore[attr-defined]
        if populate is not None:  # a background thread faulting the cache in takes a core
            populate.join()
        current[0] = i
        for prompt in prompts:
            engine.add_request(prompt, params)
        for _ in range(args.steps):
            engine.step()
        assert i in captured, f"{config}: no native decode layer ran (not a CPU decode?)"
    DecodeKernels.decode_layer = layer  # type: ignore[method-assign]

    libs = {"this build": None} | {
        path: DecodeKernels(NativeLibrary(Path(path))) for path in args.lib
    }
    runs = [(i, name) for i in range(len(args.configs)) for name in libs]
    for i in range(len(args.configs)):
        self, a, k = captured[i]
        want = layer(self, *a, **k)
        for name, lib in libs.items():
            if lib is not None:
                got = layer(lib, *a, **k)
                same = torch.equal(got, want)
                print(f"{args.configs[i]} {name}: output {'identical' if same else 'differs'}")
    flush = torch.zeros(args.flush_mib << 20, dtype=torch.uint8)

    def inputs(a: tuple, k: dict) -> list[torch.Tensor]:  # type: ignore[type-arg]
        """The call's tensors other than the cache and its store: q / k / v, the table, the
        lengths, the slots and the step's tail metadata (read by every layer of a step)."""
        found: list[torch.Tensor] = []
        for x in (*a, *k.values()):
            if isinstance(x, torch.Tensor):
                found.append(x)
            elif dataclasses.is_dataclass(x) and not hasattr(x, "k_scale"):
                found += [t for t in vars(x).values() if isinstance(t, torch.Tensor)]
        return found

    times: dict[tuple[int, str], list[float]] = {run: [] for run in runs}
    order = list(runs)
    for _ in range(args.rounds):
        rng.shuffle(order)  # a call runs faster late in a round (measured): no fixed position
        for i, name in order:
            self, a, k = captured[i]
            flush.add_(1)
            if args.warm_inputs:
                for x in inputs(a, k):
                    x.sum()  # in cache again, as a step's projections and metadata are
            start = time.perf_counter()
            layer(libs[name] or self, *a, **k)
            times[(i, name)].append(time.perf_counter() - start)
    base = statistics.median(times[runs[0]])
    for i, name in runs:
        median = statistics.median(times[(i, name)])
        print(
            f"{args.configs[i]:>16} {name:>12}: {median * 1e6:7.1f} us "
            f"({median / base:.3f}x {args.configs[0]})"
        )


if __name__ == "__main__":
    main()
