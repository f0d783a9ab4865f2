"""The backend suite: the CPU backend against the reference over the same schedule of steps,
for every cache format, the outputs and what each leaves in its cache (blocks, scales, the
exact tail's store) within the compute dtype's rounding; plus the registry's choices."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from infer8.attention import select_backend
from infer8.attention.cpu.backend import CpuAttention
from infer8.attention.kv_cache import KVCacheSpec, LayerKVCache
from infer8.attention.reference import ReferenceAttention, read_blocks
from infer8.kernels.cpu import NativeKernels
from infer8.quant import fp8
from tests.attention_schedule import (
    BLOCK_SIZE,
    HEAD_DIM,
    KVH,
    run_schedule,
    tail_spec,
)

CPU = torch.device("cpu")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# float32: the same numbers summed in another order (outputs up to ~20). A rotated cache's K
# differs in its last bits between a fast Walsh-Hadamard pass and a matmul, so a few FP8 codes
# round the other way: compared as a relative L2 error (30 seeds: at most 1.4e-4). bf16 rounds
# scores, probabilities and outputs on the fast path, not in the reference's float32 (30
# seeds: at most 1.5e-2).
TOL = {torch.float32: (2e-4, 2e-5)}
REL_L2 = {"rotated": 5e-4, torch.bfloat16: 2e-2}


def _assert_close(got: torch.Tensor, want: torch.Tensor, msg: str, rotated: bool) -> None:
    if want.dtype == torch.float32 and not rotated:
        atol, rtol = TOL[torch.float32]
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=msg)
        return
    bound = REL_L2["rotated"] if want.dtype == torch.float32 else REL_L2[torch.bfloat16]
    rel = (got.float() - want.float()).norm() / want.float().norm()
    assert rel < bound, f"{msg}: relative L2 error {rel:.2e}"


FORMATS: dict[str, Callable[[], KVCacheSpec]] = {
    "same dtype": lambda: KVCacheSpec(1, KVH, HEAD_DIM, BLOCK_SIZE, torch.float32),
    "bf16 cache": lambda: KVCacheSpec(1, KVH, HEAD_DIM, BLOCK_SIZE, torch.bfloat16),
    "e4m3": lambda: KVCacheSpec(1, KVH, HEAD_DIM, BLOCK_SIZE, E4M3),
    "e5m2": lambda: KVCacheSpec(1, KVH, HEAD_DIM, BLOCK_SIZE, E5M2),
    "e4m3 hadamard": lambda: KVCacheSpec(1, KVH, HEAD_DIM, BLOCK_SIZE, E4M3, hadamard=True),
    "e4m3 tail": lambda: tail_spec(E4M3),
    "e5m2 tail": lambda: tail_spec(E5M2),
    "e4m3 tail hadamard": lambda: tail_spec(E4M3, hadamard=True),
}


@pytest.fixture(scope="module")
def native() -> NativeKernels:
    kernels = NativeKernels.load()
    assert kernels is not None, "the test machine has a C compiler"
    return kernels


def _spec_for(name: str, compute: torch.dtype) -> KVCacheSpec:
    spec = FORMATS[name]()
    if name == "same dtype":
        spec = KVCacheSpec(1, KVH, HEAD_DIM, BLOCK_SIZE, compute)
    return spec


def _dequantized(cache: LayerKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Return every block of the cache as float32 values (what a later step reads)."""
    num_blocks = cache.k.shape[1]
    table = torch.arange(num_blocks)
    return read_blocks(cache, table, num_blocks * BLOCK_SIZE, torch.float32)


