"""F.linear vs oneDNN-packed weights on this CPU, float32 or bf16, at the default model's shapes.

    python benchmarks/cpu_linear.py [--rounds 3] [--dtype bfloat16]

Each shape is timed both ways in alternating rounds (same process, same inputs); the table gives
the median GFLOP/s of each and their ratio. The shapes are SmolLM2-135M's projections (q/k/v,
o, gate/up, down) and its LM head at decode (32 rows) and prefill (4,096 rows) sizes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from infer8.worker.cpu_linear import PackedLinear

SHAPES = {  # name: (in_features, out_features)
    "qkv": (576, 960),
    "o": (576, 576),
    "gate_up": (576, 3072),
    "down": (1536, 576),
    "lm_head": (576, 49152),
}


def _time_s(fn, calls: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", default="1,8,32,64,4096")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}")
    print("| shape | rows | F.linear GFLOP/s | packed GFLOP/s | packed / F.linear |")
    print("|---|---|---|---|---|")
    for name, (k, n) in SHAPES.items():
        linear = torch.nn.Linear(k, n, bias=False).to(dtype)
        for m in (int(r) for r in args.rows.split(",")):
            if name == "lm_head" and m > 64:
                continue  # the LM head only sees the sampled rows
            x = torch.randn(m, k, dtype=dtype)
            packed = PackedLinear(linear, batch_hint=32)
            calls = max(2, int(2e9 / (2 * m * k * n)))
            plain_s, packed_s = [], []
            with torch.no_grad():
                for _ in range(args.rounds):
                    plain_s.append(_time_s(lambda x=x, w=linear.weight: F.linear(x, w), calls))
                    packed_s.append(_time_s(lambda x=x, p=packed: p(x), calls))
            flops = 2 * m * k * n
            a, b = (
                flops / statistics.median(plain_s) / 1e9,
                flops / statistics.median(packed_s) / 1e9,
            )
            print(f"| {name} {k}x{n} | {m} | {a:.0f} | {b:.0f} | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
