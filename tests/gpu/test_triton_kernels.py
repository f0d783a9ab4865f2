"""Triton attention kernels against the reference: on CUDA natively, on CPU interpreted.

Without CUDA the kernels run under TRITON_INTERPRET=1 (numpy, tiny shapes); triton reads that
variable when a kernel is defined, so it is set before infer8.attention.triton is
imported, and the module is reloaded if something imported it earlier without it.

Both sides read the same cache, so the kernels are held to the compute dtype's rounding, not
to FP8's: the reference rounds scores and outputs to the model dtype (bf16 keeps 8 significant
bits, fp16 11), the kernels accumulate in fp32 and round the softmax weights once. Outputs and
unused cache slots are poisoned with NaN first, so anything unwritten or read past a
sequence's end fails.
"""

from __future__ import annotations

import dataclasses
import inspect
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton", reason="triton is not installed (Linux x86_64 test extra)")

from tests.gpu import triton_modules  # noqa: E402

_MODULES = triton_modules.load()
triton_launch = _MODULES["launch"]
triton_backend = _MODULES["backend"]
HAS_CUDA, DEVICE = triton_modules.HAS_CUDA, triton_modules.DEVICE

from infer8.attention.kv_cache import KVCacheSpec, LayerKVCache, allocate_kv_cache  # noqa: E402
from infer8.attention.metadata import AttentionMetadata, build_attention_metadata  # noqa: E402
from infer8.attention.reference import attend_cache, write_kv  # noqa: E402

BLOCK_SIZE = 16
CACHE_DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
# Norm-wise relative error bound by compute dtype: a few roundings of 2**-9 (bf16) / 2**-12.
REL_TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3}
# Elementwise: a few units in the last place at the outputs' magnitude (~1).
ELEM_TOL = {torch.bfloat16: 4e-2, torch.float16: 5e-3}


def _model_dtype(cache_dtype: torch.dtype) -> torch.dtype:
    return torch.float16 if cache_dtype == torch.float16 else torch.bfloat16


def _poison(t: torch.Tensor, where: torch.Tensor | None = None) -> None:
    """Fill t (or the slots `where` of [kvh, num_slots, ...]) with NaN bit patterns."""
    if t.element_size() == 1:  # 0xFF is NaN in e4m3fn and in e5m2
        t = t.view(torch.uint8)
        value: float | int = 0xFF
    else:
        value = float("nan")
    if where is None:
        t.fill_(value)
    else:
        t.view(t.shape[0], -1, *t.shape[3:])[:, where] = value


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _cache(
    cache_dtype: torch.dtype, num_kv_heads: int, head_dim: int, num_blocks: int, static: str
) -> LayerKVCache:
    if static == "dynamic":
        spec = KVCacheSpec(1, num_kv_heads, head_dim, BLOCK_SIZE, cache_dtype)
        return allocate_kv_cache(spec, num_blocks, DEVICE)[0]
    spec = KVCacheSpec(1, num_kv_heads, head_dim, BLOCK_SIZE, cache_dtype, kv_scale="static")
    shape = (num_kv_heads, 1) if static == "head" else (num_kv_heads, head_dim)
    k, v = (torch.rand(shape, device=DEVICE) * 0.02 + 0.005 for _ in range(2))
    return allocate_kv_cache(spec, num_blocks, DEVICE, static_scales=([k], [v]))[0]


