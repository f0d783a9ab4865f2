"""One prepared GPU run (< 8 minutes on an H100/H200): is the GPU path right, and fast?

0. `pytest tests/gpu` (kernels and CUDA graphs against the reference), then an engine smoke
   test on a small random-weight model: greedy tokens with CUDA graphs == eager == the CPU
   reference (float32), CUDA graphs == eager with the FP8 cache's exact tail and rotation, a
   prefix-cache hit, and TP=2 == TP=1 when two GPUs are present;
   the start-up memory profile: one engine at --gpu-memory-utilization 0.94 with no
   --kv-cache-memory-bytes, its split (weights, activations, graph reserve, others, KV), and
   device use after its heaviest steps within the budget;
   FP8 vs bf16, teacher-forced through the engine: the FP8 cache with and without the exact
   tail, and --quantization fp8 weights, each within a stated KL / top-1 bound;
   sampling on the device: seeds reproduce, top-k / top-p / min-p supports hold, penalties
   equal the CPU sampler's (gpu_check_engine.py; the CPU tests run these sections too);
1. kernels vs the PyTorch reference on the GPU (ragged mixed batches, contexts up to 32K,
   GQA 1/4/7/8 with 1, 2 and 4 KV heads, head_dim 64/128, bf16/fp16/fp8-e4m3/fp8-e5m2 caches,
   dynamic and static scales, rotated keys, write bit-exactness);
2. the device's copy bandwidth (read + write) and a read-only sum;
3. decode attention at batch 64 x 4K and 16 x 32K contexts (Llama-3-8B's 32 query / 8 KV
   heads, d 128) for bf16 and fp8 caches, at the engine's default kernel config (ten launches
   back to back per timing; a small sweep of tile and split settings beside it): targets
   fp8 >= FP8_MIN_SPEEDUP x faster than bf16 at both shapes, fp8 moving the roofline model's
   bytes (infer8.attention.decode_roofline) at >= MIN_COPY_SHARE of copy bandwidth, rotated
   keys (the FP8 default) within ROTATION_MAX_OVERHEAD of plain fp8 and faster than bf16 on a
   Qwen2-72B rank under TP 8 (1 KV head, group 8); torch's flash SDPA over a contiguous bf16
   cache as the yardstick, and each decode kernel's registers and spills in the JSON;
4. end-to-end decode of a Qwen2-7B-shaped model with random weights at batch 64 x 4K: bf16 vs
   fp8 cache (plain and rotated), eager vs CUDA graphs (whose greedy tokens must match), then
   FP8 weights.

No network, no checkpoint. Prints markdown tables and writes JSON (--out) after every section.
Each section catches its own failure and the run continues; a watchdog kills a section that
hangs (the JSON so far stays), and a time budget skips what would not fit. Every check that
misses its bound fails its section; the exit code is 1 on any failed, hung or skipped section.

    python benchmarks/gpu_check.py --out gpu_check.json
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the engine sections beside this file
from gpu_check_engine import (  # noqa: E402
    agreement_failure,  # noqa: F401 - the CPU tests reach it here
    engine_smoke,
    fp8_agreement,
    memory_split,
    sampling,
)

RESULTS: dict[str, Any] = {"sections": {}, "errors": {}}
GB = 1e9
# Decode kernels take tens of microseconds: time this many launches back to back per event.
DECODE_CALLS_PER_EVENT = 10
# FP8 decode must beat bf16's time by this much at the engine's default kernel config, and
# read its KV at this share of the measured copy bandwidth.
FP8_MIN_SPEEDUP = 1.7
MIN_COPY_SHARE = 0.65
# Rotated keys (the FP8 default) may cost this much decode-kernel time over plain FP8.
ROTATION_MAX_OVERHEAD = 1.15


def _log(msg: str) -> None:
    print(msg, flush=True)


def _time_ms(
    fn: Callable[[], object], iters: int = 20, warmup: int = 3, per_event: int = 1
) -> float:
    """Return the median time of fn() in ms, measured with CUDA events.

    per_event > 1: each event pair brackets that many calls back to back (the median of their
    mean), so a kernel shorter than Python's launch gap is timed on the GPU, not the host.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(per_event):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / per_event)
    return statistics.median(times)


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


# -- 1. correctness ----------------------------------------------------------------------------


