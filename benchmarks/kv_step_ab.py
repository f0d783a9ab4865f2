"""Step times of KV-cache configurations side by side in one process (this machine drifts 10-30%).

    python benchmarks/kv_step_ab.py auto:0 fp8_e4m3:0 fp8_e4m3:24          # decode, batch 32
    python benchmarks/kv_step_ab.py --prefill-tokens 2048 auto:0 fp8_e4m3:24
    python benchmarks/kv_step_ab.py auto:0:gather auto:0 fp8_e4m3:24:gather fp8_e4m3:24

Each configuration is KV_DTYPE:TAIL_TOKENS[:gather] (`--kv-cache-exact-tail-tokens`; ignored for
16/32-bit caches); sinks and rotation stay on auto. `gather` turns off the fused native decode
attention (csrc/decode_attention.c) for that engine: blocks gathered into a buffer, then
batched matmuls, as before it. Decode: every engine holds 32 running requests of a
128-token prompt; the engines take one step each in turn, 40 times, and the median step is
printed with its ratio to the first configuration's. Prefill: each engine prefills one prompt
of N tokens in turn, 3 times; medians. float32 compute (`--dtype`), the default model.
"""

from __future__ import annotations

import argparse
import statistics
import time

from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.sampling_params import SamplingParams


def _engine(config: str, max_num_seqs: int, dtype: str = "float32") -> LLMEngine:
    kv, tail, *how = config.split(":")
    engine = LLMEngine(
        EngineArgs(
            dtype=dtype,
            kv_cache_dtype=kv,
            kv_cache_exact_tail_tokens=int(tail) if kv.startswith("fp8") else None,
            max_num_seqs=max_num_seqs,
            kv_cache_memory_bytes=1 << 29,
            enable_prefix_caching=False,
        )
    )
    if how == ["gather"]:
        native = engine.executor.driver_worker.attn_backend._native  # type: ignore[attr-defined]
        native.decode_supported = lambda *args: False  # this engine's instance only
    return engine


def decode(configs: list[str], steps: int = 40, dtype: str = "float32") -> list[float]:
    """Return each configuration's median decode step (seconds) at batch 32."""
    params = SamplingParams(max_tokens=steps + 16, temperature=0.0, ignore_eos=True)
    engines = []
    for c in configs:
        e = _engine(c, 32, dtype)
        for i in range(32):
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
    configs: list[str], num_tokens: int, rounds: int = 3, dtype: str = "float32"
) -> list[float]:
    """Return each configuration's median time to prefill one num_tokens prompt (seconds)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engines = [_engine(c, 8, dtype) for c in configs]
    times: list[list[float]] = [[] for _ in engines]
    for r in range(rounds):
        for e, ts in zip(engines, times):
            e.add_request([(r * 13 + j * 7) % 30000 + 100 for j in range(num_tokens)], params)
            t0 = time.perf_counter()
            while e.has_unfinished_requests():
                e.step()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def main() -> None:
    """Print one line per configuration."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+", help="KV_DTYPE:TAIL_TOKENS[:gather]")
    parser.add_argument("--prefill-tokens", type=int, default=0, help="time prefill instead")
    parser.add_argument("--dtype", default="float32", help="compute dtype (auto: bf16 on CPUs "
                        "with bf16 units)")  # fmt: skip
    ns = parser.parse_args()
    if ns.prefill_tokens:
        medians = prefill(ns.configs, ns.prefill_tokens, dtype=ns.dtype)
    else:
        medians = decode(ns.configs, dtype=ns.dtype)
    for config, m in zip(ns.configs, medians):
        print(f"{config}: {m * 1e3:.1f} ms ({m / medians[0]:.3f}x the first)", flush=True)


if __name__ == "__main__":
    main()
