"""The native CPU kernels of a git revision against this tree's, in one process, alternating.

    python benchmarks/native_kernel_ab.py --base ea45767                    # decode attention calls
    python benchmarks/native_kernel_ab.py --base ea45767 --engine           # engine decode steps
    python benchmarks/native_kernel_ab.py --base ea45767 --engine --prompt-len 2048 --batch 8
    python benchmarks/native_kernel_ab.py --base c4eae87 --engine --dtype auto   # bf16 compute

The base revision's infer8/csrc sources are compiled into a second library (git show, the same
flags). Kernel mode calls both libraries' decode attention in turn on the same paged cache
(contiguous blocks, 3 KV heads x GQA 3 x 64 dims, the default model's layer), reading a 64 MB
buffer before each call so that the cache comes from memory as in a model step, where the
weights evict it. Engine mode builds one engine per (KV dtype, library), float32 compute
(`--dtype`), and steps them in turn; it prints the median step and the time inside the decode attention calls.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from infer8.attention import cpu_native, native_build
from infer8.attention.kv_cache import KVCacheSpec, allocate_kv_cache
from infer8.attention.metadata import build_attention_metadata
from infer8.attention.torch_ref import TorchRefAttention
from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parent.parent


def base_library(rev: str, out: Path) -> Path:
    """Compile revision `rev`'s native sources; return the library."""
    src = out / "csrc"
    src.mkdir(parents=True, exist_ok=True)
    sources = []
    for path in (*native_build._SOURCES, *native_build._HEADERS):
        rel = path.relative_to(REPO).as_posix()
        text = subprocess.run(
            ["git", "show", f"{rev}:{rel}"], cwd=REPO, capture_output=True
        ).stdout  # a header the revision lacks: it does not include it either
        (src / path.name).write_bytes(text)
        if path in native_build._SOURCES:
            sources.append(src / path.name)
    saved = native_build._SOURCES
    native_build._SOURCES = tuple(sources)
    try:
        return native_build.build_library(out / "lib")
    finally:
        native_build._SOURCES = saved


def kernel(libs: dict[str, cpu_native.NativeFP8Gather], calls: int, dtype: str) -> None:
    """Kernel mode: float32 queries and cache, or (--dtype bfloat16 / auto) bf16 ones, and an
    E4M3 cache read by the same queries."""
    torch.manual_seed(0)
    q_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
    kvh, group, d, bs = 3, 3, 64, 16
    evict = torch.ones(16 << 20)
    cpu = torch.device("cpu")
    for batch, ctx in ((32, 170), (8, 2100), (32, 2100)):
        for cache_dtype in (q_dtype, torch.float8_e4m3fn):
            num_blocks = batch * -(-ctx // bs) + 1
            spec = KVCacheSpec(1, kvh, d, bs, cache_dtype)
            cache = allocate_kv_cache(spec, num_blocks, cpu)[0]
            ids = list(range(1, num_blocks))
            blocks = [ids[i * -(-ctx // bs) : (i + 1) * -(-ctx // bs)] for i in range(batch)]
            full = build_attention_metadata([ctx] * batch, [0] * batch, blocks, bs, cpu)
            k = torch.randn(full.num_real_tokens, kvh, d, dtype=q_dtype)
            TorchRefAttention().write_kv(cache, k, torch.randn_like(k), full.slot_mapping)
            meta = build_attention_metadata([1] * batch, [ctx - 1] * batch, blocks, bs, cpu)
            q = torch.randn(batch, kvh * group, d, dtype=q_dtype)
            lens = torch.full((batch,), ctx)
            times: dict[str, list[float]] = {name: [] for name in libs}
            for _ in range(calls):
                for name, lib in libs.items():
                    evict.sum()
                    t0 = time.perf_counter()
                    lib.decode_attention(q, cache, meta.decode_block_tables, lens, d**-0.5)
                    times[name].append(time.perf_counter() - t0)
            base, head = (statistics.median(times[n]) * 1e3 for n in ("base", "head"))
            print(
                f"batch {batch}, context {ctx}, {str(cache_dtype)[6:]} cache, {str(q_dtype)[6:]} "
                f"queries: base {base:.3f} ms, "
                f"this tree {head:.3f} ms per layer ({head / base:.2f}x)"
            )


def engine_steps(
    libs: dict[str, cpu_native.NativeFP8Gather],
    batch: int,
    prompt_len: int,
    steps: int,
    dtype: str = "float32",
) -> None:
    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    runs = []
    for kv in ("auto", "fp8_e4m3"):
        for name, lib in libs.items():
            engine = LLMEngine(
                EngineArgs(
                    dtype=dtype,
                    kv_cache_dtype=kv,
                    max_num_seqs=batch,
                    kv_cache_memory_bytes=max(1 << 29, batch * (prompt_len + steps + 80) * 50_000),
                    enable_prefix_caching=False,
                )
            )
            backend = engine.executor.driver_worker.attn_backend  # type: ignore[attr-defined]
            inside: list[float] = []

            def timed(_call, _out=inside):  # type: ignore[no-untyped-def]
                def call(*args, **kwargs):  # type: ignore[no-untyped-def]
                    t0 = time.perf_counter()
                    result = _call(*args, **kwargs)
                    _out.append(time.perf_counter() - t0)
                    return result

                return call

            backend._native = _Timed(lib, timed(lib.decode_attention), timed(lib.decode_layer))
            for i in range(batch):
                engine.add_request([(i * 7 + j) % 30000 + 100 for j in range(prompt_len)], params)
            for _ in range(-(-batch * prompt_len // 2048) + 2):  # the prefill, two decodes
                engine.step()
            runs.append((f"{kv} cache, {name}", engine, [], inside))
    for *_, inside in runs:
        inside.clear()  # the prefill's calls: time the decode steps' alone
    for _ in range(steps):
        for _, engine, times, _ in runs:
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
    for label, _, times, inside in runs:
        print(
            f"{label}: step {statistics.median(times) * 1e3:.1f} ms, "
            f"decode attention (layer) {sum(inside) / steps * 1e3:.1f} ms per step"
        )


class _Timed:
    """A library whose decode_attention and decode_layer are timed; every other call goes to
    the library."""

    def __init__(self, lib: cpu_native.NativeFP8Gather, decode_attention, decode_layer) -> None:  # type: ignore[no-untyped-def]
        self._lib = lib
        self.decode_attention = decode_attention
        self.decode_layer = decode_layer

    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self._lib(*args, **kwargs)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._lib, name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", required=True, help="git revision whose kernels are the baseline")
    p.add_argument("--engine", action="store_true", help="time engine decode steps")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--calls", type=int, default=60)
    p.add_argument("--dtype", default="float32", help="compute dtype (queries; engine mode)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = base_library(args.base, Path(tmp))
        if not hasattr(ctypes.CDLL(str(base)), "infer8_decode_layer"):
            raise SystemExit(f"--base {args.base} predates this tree's kernel set (decode_layer)")
        libs = {
            "base": cpu_native.NativeFP8Gather(base),
            "head": cpu_native.NativeFP8Gather(cpu_native.build_library()),
        }
        if args.engine:
            engine_steps(libs, args.batch, args.prompt_len, args.steps, args.dtype)
        else:
            kernel(libs, args.calls, args.dtype)


if __name__ == "__main__":
    main()