def _clone(cache: LayerKVCache) -> LayerKVCache:
    def c(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.clone()

    return dataclasses.replace(
        cache, k=cache.k.clone(), v=cache.v.clone(), k_scale=c(cache.k_scale),
        v_scale=c(cache.v_scale), num_saturated=c(cache.num_saturated),
    )  # fmt: skip


@pytest.mark.parametrize(
    "cache_dtype, static",
    [
        (torch.bfloat16, "dynamic"),
        (torch.float16, "dynamic"),
        (torch.float8_e4m3fn, "dynamic"),
        (torch.float8_e5m2, "dynamic"),
        (torch.float8_e4m3fn, "head"),
        (torch.float8_e4m3fn, "channel"),
        (torch.float8_e5m2, "channel"),
    ],
)
def test_write_kv_stores_what_the_reference_stores_bit_for_bit(
    cache_dtype: torch.dtype, static: str
) -> None:
    torch.manual_seed(0)
    num_kv_heads, head_dim, num_tokens = 3, 64, 21
    cache = _cache(cache_dtype, num_kv_heads, head_dim, 8, static)
    for t in (cache.k, cache.v, cache.k_scale, cache.v_scale):
        if t is not None:
            _poison(t)
    ref_cache = _clone(cache)
    dtype = _model_dtype(cache_dtype)
    # K/V as strided views of a fused projection, with an outlier token and clipped values
    qkv = torch.randn(num_tokens, (4 + 2) * num_kv_heads * head_dim, dtype=dtype, device=DEVICE)
    qkv[5] *= 300.0
    qkv[:, ::5] *= 1e-4  # FP8 subnormals, and tiny negatives that round to -0.0
    qkv[:, 1::7] = -0.0  # stored as -0.0 (sign bit set), as torch's cast stores it
    _, k, v = qkv.split([4 * num_kv_heads * head_dim] + [num_kv_heads * head_dim] * 2, dim=-1)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(8 * BLOCK_SIZE, device=DEVICE)[:num_tokens]
    slots[-1] = -1  # a padding token: stored nowhere
    write_kv(ref_cache, k[:-1], v[:-1], slots[:-1])
    triton_launch.write_kv(cache, k, v, slots)
    for name in ("k", "v", "k_scale", "v_scale"):
        got, want = getattr(cache, name), getattr(ref_cache, name)
        if want is not None:
            assert torch.equal(_bits(got), _bits(want)), name
    if static != "dynamic":
        assert int(cache.num_saturated) == int(ref_cache.num_saturated) > 0


def _mixed_batch(
    num_kv_heads: int, head_dim: int, cache: LayerKVCache, seed: int
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Fill the cache for a ragged mixed batch; return its metadata and the used-slot mask.

    Decodes at block boundaries (15/16/17 tokens of context, 1, a long one), a chunked prefill
    over a cached prefix and a fresh prompt; contexts land in randomly permuted blocks.
    """
    rng = random.Random(seed)
    computed = [16, 15, 0, 70, 17, 13, 0]
    query_lens = [1, 1, 1, 1, 1, 20, 37]
    rng.shuffle(order := list(range(len(computed))))
    computed = [computed[i] for i in order]
    query_lens = [query_lens[i] for i in order]
    num_blocks = cache.k.shape[1]
    # block 0 stays unused (poisoned): zero-padded block-table entries point at it
    perm = rng.sample(range(1, num_blocks), num_blocks - 1)
    block_ids = []
    for c, q in zip(computed, query_lens):
        n = -(-(c + q) // BLOCK_SIZE)
        block_ids.append(perm[:n])
        perm = perm[n:]
    # the whole context through the reference writer (this step's tokens included)
    full = build_attention_metadata(
        [c + q for c, q in zip(computed, query_lens)], [0] * len(computed), block_ids,
        BLOCK_SIZE, DEVICE,
    )  # fmt: skip
    n = full.num_real_tokens
    dtype = _model_dtype(cache.k.dtype)
    k = torch.randn(n, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v = torch.randn(n, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    write_kv(cache, k, v, full.slot_mapping)
    used = torch.zeros(num_blocks * BLOCK_SIZE, dtype=torch.bool, device=DEVICE)
    used[full.slot_mapping] = True
    meta = build_attention_metadata(query_lens, computed, block_ids, BLOCK_SIZE, DEVICE)
    return meta, used


def _check_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(got).all(), "unwritten or poisoned values in the output"
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert rel <= REL_TOL[dtype], rel
    tol = ELEM_TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
def test_forward_matches_reference_on_a_ragged_mixed_batch(
    cache_dtype: torch.dtype, group: int, head_dim: int
) -> None:
    torch.manual_seed(group * head_dim)
    num_kv_heads = 2 if group < 8 else 1
    num_heads = group * num_kv_heads
    cache = _cache(cache_dtype, num_kv_heads, head_dim, 24, "dynamic")
    meta, used = _mixed_batch(num_kv_heads, head_dim, cache, seed=group + head_dim)
    dtype = _model_dtype(cache_dtype)
    num_tokens = meta.num_real_tokens + 3  # three padding tokens at the end
    q = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=DEVICE)
    want = attend_cache(q, cache, meta, head_dim**-0.5)

    for t in (cache.k, cache.v, cache.k_scale, cache.v_scale):
        if t is not None:
            _poison(t, ~used)
    backend = triton_backend.TritonAttention(DEVICE)
    out = torch.full_like(q, float("nan"))
    got = backend.attend(q, cache, backend.build_metadata(meta), head_dim**-0.5, out=out)
    assert got is out
    assert torch.equal(got[meta.num_real_tokens :], torch.zeros_like(got[meta.num_real_tokens :]))
    _check_close(got, want, dtype)


@pytest.mark.parametrize("static", ["dynamic", "head", "channel"])
def test_split_decode_and_static_scales_match_reference(static: str) -> None:
    """Several splits per context (and the reduce kernel) agree with the reference."""
    torch.manual_seed(1)
    num_kv_heads, group, head_dim = 2, 3, 64
    cache = _cache(torch.float8_e4m3fn, num_kv_heads, head_dim, 24, static)
    meta, used = _mixed_batch(num_kv_heads, head_dim, cache, seed=7)
    q = torch.randn(meta.num_real_tokens, num_kv_heads * group, head_dim, device=DEVICE)
    q = q.to(torch.bfloat16)
    want = attend_cache(q, cache, meta, head_dim**-0.5)
    for t in (cache.k, cache.v, cache.k_scale, cache.v_scale):
        if t is not None:
            _poison(t, ~used)

    # 16-token splits: the 71-token context gets up to 5, the others 1 or 2
    config = triton_launch.KernelConfig(decode_block_n=16, decode_min_split_tokens=16)
    backend = triton_backend.TritonAttention(DEVICE, config, num_splits=3)
    step = backend.build_metadata(meta)
    dec = meta.decode_token_ids
    outs = []
    for num_splits in (1, 3, 8):
        out = torch.full_like(q, float("nan"))
        triton_launch.paged_decode_attention(
            q, cache, out, step.decode_token_ids, step.decode_seq_lens,
            step.decode_block_tables, head_dim**-0.5, num_splits, config,
        )  # fmt: skip
        _check_close(out[dec], want[dec], torch.bfloat16)
        outs.append(out[dec])
    assert not torch.equal(outs[0], outs[2])  # the splits really differ
    nan = torch.full_like(q, float("nan"))
    out = backend.attend(q, cache, step, head_dim**-0.5, out=nan)
    _check_close(out, want, torch.bfloat16)


def test_rotated_decode_rotates_once_per_token_not_in_the_split_programs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rotated keys: q is rotated once per token before the split kernel and the output once
    after the reduce (docs/benchmarks.md's roofline), whatever the split count; the split
    kernel carries no rotation."""
    torch.manual_seed(3)
    num_kv_heads, group, head_dim = 2, 3, 64
    spec = KVCacheSpec(1, num_kv_heads, head_dim, BLOCK_SIZE, torch.float8_e4m3fn, hadamard=True)
    cache = allocate_kv_cache(spec, 24, DEVICE)[0]
    meta, _ = _mixed_batch(num_kv_heads, head_dim, cache, seed=7)
    q = torch.randn(meta.num_real_tokens, num_kv_heads * group, head_dim, device=DEVICE)
    q = q.to(torch.bfloat16)
    want = attend_cache(q, cache, meta, head_dim**-0.5)
    launches: list[tuple[str, object]] = []

    def recorder(name: str, kernel):  # type: ignore[no-untyped-def]
        class Recorder:
            def __getitem__(self, grid):  # type: ignore[no-untyped-def]
                def launch(*args, **kwargs):  # type: ignore[no-untyped-def]
                    launches.append((name, grid[2] if name == "decode" else kwargs.get("ROTATE")))
                    return kernel[grid](*args, **kwargs)

                return launch

        return Recorder()

    monkeypatch.setattr(
        triton_launch, "decode_kernel", recorder("decode", triton_launch.decode_kernel)
    )
    monkeypatch.setattr(
        triton_launch, "reduce_kernel", recorder("reduce", triton_launch.reduce_kernel)
    )
    monkeypatch.setattr(
        triton_launch, "rotate_q_kernel", recorder("rotate_q", triton_launch.rotate_q_kernel)
    )
    config = triton_launch.KernelConfig(decode_block_n=16, decode_min_split_tokens=16)
    step = triton_backend.TritonAttention(DEVICE, config).build_metadata(meta)
    dec = meta.decode_token_ids
    for num_splits in (1, 4):
        out = torch.full_like(q, float("nan"))
        triton_launch.paged_decode_attention(
            q, cache, out, step.decode_token_ids, step.decode_seq_lens,
            step.decode_block_tables, head_dim**-0.5, num_splits, config,
        )  # fmt: skip
        _check_close(out[dec], want[dec], torch.bfloat16)
    assert [name for name, _ in launches] == ["rotate_q", "decode", "reduce"] * 2
    assert [v for name, v in launches if name != "rotate_q"] == [1, True, 4, True]
    assert "ROTATE" not in inspect.signature(_MODULES["decode"].decode_kernel.fn).parameters


def test_split_rotated_decode_writes_only_the_decode_rows_with_kernels_alone() -> None:
    """Rotated keys over several splits: q's scattered decode rows (token_idx not arange, not
    sorted) are rotated and the outputs rotated back by the kernels themselves (no index_put,
    no torch matmul), into those rows of out alone, matching the reference; 18 query heads
    make the rotations take a partial second block of 16 heads."""
    torch.manual_seed(5)
    num_kv_heads, group, head_dim = 2, 9, 64
    spec = KVCacheSpec(1, num_kv_heads, head_dim, BLOCK_SIZE, torch.float8_e4m3fn, hadamard=True)
    cache = allocate_kv_cache(spec, 24, DEVICE)[0]
    meta, _ = _mixed_batch(num_kv_heads, head_dim, cache, seed=11)
    q = torch.randn(meta.num_real_tokens, num_kv_heads * group, head_dim, device=DEVICE)
    q = q.to(torch.bfloat16)
    want = attend_cache(q, cache, meta, head_dim**-0.5)
    config = triton_launch.KernelConfig(decode_block_n=16, decode_min_split_tokens=16)
    step = triton_backend.TritonAttention(DEVICE, config).build_metadata(meta)
    dec = step.decode_token_ids
    assert dec.shape[0] == 5
    # the same decode queries at scattered rows of a bigger batch; the other rows hold NaN
    token_idx = torch.tensor([9, 2, 14, 0, 6], device=DEVICE)
    scattered = torch.full((16, *q.shape[1:]), float("nan"), dtype=q.dtype, device=DEVICE)
    scattered[token_idx] = q[dec]
    out = torch.full_like(scattered, float("nan"))
    ops: list[str] = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Recorder():
        triton_launch.paged_decode_attention(
            scattered, cache, out, token_idx, step.decode_seq_lens, step.decode_block_tables,
            head_dim**-0.5, 4, config,
        )  # fmt: skip
    torch_math = [op for op in ops if any(w in op for w in ("index", "mm", "matmul", "arange"))]
    assert not torch_math, torch_math
    _check_close(out[token_idx], want[dec], torch.bfloat16)
    others = torch.ones(16, dtype=torch.bool, device=DEVICE)
    others[token_idx] = False
    assert torch.isnan(out[others]).all()


def test_decode_output_of_a_sequence_does_not_depend_on_the_batch() -> None:
    """Batch invariance: what CUDA-graph padding and eager steps rely on to agree."""
    torch.manual_seed(2)
    cache = _cache(torch.float8_e4m3fn, 2, 64, 24, "dynamic")
    meta, _ = _mixed_batch(2, 64, cache, seed=3)
    q = torch.randn(meta.num_real_tokens, 6, 64, dtype=torch.bfloat16, device=DEVICE)
    config = triton_launch.KernelConfig(decode_block_n=16, decode_min_split_tokens=16)
    step = triton_backend.TritonAttention(DEVICE, config).build_metadata(meta)
    full = torch.zeros_like(q)
    args = (step.decode_token_ids, step.decode_seq_lens, step.decode_block_tables)
    triton_launch.paged_decode_attention(q, cache, full, *args, 0.125, 4, config)
    for b in range(len(meta.decode_seq_ids)):  # each sequence alone
        alone = torch.zeros_like(q)
        triton_launch.paged_decode_attention(
            q, cache, alone, *(a[b : b + 1] for a in args), 0.125, 4, config
        )
        row = step.decode_token_ids[b]
        assert torch.equal(alone[row], full[row])


def test_decode_padding_sequences_get_zeros() -> None:
    """seq_len 0 (a CUDA-graph bucket's padding row) gives zeros, split or not."""
    cache = _cache(torch.bfloat16, 1, 64, 4, "dynamic")
    q = torch.randn(4, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    table = torch.zeros((4, 2), dtype=torch.int64, device=DEVICE)
    seq_lens = torch.tensor([5, 0, 20, 0], dtype=torch.int32, device=DEVICE)
    token_idx = torch.arange(4, device=DEVICE)
    for num_splits in (1, 2):
        out = torch.full_like(q, float("nan"))
        triton_launch.paged_decode_attention(
            q, cache, out, token_idx, seq_lens, table, 0.125, num_splits,
            triton_launch.KernelConfig(decode_block_n=16, decode_min_split_tokens=16),
        )  # fmt: skip
        assert torch.isfinite(out).all()
        assert not out[1].any() and not out[3].any()


def test_choose_num_splits_lets_one_sequence_reach_every_sm() -> None:
    assert triton_launch.choose_num_splits(8, 132) == 32  # H100 SXM, Llama-3-8B
    assert triton_launch.choose_num_splits(4, 132) == 64  # Qwen2-7B: capped
    assert triton_launch.choose_num_splits(8, 4) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
def test_long_context_decode_on_gpu(cache_dtype: torch.dtype) -> None:
    """Batch 16 over 2-4K-token contexts with the device's own split choice."""
    torch.manual_seed(0)
    num_kv_heads, group, head_dim, batch = 8, 4, 128, 16
    seq_lens = [random.Random(i).randint(2000, 4100) for i in range(batch)]
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    cache = _cache(cache_dtype, num_kv_heads, head_dim, sum(blocks_per_seq), "dynamic")
    perm = torch.randperm(sum(blocks_per_seq)).tolist()
    block_ids = []
    for n in blocks_per_seq:
        block_ids.append(perm[:n])
        perm = perm[n:]
    full = build_attention_metadata(seq_lens, [0] * batch, block_ids, BLOCK_SIZE, DEVICE)
    dtype = _model_dtype(cache_dtype)
    kv = torch.randn(2, full.num_real_tokens, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    write_kv(cache, kv[0], kv[1], full.slot_mapping)
    meta = build_attention_metadata(
        [1] * batch, [n - 1 for n in seq_lens], block_ids, BLOCK_SIZE, DEVICE
    )
    q = torch.randn(batch, num_kv_heads * group, head_dim, dtype=dtype, device=DEVICE)
    want = attend_cache(q, cache, meta, head_dim**-0.5)
    backend = triton_backend.TritonAttention(DEVICE)
    got = backend.attend(q, cache, backend.build_metadata(meta), head_dim**-0.5)
    _check_close(got, want, dtype)