def _count_calls(obj: Any, name: str, calls: dict[str, int]) -> None:
    fn = getattr(obj, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[name] = calls.get(name, 0) + 1
        return fn(*args, **kwargs)

    setattr(obj, name, counted)


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_cpu_backend_matches_the_reference_step_after_step(
    fmt: str, compute: torch.dtype, native: NativeKernels
) -> None:
    spec = _spec_for(fmt, compute)
    assert CpuAttention.supports(spec.format, HEAD_DIM)
    cpu = CpuAttention(NativeKernels.from_library(native.lib))
    calls: dict[str, int] = {}
    for group, name in ((cpu.kernels.decode, "decode_layer"), (cpu.kernels.kv, "prefill_tail"),
                        (cpu.kernels.prefill, "two_value_prompts")):  # fmt: skip
        _count_calls(group, name, calls)
    steps = 0
    for step, got, want, got_cache, want_cache in run_schedule(
        ReferenceAttention(), cpu, compute, CPU, spec
    ):
        steps += 1
        assert got.dtype == want.dtype == compute
        _assert_close(got, want, f"step {step}", spec.hadamard)
        for g, w in zip(_dequantized(got_cache), _dequantized(want_cache)):
            # FP8 codes may round the other way where K differs in its last bits (bf16
            # compute, a rotation summed in another order): a few codes, one step of the grid
            bad = ~torch.isclose(g, w, atol=1e-6, rtol=0.13 if spec.is_fp8 else 0.0)
            assert bad.float().mean() < (0.01 if spec.is_fp8 else 1e-9), f"step {step} blocks"
        if spec.exact_tail_tokens:
            assert got_cache.tail_store is not None and want_cache.tail_store is not None
            g_store = fp8.dequantize(*_flat_store(got_cache), torch.float32)
            w_store = fp8.dequantize(*_flat_store(want_cache), torch.float32)
            close = torch.isclose(g_store, w_store, atol=1e-3, rtol=0.13)
            assert close.float().mean() > 0.99, f"step {step} tail store"
    assert steps == 6
    # the fast paths ran: all-decode steps as one fused call, prefill with a tail in one pass
    assert calls.get("decode_layer", 0) >= 2
    if spec.exact_tail_tokens:
        assert calls.get("prefill_tail", 0) >= 3
        assert calls.get("two_value_prompts", 0) >= 1


def _flat_store(cache: LayerKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    assert cache.tail_store is not None
    values, scales = cache.tail_store
    return values, scales[..., None]


def test_the_tail_changes_the_outputs_by_far_more_than_the_tolerance(native: NativeKernels) -> None:
    """The suite above would notice a backend that ignored the tail."""
    cpu = CpuAttention(native)
    diffs = [
        (got - want).abs().max().item()
        for _, got, want, _, _ in run_schedule(
            ReferenceAttention(), cpu, torch.float32, CPU, tail_spec(), other_tail=False
        )
    ]
    assert max(diffs) > 100 * TOL[torch.float32][0]


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_static_scales_and_calibration_go_to_the_reference(
    compute: torch.dtype, native: NativeKernels
) -> None:
    """The CPU backend runs neither static scales (the registry gives those caches to the
    reference, which clips and counts what the scales cannot hold, within FP8's error of a
    16-bit cache) nor calibration observers (it hands those steps to the reference: the same
    numbers and the same amax)."""
    static = KVCacheSpec(1, KVH, HEAD_DIM, BLOCK_SIZE, E4M3, kv_scale="static")
    assert not CpuAttention.supports(static.format, HEAD_DIM)
    assert isinstance(select_backend(CPU, static, native), ReferenceAttention)
    scales = [torch.full((KVH, 1), 0.08)], [torch.full((KVH, HEAD_DIM), 0.1)]
    plain = KVCacheSpec(1, KVH, HEAD_DIM, BLOCK_SIZE, torch.bfloat16)
    ref = ReferenceAttention()
    runs = zip(
        run_schedule(ref, ref, compute, CPU, static, scales),
        run_schedule(ref, ref, compute, CPU, plain),
    )
    saturated = 0
    for (_, got, _, _, cache), (_, want, _, _, _) in runs:
        rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert 1e-3 < rel < 0.2  # FP8's error, not a broken scale
        assert cache.num_saturated is not None
        saturated = int(cache.num_saturated)
    assert saturated > 0
    cpu = CpuAttention(native)
    schedule = run_schedule(ReferenceAttention(), cpu, compute, CPU, plain)
    _, _, _, got_cache, want_cache = next(schedule)
    for cache in (got_cache, want_cache):  # observe from the second step on
        cache.k_amax = torch.zeros(KVH, HEAD_DIM)
        cache.v_amax = torch.zeros(KVH, HEAD_DIM)
    for _, got, want, _, _ in schedule:
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert got_cache.k_amax is not None and want_cache.k_amax is not None
    assert torch.equal(got_cache.k_amax, want_cache.k_amax) and got_cache.k_amax.max() > 0


def test_the_registry_picks_by_device_and_format(native: NativeKernels) -> None:
    e4m3 = KVCacheSpec(2, KVH, HEAD_DIM, BLOCK_SIZE, E4M3, 24, 4, hadamard=True)
    assert isinstance(select_backend(CPU, e4m3, native), CpuAttention)
    assert isinstance(select_backend(CPU, e4m3, None), ReferenceAttention)  # no compiler
    odd = KVCacheSpec(2, KVH, 20, BLOCK_SIZE, torch.bfloat16)  # head_dim not a multiple of 8
    assert isinstance(select_backend(CPU, odd, native), ReferenceAttention)
