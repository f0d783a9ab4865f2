"""Compile every Triton kernel configuration the engine can launch for a CUDA target, no GPU needed.

Run as a script (tests/gpu/test_triton_compile.py does, in a fresh process without
TRITON_INTERPRET): a stand-in driver reports the target, and each launch is turned into
Triton's warm-up, which compiles (source -> TTIR -> TTGIR -> LLVM -> PTX -> cubin with the
bundled ptxas) and launches nothing. The launchers run on CPU tensors of the right dtypes and
shapes; their outputs are not computed. Prints one JSON line: the kernels compiled per
configuration, or the first error.

    python tests/gpu/compile_kernels.py --arch 90 [--configs ci] [--kernels decode --report]

All 31 configurations for sm_90 take ~8 minutes on 2 CPU cores; `--configs ci` ~40 s;
`--kernels decode` (the decode attention kernels alone, one split and four) ~2.5 minutes for
all. --report adds, per decode kernel compiled, what the cubin asks of the GPU (tests/gpu/
sass.py): registers and stack per thread, and decode_kernel's main loop: instructions per
iteration and per context token, synchronous global loads and asynchronous copies.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import traceback

import torch


def _install_compile_only_driver(arch: int) -> list[tuple[str, dict, object, bool]]:
    """Make every kernel launch compile for sm_<arch> and return; record each launch as (name,
    launch keywords, compiled kernel, whether it compiled: False when Triton's in-memory
    cache held that specialization already)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class CompileOnlyDriver:
        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", arch, 32)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

    driver.set_active(CompileOnlyDriver())
    compiled: list[tuple[str, dict, object, bool]] = []
    run = JITFunction.run

    def warmup_only(self, *args, grid, warmup, **kwargs):  # type: ignore[no-untyped-def]
        kernels = self.device_caches[0][0]  # (specialization key -> kernel, ...)
        before = len(kernels)
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        assert "cubin" in kernel.asm, f"{self.__name__}: no cubin"
        compiled.append((self.__name__, kwargs, kernel, len(kernels) > before))
        return kernel

    JITFunction.run = warmup_only  # type: ignore[method-assign]
    return compiled


# The fewest configurations that reach every kernel and constexpr branch (--configs ci): both
# FP8 formats, dynamic and static scales, the tail with and without rotation, bf16 and fp16
# dot operands; on Ampere (no E4M3, so no tail) the plain E5M2 path. Every configuration also
# launches the multi-LoRA kernels in its model dtype.
_CI_CONFIGS = {
    90: [
        (torch.bfloat16, torch.float8_e4m3fn, "dynamic", True, True),
        (torch.float16, torch.float8_e5m2, "static", True, False),
    ],
    80: [(torch.float16, torch.float8_e5m2, "dynamic", False, False)],
}


def _configs(arch: int, which: str):
    """Yield (model dtype, cache dtype, scales, tail, rotate) the engine can run on sm_<arch>."""
    if which == "ci":
        yield from _CI_CONFIGS[90 if arch >= 89 else 80]
        return
    caches = [torch.bfloat16, torch.float8_e5m2] + ([torch.float8_e4m3fn] if arch >= 89 else [])
    for model, cache in itertools.product([torch.bfloat16, torch.float16, torch.float32], caches):
        if cache == torch.bfloat16 and model != torch.bfloat16:
            continue
        yield model, cache, "dynamic", False, False
        if cache != torch.bfloat16:
            yield model, cache, "static", False, False
            if arch >= 89:  # the tail's residuals are E4M3
                yield model, cache, "dynamic", True, True
                yield model, cache, "dynamic", True, False
                yield model, cache, "static", True, False


def _case(model_dtype, cache_dtype, scales: str, tail: bool, rotate: bool):
    """Return (cache, metadata, q) of a step: two decodes and a chunk after a cached prefix."""
    from infer8.attention.exact_tail import build_tail_metadata
    from infer8.attention.kv_cache import KVCacheSpec, allocate_kv_cache
    from infer8.attention.metadata import build_attention_metadata

    dev = torch.device("cpu")
    kvh, group, d, bs = 2, 4, 128, 16
    spec = KVCacheSpec(1, kvh, d, bs, cache_dtype, 8 if tail else 0, 4 if tail else 0, rotate,
                       kv_scale=scales)  # fmt: skip
    ones = [torch.ones(kvh, d)]
    static = (ones, ones) if scales == "static" else None
    cache = allocate_kv_cache(spec, 16, dev, 4 if tail else 0, static)[0]
    q_lens, computed = [1, 1, 20], [30, 5, 16]
    meta = build_attention_metadata(q_lens, computed, [[1, 2], [3], [4, 5, 6]], bs, dev)
    if tail:
        meta.tail = build_tail_metadata(
            8, 4, [0, 1, 2], [0, 0, 16], [(0, False), (1, False), (-1, False)], q_lens,
            computed, meta.decode_seq_ids, meta.decode_block_tables.shape[1] * bs, dev,
        )  # fmt: skip
    q = torch.zeros(meta.num_real_tokens, kvh * group, d, dtype=model_dtype)
    return cache, meta, q


