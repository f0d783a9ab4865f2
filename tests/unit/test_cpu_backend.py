"""The CPU backend's fast paths against its own general path (rotate, write, the tail's values
and store, attend through the native decode and the prefill chunks), bit for bit: the fused
decode layer, the one-pass prefill with a tail, fresh prompts over their own K / V, and the
dense and split forms of a prefill with a tail."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from infer8.attention.cpu.backend import CpuAttention, CpuStepMetadata
from infer8.attention.kv_cache import KVCacheSpec, LayerKVCache, allocate_kv_cache
from infer8.attention.metadata import build_attention_metadata
from infer8.kernels.cpu import NativeKernels
from tests.attention_schedule import run_schedule, tail_spec

CPU = torch.device("cpu")


class GeneralPath(CpuAttention):
    """CpuAttention that takes its general path for every step."""

    def write_and_attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        step: CpuStepMetadata,
        scale: float,
    ) -> torch.Tensor:
        n = step.common.num_real_tokens
        return self._write_then_attend(q, k[:n], v[:n], cache, step.common, scale)


@pytest.fixture(scope="module")
def native() -> NativeKernels:
    kernels = NativeKernels.load()
    assert kernels is not None
    return kernels


def _counting(backend: CpuAttention, group: Any, name: str) -> list[tuple[Any, ...]]:
    calls: list[tuple[Any, ...]] = []
    fn = getattr(group, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return fn(*args, **kwargs)

    setattr(group, name, counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hadamard", [True, False])
def test_fused_paths_are_the_general_path_bit_for_bit(
    native: NativeKernels, dtype: torch.dtype, hadamard: bool
) -> None:
    """One native call per all-decode layer (rotation, FP8 write, tail residuals, sinks, the
    attention, rings), and one native write pass per layer of a step with prefill chunks
    (prefill_tail, whose block values fresh prompts attend over without a gather), leave the
    same cache and store and return the same outputs, bit for bit, as the general path."""
    torch.manual_seed(0)
    fused = CpuAttention(NativeKernels.from_library(native.lib))
    layers = _counting(fused, fused.kernels.decode, "decode_layer")
    passes = _counting(fused, fused.kernels.kv, "prefill_tail")
    fresh = _counting(fused, fused.chunks, "_fresh_reads")
    general = GeneralPath(native)
    for step, got, want, got_cache, want_cache in run_schedule(
        general, fused, dtype, CPU, tail_spec(hadamard=hadamard)
    ):
        assert torch.equal(got, want), step
        for a, b in ((got_cache.k, want_cache.k), (got_cache.v, want_cache.v)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), step
        assert got_cache.k_scale is not None and want_cache.k_scale is not None
        assert torch.equal(got_cache.k_scale, want_cache.k_scale), step
        assert got_cache.tail_store is not None and want_cache.tail_store is not None
        store, want_store = got_cache.tail_store, want_cache.tail_store
        assert torch.equal(store[0].view(torch.uint8), want_store[0].view(torch.uint8)), step
        assert torch.equal(store[1], want_store[1]), step
    assert len(layers) == 2  # the schedule's two all-decode steps
    # the four steps with prefill chunks in one pass each; the fresh prompts (A's 20 tokens,
    # D's 3, E's 10, F's 9 beside four decodes) attend over that pass's values, the later
    # chunks over their blocks
    assert len(passes) == 4
    assert [args[0] for args in fresh] == [20, 3, 10, 9]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2])
@pytest.mark.parametrize("batch", [5, 1])
def test_decode_layer_without_a_tail_is_the_general_path(
    native: NativeKernels, cache_dtype: torch.dtype, batch: int
) -> None:
    """16/32-bit caches (a copy instead of a quantized write) and an FP8 cache without a tail;
    q / k / v split from one projection as the model splits them (one row: dim 0's strides
    differ, and the fused path still runs)."""
    torch.manual_seed(1)
    fused, general = CpuAttention(NativeKernels.from_library(native.lib)), GeneralPath(native)
    calls = _counting(fused, fused.kernels.decode, "decode_layer")
    kvh, group, d, bs = 3, 3, 64, 16
    dtype = torch.float32 if cache_dtype == torch.float32 else torch.bfloat16
    spec = KVCacheSpec(1, kvh, d, bs, cache_dtype)
    cache, other = (allocate_kv_cache(spec, 40, CPU)[0] for _ in range(2))
    lens = [37, 1, 16, 17, 90][:batch]
    blocks = [[1 + 8 * i + j for j in range(-(-n // bs))] for i, n in enumerate(lens)]
    prompt = build_attention_metadata([n - 1 for n in lens], [0] * batch, blocks, bs, CPU)
    k = torch.randn(prompt.num_real_tokens, kvh, d, dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(prompt.num_real_tokens, kvh * group, d, dtype=dtype)
    for c in (cache, other):
        general.write_and_attend(q, k, v, c, general.build_metadata(prompt), d**-0.5)
    meta = build_attention_metadata([1] * batch, [n - 1 for n in lens], blocks, bs, CPU)
    qkv = torch.randn(batch, (kvh * group + 2 * kvh) * d, dtype=dtype)
    qk, v_new = qkv.split([(kvh * group + kvh) * d, kvh * d], dim=-1)  # as the model splits
    q, k_new = qk.view(batch, -1, d).split([kvh * group, kvh], dim=1)
    v_new = v_new.view(batch, kvh, d)
    want = general.write_and_attend(q, k_new, v_new, cache, general.build_metadata(meta), d**-0.5)
    got = fused.write_and_attend(q, k_new, v_new, other, fused.build_metadata(meta), d**-0.5)
    assert len(calls) == 1
    assert torch.equal(got, want)
    assert torch.equal(other.k.view(torch.uint8), cache.k.view(torch.uint8))
    assert torch.equal(other.v.view(torch.uint8), cache.v.view(torch.uint8))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_fresh_prompts_attend_over_their_own_kv_not_their_blocks(
    native: NativeKernels, cache_dtype: torch.dtype
) -> None:
    """A 16/32-bit cache in the compute dtype holds K / V as they are: prompts computed whole
    in the step (short: the native causal pass; long: SDPA) attend over the step's rows, a
    chunk after cached positions and the decodes read blocks, all bit for bit the general
    path (which reads every prompt's blocks back)."""
    torch.manual_seed(4)
    fused, general = CpuAttention(NativeKernels.from_library(native.lib)), GeneralPath(native)
    for backend in (fused, general):  # the 45-token prompt takes the SDPA path
        backend.chunks.native_causal_max_len = 40
    reads = _counting(fused, fused.chunks, "_read")
    kvh, group, d, bs = 3, 3, 64, 16
    spec = KVCacheSpec(1, kvh, d, bs, cache_dtype)
    cache, other = (allocate_kv_cache(spec, 40, CPU)[0] for _ in range(2))
    # sequences: a decode (30 cached), a chunk of 10 after 20 cached, fresh prompts of 7 and 45
    cached = [30, 20, 0, 0]
    blocks = [[1, 2, 3], [5, 6], [8], [10, 11, 12]]
    pre = build_attention_metadata(cached[:2], [0, 0], blocks[:2], bs, CPU)
    k0 = torch.randn(pre.num_real_tokens, kvh, d, dtype=cache_dtype)
    v0, q0 = (
        torch.randn_like(k0),
        torch.randn(pre.num_real_tokens, kvh * group, d, dtype=cache_dtype),
    )
    for c in (cache, other):
        general.write_and_attend(q0, k0, v0, c, general.build_metadata(pre), d**-0.5)
    meta = build_attention_metadata([1, 10, 7, 45], cached, blocks, bs, CPU)
    n = meta.num_real_tokens
    q = torch.randn(n, kvh * group, d, dtype=cache_dtype)
    k, v = torch.randn(n, kvh, d, dtype=cache_dtype), torch.randn(n, kvh, d, dtype=cache_dtype)
    want = general.write_and_attend(q, k, v, cache, general.build_metadata(meta), d**-0.5)
    got = fused.write_and_attend(q, k, v, other, fused.build_metadata(meta), d**-0.5)
    assert torch.equal(got, want)
    assert torch.equal(other.k, cache.k) and torch.equal(other.v, cache.v)
    assert len(reads) == 2  # K and V of the chunk after cached positions only


def test_dense_and_split_tail_prefill_agree_over_the_schedule(native: NativeKernels) -> None:
    """Short prompts attend densely, long ones by key ranges: the same numbers either way
    (csrc/two_value_attention.c and csrc/band_attention.c against each other)."""
    torch.manual_seed(0)
    split = CpuAttention(native, dense_tail_max_len=0)
    dense = CpuAttention(native)
    for step, got, want, _, _ in run_schedule(split, dense, torch.float32, CPU):
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 1e-6, (step, rel)
