"""Time a decode step's LoRA products per layer: the CPU kernel (csrc/lora.c) against the
batched torch matmuls, for one adapter and for four mixed, at the default model's shapes.

    python benchmarks/lora_products.py [--tokens 64] [--rank 16] [--repeats 200]

Prints microseconds per projection and per layer (the four projections) for each path;
activations bf16 (the CPU kernel reads float32 slots, the matmuls bf16 ones).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from infer8.kernels.cpu import NativeKernels
from infer8.lora.slots import FUSED_MODULES, LoRASlots, LoRAStep, build_mapping
from infer8.models.llama import LlamaArchConfig
from infer8.models.loader import read_hf_config, resolve_model_path


def _time_us(fn: Callable[[], None], repeats: int) -> float:
    for _ in range(20):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=200)
    ns = parser.parse_args()
    native = NativeKernels.load()
    assert native is not None, "the CPU kernels need a C compiler"
    arch = LlamaArchConfig.from_hf_config(read_hf_config(Path(resolve_model_path(None))))
    cpu = torch.device("cpu")
    slots = LoRASlots(arch, 4, ns.rank, torch.bfloat16, cpu, with_float32=True)
    for buf in slots.buffers():
        buf.normal_()
    slots.slot_ranks = [ns.rank] * 4
    widths = {"qkv": arch.hidden_size, "o": arch.num_attention_heads * arch.head_dim,
              "gate_up": arch.hidden_size, "down": arch.intermediate_size}  # fmt: skip
    for name, token_slots in (("1 adapter", np.zeros(ns.tokens, np.int64)),
                              ("4 adapters", np.arange(ns.tokens) % 4)):  # fmt: skip
        kernel = LoRAStep(
            slots, build_mapping(token_slots, cpu, torch.float32, ns.rank, native=True),
            native=native.elementwise,
        )  # fmt: skip
        matmuls = LoRAStep(slots, build_mapping(token_slots, cpu, torch.bfloat16, ns.rank))
        totals = [0.0, 0.0]
        for fused in FUSED_MODULES:
            x = torch.randn(ns.tokens, widths[fused], dtype=torch.bfloat16)
            y = torch.randn(ns.tokens, int(slots.cols[fused][-1]), dtype=torch.bfloat16)
            times = [
                _time_us(lambda s=step, f=fused, a=x, b=y: s.add(f, 0, a, b), ns.repeats)
                for step in (kernel, matmuls)
            ]
            totals = [t + u for t, u in zip(totals, times)]
            print(f"{name:10} {fused:8} kernel {times[0]:7.1f} us   matmuls {times[1]:7.1f} us")
        print(f"{name:10} {'layer':8} kernel {totals[0]:7.1f} us   matmuls {totals[1]:7.1f} us")


if __name__ == "__main__":
    main()