def _launch_all(model_dtype, cache_dtype, scales: str, tail: bool, rotate: bool) -> None:
    from infer8.attention.triton.backend import TritonAttention

    cache, meta, q = _case(model_dtype, cache_dtype, scales, tail, rotate)
    k = torch.zeros(q.shape[0], cache.k.shape[0], q.shape[2], dtype=model_dtype)
    for splits in (1, 4):
        backend = TritonAttention(torch.device("cpu"), num_splits=splits)
        backend.write_and_attend(q, k, k, cache, backend.build_metadata(meta), q.shape[2] ** -0.5)
    _launch_lora(model_dtype)


def _launch_decode(model_dtype, cache_dtype, scales: str, tail: bool, rotate: bool) -> None:
    """Launch the decode attention kernels alone (one split and four), as the engine does."""
    from infer8.attention.exact_tail import RESIDUAL_DTYPE
    from infer8.attention.triton import launch
    from infer8.attention.triton.backend import TritonAttention

    cache, meta, q = _case(model_dtype, cache_dtype, scales, tail, rotate)
    step = TritonAttention(torch.device("cpu")).build_metadata(meta)
    tail_args = None
    if tail:
        n, kvh2 = q.shape[0], 2 * cache.k.shape[0]
        new = (torch.zeros(n, kvh2, q.shape[2], dtype=RESIDUAL_DTYPE),
               torch.zeros(n, kvh2, dtype=torch.bfloat16))  # fmt: skip
        tail_args = launch.TailArgs(step.tail, new)
    for splits in (1, 4):
        launch.paged_decode_attention(
            q, cache, torch.empty_like(q), step.decode_token_ids, step.decode_seq_lens,
            step.decode_block_tables, q.shape[2] ** -0.5, splits, tail=tail_args,
        )  # fmt: skip


def _report(config: str, compiled: list[tuple[str, dict, object, bool]]) -> list[dict]:
    """Return what each decode kernel compiled for a configuration asks of the GPU."""
    import sass

    rows = []
    for name, kwargs, kernel, _ in compiled:
        if not name.startswith("decode"):
            continue
        cubin = kernel.asm["cubin"]  # type: ignore[attr-defined]
        registers, stack = sass.resource_usage(cubin)
        row = {"config": config, "kernel": name, "direct": kwargs.get("DIRECT", False),
               "registers": registers, "stack": stack}  # fmt: skip
        if name == "decode_kernel":
            main = sass.loops(cubin)[0]
            warps = kwargs.get("num_warps", 4)
            row.update(
                loop_instructions=main.instructions,
                per_token=main.instructions * warps / kwargs["BLOCK_N"],
                sync_loads=main.sync_global_loads,
                async_copies=main.async_copies,
            )
        rows.append(row)
    return rows


def _launch_lora(dtype: torch.dtype) -> None:
    """Launch the multi-LoRA kernels as a fused qkv of rank 3 * 16 over 4 slots would."""
    from infer8.lora.triton_ops import triton_lora_add

    num_slots, rank, in_features, out_features = 4, 48, 576, 1728
    x = torch.zeros(3, in_features, dtype=dtype)
    y = torch.zeros(3, out_features, dtype=dtype)
    a = torch.zeros(num_slots, rank, in_features, dtype=dtype)
    b = torch.zeros(num_slots, rank, out_features, dtype=dtype)
    triton_lora_add(x, y, a, b, torch.tensor([0, -1, 3], dtype=torch.int32))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    parser.add_argument(
        "--configs", choices=["ci", "all"], default="all",
        help="all: every combination the engine launches; ci: one of each kernel branch",
    )  # fmt: skip
    parser.add_argument(
        "--kernels", choices=["all", "decode"], default="all",
        help="decode: the decode attention kernels alone",
    )  # fmt: skip
    parser.add_argument("--report", action="store_true", help="registers and loops of decode")
    args = parser.parse_args()
    assert "TRITON_INTERPRET" not in os.environ, "run without TRITON_INTERPRET"
    compiled = _install_compile_only_driver(args.arch)
    launch = _launch_decode if args.kernels == "decode" else _launch_all
    done, names, report = [], set(), []
    for config in _configs(args.arch, args.configs):
        name = "/".join(str(c).replace("torch.", "") for c in config)
        try:
            launch(*config)
        except Exception as e:  # noqa: BLE001 - reported, with its traceback
            traceback.print_exc()
            print(json.dumps({"arch": args.arch, "failed": name, "error": str(e)[-2000:]}))
            return 1
        done.append(name)
        names.update(kernel for kernel, _, _, _ in compiled)
        if args.report:
            report += _report(name, compiled)
        compiled.clear()
    result = {"arch": args.arch, "configs": done, "kernels": sorted(names)}
    if args.report:
        result["report"] = report
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