def _fill_cache(cache: Any, seed: int) -> None:
    """Fill a cache with random K/V (and sane FP8 scales) without going through write_kv."""
    gen = torch.Generator(device=cache.k.device).manual_seed(seed)
    for t in (cache.k, cache.v):
        for i in range(t.shape[0]):  # one KV head at a time keeps the fp32 temporary small
            x = torch.randn(t[i].shape, generator=gen, device=t.device)
            t[i].copy_((x * (20.0 if t.element_size() == 1 else 1.0)).to(t.dtype))
    for s in (cache.k_scale, cache.v_scale):
        if s is not None:
            s.copy_((torch.rand(s.shape, generator=gen, device=s.device) * 0.04 + 0.01).to(s.dtype))


def check_kernels(
    device: torch.device, max_context: int = 32768, only: slice | None = None
) -> dict[str, Any]:
    """Compare the Triton write and attention with the reference's on the GPU.

    only: a slice of the case list (a quick run under TRITON_INTERPRET=1 on CPU).
    """
    from infer8.attention import reference
    from infer8.attention.kv_cache import KVCacheSpec, allocate_kv_cache
    from infer8.attention.metadata import build_attention_metadata
    from infer8.attention.triton import launch
    from infer8.attention.triton.backend import TritonAttention

    rel_tol = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3}
    rows, failures = [], []
    block_size = 16
    gen = torch.Generator().manual_seed(0)
    cache_dtypes = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
    # every dtype x GQA 1/4/7 at d 128 over 4 KV heads, d 64 for two dtypes, static scales;
    # Qwen2-72B's group of 8 with 1 and 2 KV heads (a rank's share under TP 8 / 4), rotated too
    cases = [(dt, g, 128, "dynamic", 4) for dt in cache_dtypes for g in (1, 4, 7)]
    cases += [(torch.bfloat16, 4, 64, "dynamic", 4), (torch.float8_e4m3fn, 7, 64, "dynamic", 4)]
    cases += [(torch.float8_e4m3fn, 4, 128, s, 4) for s in ("head", "channel", "rotated")]
    cases += [(dt, 8, 128, "dynamic", kvh) for dt in cache_dtypes[::2] for kvh in (1, 2)]
    cases += [(torch.float8_e4m3fn, 8, 128, "rotated", kvh) for kvh in (1, 2)]
    cases = cases[only] if only is not None else cases
    for cache_dtype, group, head_dim, static, num_kv_heads in cases:
        model_dtype = torch.float16 if cache_dtype == torch.float16 else torch.bfloat16
        # 12 decodes over 1..max_context tokens of context (the longest among them), 3 chunked
        # prefills, 1 fresh prompt
        computed = [int(x) for x in torch.randint(0, max_context, (11,), generator=gen)]
        computed.append(max_context - 1)
        computed += [0, max_context // 4, max_context // 2, 31]
        query_lens = [1] * 12 + [257, 64, 300, 1]
        seq_lens = [c + q for c, q in zip(computed, query_lens)]
        num_blocks = sum(-(-n // block_size) for n in seq_lens) + 1
        perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 unused
        block_ids = []
        for n in seq_lens:
            k = -(-n // block_size)
            block_ids.append(perm[:k])
            perm = perm[k:]
        is_static = static in ("head", "channel")
        spec = KVCacheSpec(1, num_kv_heads, head_dim, block_size, cache_dtype,
                           hadamard=static == "rotated",
                           kv_scale="static" if is_static else "dynamic")  # fmt: skip
        scales = None
        if is_static:
            shape = (num_kv_heads, 1) if static == "head" else (num_kv_heads, head_dim)
            k_s, v_s = (torch.rand(shape, device=device) * 0.01 + 0.005 for _ in range(2))
            scales = ([k_s], [v_s])
        cache = allocate_kv_cache(spec, num_blocks, device, static_scales=scales)[0]
        full = build_attention_metadata(
            seq_lens, [0] * len(seq_lens), block_ids, block_size, device
        )
        kv = torch.randn(2, full.num_real_tokens, num_kv_heads, head_dim, device=device)
        kv = kv.to(model_dtype)
        tri = TritonAttention(device)
        # write: the kernel must store exactly what the reference stores
        ref_cache = allocate_kv_cache(spec, num_blocks, device, static_scales=scales)[0]
        reference.write_kv(ref_cache, kv[0], kv[1], full.slot_mapping)
        launch.write_kv(cache, kv[0], kv[1], full.slot_mapping)
        write_exact = all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for a, b in ((cache.k, ref_cache.k), (cache.v, ref_cache.v))
        ) and (
            cache.k_scale is None
            or (
                torch.equal(cache.k_scale, ref_cache.k_scale)
                and torch.equal(cache.v_scale, ref_cache.v_scale)
            )
        )
        meta = build_attention_metadata(query_lens, computed, block_ids, block_size, device)
        q = torch.randn(meta.num_real_tokens, num_kv_heads * group, head_dim, device=device)
        q = q.to(model_dtype)
        want = reference.attend_cache(q, ref_cache, meta, head_dim**-0.5)
        nan = torch.full_like(q, float("nan"))
        got = tri.attend(q, cache, tri.build_metadata(meta), head_dim**-0.5, out=nan)
        finite = bool(torch.isfinite(got).all())
        rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
        ok = finite and write_exact and rel <= rel_tol[model_dtype]
        name = (f"{str(cache_dtype).removeprefix('torch.')} kvh{num_kv_heads} g{group} "
                f"d{head_dim} {static}")  # fmt: skip
        rows.append([name, write_exact, finite, rel, "ok" if ok else "FAIL"])
        if not ok:
            failures.append(name)
    _log(f"\n## Kernels vs reference (GPU), contexts up to {max_context}\n")
    _log(_table(["case", "write bit-exact", "finite", "rel. error", ""], rows))
    if failures:
        raise AssertionError(f"kernels differ from the reference: {failures}")
    return {"cases": rows, "failures": failures, "passed": not failures}


# -- 2. bandwidth --------------------------------------------------------------------------


def copy_bandwidth(device: torch.device, num_bytes: int = 4 << 30) -> dict[str, float]:
    """Measure device copy (read + write) and read-only bandwidth in GB/s."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    words = src.view(torch.float32)
    copy_ms = _time_ms(lambda: dst.copy_(src), iters=10)
    read_ms = _time_ms(lambda: words.sum(), iters=10)
    out = {
        "copy_gb_per_s": 2 * num_bytes / (copy_ms / 1e3) / GB,
        "read_gb_per_s": num_bytes / (read_ms / 1e3) / GB,
        "bytes": num_bytes,
    }
    _log("\n## Device bandwidth\n")
    _log(
        _table(
            ["copy (read+write) GB/s", "read-only sum GB/s"],
            [[out["copy_gb_per_s"], out["read_gb_per_s"]]],
        )
    )
    return out


def _time_decode(
    device: torch.device,
    kv_dtype: torch.dtype,
    batch: int,
    context: int,
    configs: list[Any],
    sweep: bool,
    num_kv_heads: int = 8,
    group: int = 4,
    rotated: bool = False,
) -> dict[str, Any]:
    """Time paged_decode_attention on one cache dtype; return the best config's numbers."""
    from infer8.attention.decode_roofline import decode_cost
    from infer8.attention.kv_cache import KVCacheSpec, allocate_kv_cache
    from infer8.attention.triton import launch as triton_launch

    head_dim, block_size = 128, 16
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    num_blocks = batch * context // block_size
    spec = KVCacheSpec(1, num_kv_heads, head_dim, block_size, kv_dtype, hadamard=rotated)
    cache = allocate_kv_cache(spec, num_blocks, device)[0]
    _fill_cache(cache, seed=1)
    table = torch.randperm(num_blocks, device=device).view(batch, -1)  # scattered blocks
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    token_idx = torch.arange(batch, device=device)
    q = torch.randn(batch, num_kv_heads * group, head_dim, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * cache.k.element_size()
    if cache.k_scale is not None:
        kv_bytes += 2 * batch * context * num_kv_heads * cache.k_scale.element_size()
    heuristic = triton_launch.choose_num_splits(num_kv_heads, sms)
    splits = sorted({heuristic, 1, 8, 16, 64}) if sweep else [heuristic]
    timings = []
    for cfg in configs:
        for num_splits in splits:

            def call(cfg: Any = cfg, num_splits: int = num_splits) -> None:
                triton_launch.paged_decode_attention(
                    q, cache, out, token_idx, seq_lens, table, head_dim**-0.5, num_splits, cfg
                )

            label = (
                f"n{cfg.decode_block_n} w{cfg.decode_num_warps} s{cfg.decode_num_stages} "
                f"min{cfg.decode_min_split_tokens} splits{num_splits}"
            )
            timings.append((_time_ms(call, per_event=DECODE_CALLS_PER_EVENT), label))
    ms, label = min(timings)
    default_ms = timings[splits.index(heuristic)][0]  # the first config, default splits
    return {
        "ms": ms,
        "gb_per_s": kv_bytes / (ms / 1e3) / GB,
        "config": label,
        "kv_bytes": kv_bytes,
        "heuristic_splits": heuristic,
        # the roofline model at the heuristic's splits (infer8/attention/decode_roofline.py)
        "model_at_heuristic": dataclasses.asdict(
            decode_cost(
                batch,
                num_kv_heads * group,
                num_kv_heads,
                head_dim,
                context,
                heuristic,
                cache.k.element_size(),
                cache.k_scale.element_size() if cache.k_scale is not None else 0,
                rotated=rotated,
            )
        ),
        "first_config_heuristic_ms": default_ms,
        "all": timings,
    }


def build_layer_decode(
    device: torch.device, batch: int, context: int, kv_dtype: torch.dtype, exact_tail: bool,
    num_kv_heads: int = 8, group: int = 4,
) -> Callable[[], torch.Tensor]:  # fmt: skip
    """Return one layer's decode attention as a step runs it: TritonAttention.write_and_attend.

    exact_tail: the FP8 default (24-token exact tail, 4 sinks, rotated keys), so the call
    includes the step's residuals, the tail-reading kernels and the ring write.
    """
    from infer8.attention.exact_tail import (
        DEFAULT_EXACT_SINK_TOKENS,
        DEFAULT_EXACT_TAIL_TOKENS,
        build_tail_metadata,
    )
    from infer8.attention.kv_cache import KVCacheSpec, allocate_kv_cache
    from infer8.attention.metadata import build_attention_metadata
    from infer8.attention.triton.backend import TritonAttention

    head_dim, block_size = 128, 16
    window = DEFAULT_EXACT_TAIL_TOKENS if exact_tail else 0
    sinks = DEFAULT_EXACT_SINK_TOKENS if exact_tail else 0
    spec = KVCacheSpec(1, num_kv_heads, head_dim, block_size, kv_dtype, window, sinks,
                       hadamard=exact_tail)  # fmt: skip
    blocks_per_seq = -(-(context + 1) // block_size)
    cache = allocate_kv_cache(spec, batch * blocks_per_seq, device, batch if window else 0)[0]
    _fill_cache(cache, seed=3)
    for t in cache.tail_store or ():  # residuals of 0 (empty memory could hold NaN bit patterns)
        t.zero_()
    block_ids = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    meta = build_attention_metadata([1] * batch, [context] * batch, block_ids, block_size, device)
    if window:
        # sequence i: row i, exact from position 0, writing its sinks into slot i
        sink_slots = [(i, True) if sinks else (-1, False) for i in range(batch)]
        meta.tail = build_tail_metadata(
            window, sinks, list(range(batch)), [0] * batch, sink_slots,
            [1] * batch, [context] * batch, meta.decode_seq_ids,
            meta.decode_block_tables.shape[1] * block_size, device,
        )  # fmt: skip
    backend = TritonAttention(device)
    step = backend.build_metadata(meta)
    q = torch.randn(batch, num_kv_heads * group, head_dim, device=device, dtype=torch.bfloat16)
    kv_new = torch.randn(2, batch, num_kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    scale = head_dim**-0.5

    def call() -> torch.Tensor:
        return backend.write_and_attend(q, kv_new[0], kv_new[1], cache, step, scale)

    return call


def decode_attention(
    device: torch.device, copy_gb_per_s: float, batch: int, context: int, sweep: bool
) -> dict[str, Any]:
    """Time the decode kernel over a scattered cache; report KV bytes read per second."""
    from infer8.attention.triton import launch as triton_launch

    configs = [triton_launch.KernelConfig()]
    if sweep:  # the default first, then tiles, warps, pipeline stages and split lengths
        configs += [
            triton_launch.KernelConfig(
                decode_block_n=bn, decode_num_warps=w, decode_num_stages=st,
                decode_min_split_tokens=m,
            )
            for bn, w, st, m in (
                (32, 4, 2, 256), (64, 4, 3, 256), (64, 8, 2, 256), (128, 4, 2, 256),
                (128, 8, 3, 256), (64, 4, 2, 512), (64, 4, 2, 1024),
            )
        ]  # fmt: skip
    # (label, cache dtype, rotated keys, KV heads, group, batch, context): Llama-3-8B's shape,
    # the FP8 default (rotated keys) on it, a Qwen2-72B rank under TP 8 (1 KV head, group 8),
    # and 16 x 32K contexts
    shapes = [
        ("bf16", torch.bfloat16, False, 8, 4, batch, context),
        ("fp8", torch.float8_e4m3fn, False, 8, 4, batch, context),
        ("fp8 rotated", torch.float8_e4m3fn, True, 8, 4, batch, context),
        ("72B/TP8 bf16", torch.bfloat16, False, 1, 8, batch, context),
        ("72B/TP8 fp8 rotated", torch.float8_e4m3fn, True, 1, 8, batch, context),
        ("32K bf16", torch.bfloat16, False, 8, 4, 16, 32768),
        ("32K fp8", torch.float8_e4m3fn, False, 8, 4, 16, 32768),
        ("32K fp8 rotated", torch.float8_e4m3fn, True, 8, 4, 16, 32768),
    ]
    rows, results = [], {}
    for label, kv_dtype, rotated, kvh, group, b, ctx in shapes:
        sweep_this = sweep and label in ("bf16", "fp8")
        r = _time_decode(device, kv_dtype, b, ctx, configs if sweep_this else configs[:1],
                         sweep_this, num_kv_heads=kvh, group=group, rotated=rotated)  # fmt: skip
        # the engine's default config and split count, and the bytes the roofline model counts
        r["default_ms"] = r["first_config_heuristic_ms"]
        model_bytes = r["model_at_heuristic"]["kv_bytes"] + r["model_at_heuristic"]["other_bytes"]
        r["copy_share"] = model_bytes / (r["default_ms"] / 1e3) / GB / copy_gb_per_s
        results[label] = r
        rows.append([label, f"{b} x {ctx}", f"{kvh * group}/{kvh}", r["default_ms"], r["ms"],
                     r["config"], model_bytes / GB, 100 * r["copy_share"]])  # fmt: skip
        torch.cuda.empty_cache()
    yardstick = {
        label: _sdpa_decode_ms(device, b, ctx, 8, 4)
        for label, b, ctx in (("64 x 4K", batch, context), ("16 x 32K", 16, 32768))
    }
    # one layer as a step runs it (forward: residuals, kernels, ring write), 8B shape
    layer_ms = {}
    for label, kv_dtype, tail in (
        ("bf16", torch.bfloat16, False),
        ("fp8", torch.float8_e4m3fn, False),
        ("fp8 + tail + rotation", torch.float8_e4m3fn, True),
    ):
        layer_ms[label] = _time_ms(build_layer_decode(device, batch, context, kv_dtype, tail),
                                   per_event=DECODE_CALLS_PER_EVENT)  # fmt: skip
        torch.cuda.empty_cache()
    _log(f"\none layer's decode forward, batch {batch} x {context}: "
         + ", ".join(f"{k} {v:.3f} ms" for k, v in layer_ms.items()))  # fmt: skip
    default = {k: r["default_ms"] for k, r in results.items()}
    speedups = {
        f"{batch} x {context}": default["bf16"] / default["fp8"],
        "16 x 32K": default["32K bf16"] / default["32K fp8"],
    }
    ratios = {
        # rotated keys against plain FP8, both at the default kernel config
        "rotated vs plain fp8, 8B shape": default["fp8 rotated"] / default["fp8"],
        "rotated vs plain fp8, 16 x 32K": default["32K fp8 rotated"] / default["32K fp8"],
        "72B/TP8 rotated fp8 vs bf16": default["72B/TP8 fp8 rotated"] / default["72B/TP8 bf16"],
        "layer forward, fp8 default vs bf16": layer_ms["fp8 + tail + rotation"] / layer_ms["bf16"],
    }
    fp8_share = min(results[k]["copy_share"] for k in ("fp8", "32K fp8"))
    registers = _decode_kernel_registers()
    _log("\n## Decode attention (d 128; heads q/KV; at the default kernel config)\n")
    _log(_table(["cache", "batch x context", "heads", "default ms", "best ms", "best config",
                 "GB moved", "% of copy"], rows))  # fmt: skip
    _log(f"\nfp8 speedup over bf16 (default config): {speedups} (target >= {FP8_MIN_SPEEDUP}x); "
         f"fp8 % of copy: {100 * fp8_share:.0f}% (target >= {100 * MIN_COPY_SHARE:.0f}%); "
         f"time ratios: {ratios}; torch SDPA over a contiguous bf16 cache: {yardstick}; "
         f"decode kernels' registers: {registers}")  # fmt: skip
    failures = [
        f"fp8 decode only {x:.2f}x faster than bf16 at {shape} (target {FP8_MIN_SPEEDUP}x)"
        for shape, x in speedups.items() if x < FP8_MIN_SPEEDUP
    ]  # fmt: skip
    if fp8_share < MIN_COPY_SHARE:
        failures.append(f"fp8 decode moves its bytes at {100 * fp8_share:.0f}% of copy "
                        f"bandwidth (target {100 * MIN_COPY_SHARE:.0f}%)")  # fmt: skip
    for name in ("rotated vs plain fp8, 8B shape", "rotated vs plain fp8, 16 x 32K"):
        if ratios[name] > ROTATION_MAX_OVERHEAD:
            failures.append(f"{name}: {ratios[name]:.2f}x (bound {ROTATION_MAX_OVERHEAD}x)")
    for name in ("72B/TP8 rotated fp8 vs bf16", "layer forward, fp8 default vs bf16"):
        if ratios[name] >= 1.0:
            failures.append(f"{name}: the FP8 default is not faster than bf16 "
                            f"({ratios[name]:.2f}x its time)")  # fmt: skip
    result = {
        "batch": batch,
        "context": context,
        "by_shape": results,
        "fp8_speedups": speedups,
        "time_ratios": ratios,
        "fp8_copy_share": fp8_share,
        "sdpa_bf16_ms": yardstick,
        "layer_forward_ms": layer_ms,
        "kernel_registers": registers,
        "failures": failures,
    }
    if failures:
        RESULTS["sections"]["decode_attention"] = result  # the numbers stay in the JSON
        raise AssertionError("; ".join(failures))
    return result


def _sdpa_decode_ms(device: torch.device, batch: int, context: int, kvh: int, group: int) -> Any:
    """Time torch's flash SDPA decoding over a contiguous bf16 cache: what a tuned bf16 decode
    reaches on this GPU (the yardstick beside the paged kernels). Returns ms, or the error."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    d = 128
    q = torch.randn(batch, kvh * group, 1, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(batch, kvh, context, d, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return _time_ms(lambda: sdpa(q, k, v, enable_gqa=True),
                            per_event=DECODE_CALLS_PER_EVENT)  # fmt: skip
    except RuntimeError as e:  # a torch without flash GQA here: say so, do not fail the section
        return f"unavailable: {str(e).splitlines()[0][:200]}"


def _decode_kernel_registers() -> dict[str, Any]:
    """Return registers and spills of every decode kernel compiled in this process (the
    loaded binaries' own counts)."""
    from infer8.attention.triton import decode

    out: dict[str, Any] = {}
    for fn in (decode.decode_kernel, decode.decode_tail_kernel, decode.reduce_kernel):
        try:  # JITFunction.device_caches: device -> (compiled kernels by key, ...)
            for cache in fn.device_caches.values():
                for key, kernel in cache[0].items():
                    out[f"{fn.__name__}#{len(out)}"] = {
                        "registers": getattr(kernel, "n_regs", None),
                        "spills": getattr(kernel, "n_spills", None),
                        "key": str(key)[:300],
                    }
        except (AttributeError, TypeError, IndexError) as e:  # another Triton's layout
            out[fn.__name__] = f"unreadable: {e!r}"
    return out


# -- 4. end to end -------------------------------------------------------------------------


def _random_model(device: torch.device, preset: str) -> Any:
    """Build a LlamaForCausalLM of a plan preset's shape with random weights on the device."""
    from infer8.models.llama import LlamaArchConfig, LlamaForCausalLM
    from infer8.plan_presets import MODEL_PRESETS

    cfg = LlamaArchConfig.from_hf_config(dict(MODEL_PRESETS[preset]))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model = model.to_empty(device=device)
    model.init_rope_tables()  # to_empty left the rotary tables uninitialised
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model


def _decode_loop(
    model: Any,
    caches: list[Any],
    block_size: int,
    max_len: int,
    batch: int,
    metas: list[Any],
    positions: list[torch.Tensor],
    use_graphs: bool,
) -> tuple[dict[str, float], list[list[int]]]:
    """Run len(metas) greedy decode steps; return timings and the generated tokens."""
    from infer8.attention.triton.backend import TritonAttention
    from infer8.worker.cuda_graphs import CUDAGraphDecodeRunner

    backend = TritonAttention(caches[0].k.device)
    model.set_attention_backend(backend)
    runner = CUDAGraphDecodeRunner(
        model, caches, backend, block_size, max_len, batch, buckets=[batch]
    )
    t0 = time.perf_counter()
    if use_graphs:
        runner.capture()
    capture_s = time.perf_counter() - t0

    def step(s: int, tokens: torch.Tensor) -> torch.Tensor:
        if use_graphs:
            hidden = runner.run(tokens, positions[s], metas[s])
        else:
            hidden = model(tokens, positions[s], metas[s], caches)
        return model.compute_logits(hidden).argmax(-1)

    steps = len(metas)
    with torch.inference_mode():
        tokens = (
            torch.arange(batch, device=positions[0].device) * 7919 + 1000
        ) % model.config.vocab_size
        step(0, tokens)  # warm-up (compiles the eager path's kernels)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        generated = []
        for s in range(steps):
            tokens = step(s, tokens)
            generated.append(tokens)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    result = {
        "tokens_per_s": batch * steps / elapsed,
        "step_ms": 1e3 * elapsed / steps,
        "capture_s": capture_s,
    }
    return result, torch.stack(generated).tolist()


def end_to_end(
    device: torch.device, batch: int, context: int, steps: int, preset: str = "qwen2-7b-instruct"
) -> dict[str, Any]:
    """Decode `steps` tokens for `batch` sequences at `context` tokens; report tokens/s."""
    from infer8.attention.kv_cache import KVCacheSpec, allocate_kv_cache
    from infer8.attention.metadata import build_attention_metadata
    from infer8.layers import fp8_linear
    from infer8.models import fp8_weights as weights

    model = _random_model(device, preset)
    cfg = model.config
    block_size = 16
    max_len = context + steps + block_size
    blocks_per_seq = -(-max_len // block_size)
    block_ids = [
        list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(batch)
    ]
    metas = [
        build_attention_metadata([1] * batch, [context + s] * batch, block_ids, block_size, device)
        for s in range(steps)
    ]
    positions = [torch.full((batch,), context + s, device=device) for s in range(steps)]
    # (label, cache dtype, CUDA graphs, FP8 weights, rotated keys)
    configs = [
        ("bf16 cache, eager", torch.bfloat16, False, False, False),
        ("bf16 cache, CUDA graphs", torch.bfloat16, True, False, False),
        ("fp8 cache, eager", torch.float8_e4m3fn, False, False, False),
        ("fp8 cache, CUDA graphs", torch.float8_e4m3fn, True, False, False),
        ("fp8 rotated cache, eager", torch.float8_e4m3fn, False, False, True),
        ("fp8 rotated cache, CUDA graphs", torch.float8_e4m3fn, True, False, True),
    ]
    if fp8_linear.supports_scaled_mm(device):
        configs.append(
            ("fp8 weights + fp8 cache, CUDA graphs", torch.float8_e4m3fn, True, True, False)
        )
    rows, results, tokens_by_config = [], {}, {}
    for label, kv_dtype, use_graphs, fp8_weights, rotated in configs:
        if fp8_weights:  # irreversible: last
            weights.quantize_model_weights(model, per_channel=True, use_scaled_mm=True)
            torch.cuda.empty_cache()
        spec = KVCacheSpec(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            block_size,
            kv_dtype,
            hadamard=rotated,
        )
        caches = allocate_kv_cache(spec, 1 + batch * blocks_per_seq, device)
        for i, c in enumerate(caches):
            _fill_cache(c, seed=100 + i)  # the same "prompt" state for every config
        result, generated = _decode_loop(
            model, caches, block_size, max_len, batch, metas, positions, use_graphs
        )
        tokens_by_config[label] = generated
        results[label] = result
        rows.append([label, result["step_ms"], result["tokens_per_s"], result["capture_s"]])
        caches = []
        torch.cuda.empty_cache()
    # graphs replay the eager step: the same greedy tokens, within a step's padding-free bucket
    same = {
        name: tokens_by_config[f"{name}, eager"] == tokens_by_config[f"{name}, CUDA graphs"]
        for name in ("bf16 cache", "fp8 cache", "fp8 rotated cache")
    }
    _log(
        f"\n## End to end: {preset} shape, random weights, batch {batch} x {context} context, "
        f"{steps} steps\n"
    )
    _log(_table(["config", "ms / step", "tokens/s", "capture s"], rows))
    _log(f"\ngreedy tokens equal, eager vs CUDA graphs: {same}")
    result = {
        "model": preset,
        "batch": batch,
        "context": context,
        "steps": steps,
        "by_config": results,
        "graphs_match_eager": same,
    }
    if not all(same.values()):
        RESULTS["sections"]["end_to_end"] = result
        raise AssertionError(f"CUDA-graph tokens differ from eager tokens: {same}")
    return result


# -- main ----------------------------------------------------------------------------------


def run_gpu_tests(timeout_s: float = 240.0) -> dict[str, Any]:
    """Run `pytest tests/gpu` in a subprocess; fail the section if any test fails."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "tests/gpu"],
        cwd=root, capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    tail = (result.stdout + result.stderr)[-3000:]
    _log("\n## pytest tests/gpu\n" + tail)
    if result.returncode != 0:
        raise AssertionError(f"pytest tests/gpu exited {result.returncode}")
    return {"returncode": result.returncode, "summary": tail.strip().splitlines()[-1]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_check.json", help="where to write the JSON results")
    parser.add_argument("--budget-s", type=float, default=450.0, help="skip sections past this")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=32, help="end-to-end decode steps")
    parser.add_argument(
        "--no-sweep", action="store_true", help="time the default kernel config only"
    )
    parser.add_argument(
        "--sections",
        help="comma-separated sections to run, in this order (default: all, pytest_gpu first)",
    )
    args = parser.parse_args()
    t_start = time.perf_counter()

    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing to do.",
            file=sys.stderr,
        )
        return 2
    try:
        import triton
    except ImportError:
        print("gpu_check: triton is not installed (pip install triton)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    RESULTS["device"] = {
        "name": props.name,
        "capability": list(torch.cuda.get_device_capability(device)),
        "memory_gib": props.total_memory / 2**30,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    _log(
        f"# infer8 gpu_check on {props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs), torch {torch.__version__}, triton {triton.__version__}"
    )

    def save() -> None:
        RESULTS["total_s"] = time.perf_counter() - t_start
        Path(args.out).write_text(json.dumps(RESULTS, indent=1, default=str))

    def section(name: str, fn: Callable[[], Any], limit_s: float = 240.0) -> Any:
        elapsed = time.perf_counter() - t_start
        if elapsed > args.budget_s:
            RESULTS["errors"][name] = (
                f"skipped: {elapsed:.0f}s past the {args.budget_s:.0f}s budget"
            )
            _log(f"\n(skipping {name}: time budget)")
            save()
            return None
        t0 = time.perf_counter()
        # the watchdog: a section that hangs prints every thread's stack and ends the run
        RESULTS["errors"][name] = f"hung: killed by the watchdog after {limit_s:.0f}s"
        save()
        faulthandler.dump_traceback_later(limit_s, exit=True)
        try:
            out = fn()
            RESULTS["sections"][name] = out
            del RESULTS["errors"][name]
            return out
        except Exception as e:  # one failing section must not hide the others' results
            RESULTS["errors"][name] = f"{type(e).__name__}: {e}"
            _log(f"\n{name} FAILED: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            return None
        finally:
            faulthandler.cancel_dump_traceback_later()
            _log(f"({name}: {time.perf_counter() - t0:.1f}s)")
            gc.collect()  # engines in reference cycles give their device memory back
            torch.cuda.empty_cache()
            save()

    work_dir = Path(tempfile.mkdtemp(prefix="infer8-gpu-check-"))
    bw: dict[str, float] = {}

    def bandwidth() -> dict[str, float]:
        bw.update(copy_bandwidth(device))
        return bw

    # name -> (function, watchdog limit in seconds), in the default order
    sections: dict[str, tuple[Callable[[], Any], float]] = {
        "pytest_gpu": (run_gpu_tests, 300),
        "engine_smoke": (lambda: engine_smoke(device, work_dir), 240),
        "memory_split": (lambda: memory_split(device, work_dir), 180),
        "fp8_agreement": (lambda: fp8_agreement(device, work_dir), 120),
        "sampling": (lambda: sampling(device), 60),
        "kernels_vs_reference": (lambda: check_kernels(device), 240),
        "bandwidth": (bandwidth, 240),
        "decode_attention": (
            lambda: decode_attention(
                device,
                bw.get("copy_gb_per_s", float("nan")),
                args.batch,
                args.context,
                not args.no_sweep,
            ),
            240,
        ),
        "end_to_end": (lambda: end_to_end(device, args.batch, args.context, args.steps), 240),
    }
    order = args.sections.split(",") if args.sections else list(sections)
    unknown = [name for name in order if name not in sections]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {', '.join(sections)}")
    for name in order:
        fn, limit_s = sections[name]
        section(name, fn, limit_s=limit_s)
    save()
    _log(f"\nwrote {args.out} ({RESULTS['total_s']:.0f}s total)")
    return 1 if RESULTS["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
