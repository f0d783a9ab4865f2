"""Decode attention (decode_kernel, decode_tail_kernel, reduce_kernel) against the reference
backend, over the cache formats, GQA groups and context lengths a server meets.

Each case fills a cache with the reference backend (one prefill step per sequence, which also
writes the exact tail's rings and sinks), then runs one decode step of every sequence through
both backends on copies of that cache. The Triton backend runs with 16-token tiles and splits
of at least 16 tokens over 8 splits: short contexts leave most splits without tokens, long
ones use all 8, and with the tail the sinks and the window go to decode_tail_kernel.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (Linux x86_64 test extra)")

from tests.gpu import triton_modules  # noqa: E402

_MODULES = triton_modules.load()
triton_backend = _MODULES["backend"]
triton_launch = _MODULES["launch"]
DEVICE = triton_modules.DEVICE

from infer8.attention.exact_tail import build_tail_metadata  # noqa: E402
from infer8.attention.kv_cache import KVCacheSpec, allocate_kv_cache  # noqa: E402
from infer8.attention.metadata import AttentionMetadata, build_attention_metadata  # noqa: E402
from infer8.attention.reference import ReferenceAttention, write_kv  # noqa: E402
from infer8.core.exact_tail_seats import ExactTailSeats  # noqa: E402
from tests.attention_schedule import clone_cache  # noqa: E402

BLOCK_SIZE, KVH, HEAD_DIM = 16, 2, 64
WINDOW, SINKS = 24, 4
CONFIG = triton_launch.KernelConfig(decode_block_n=16, decode_min_split_tokens=16)
# Norm-wise relative error against the reference's: the model dtype's rounding of q and of
# the output, a few times (bf16 2^-9, fp32's products on two fp16 terms ~2^-21).
REL_TOL = {torch.bfloat16: 1.5e-2, torch.float32: 1e-5}


def _decode(
    model_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    tail: bool,
    hadamard: bool,
    group: int,
    contexts: list[int],
    num_splits: int,
    config: object = CONFIG,
    prefill: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (Triton's, the reference's) decode outputs for sequences of `contexts` tokens.

    prefill False: the context is written with the reference's write_kv alone (no attention,
    no tail), for contexts too long for the reference's prefill attention.
    """
    gen = torch.Generator().manual_seed(sum(contexts) + group)
    spec = KVCacheSpec(1, KVH, HEAD_DIM, BLOCK_SIZE, cache_dtype, WINDOW if tail else 0,
                       SINKS if tail else 0, hadamard)  # fmt: skip
    num_blocks = sum(-(-c // BLOCK_SIZE) for c in contexts) + 1
    cache = allocate_kv_cache(spec, num_blocks, DEVICE, len(contexts) if tail else 0)[0]
    ids = random.Random(len(contexts)).sample(range(1, num_blocks), num_blocks - 1)
    blocks, at = [], 0
    for c in contexts:  # scattered blocks, as a long-running server's are
        n = -(-c // BLOCK_SIZE)
        blocks.append(ids[at : at + n])
        at += n
    kv = [torch.randn(2, c, KVH, HEAD_DIM, generator=gen) for c in contexts]
    for x in kv:
        x[:, :SINKS] *= 6  # large first tokens: the sinks matter
    seats = ExactTailSeats(len(contexts), WINDOW, SINKS, BLOCK_SIZE) if tail else None
    ref = ReferenceAttention()

    def step(seqs: list[int], q_lens: list[int], computed: list[int]) -> AttentionMetadata:
        meta = build_attention_metadata(q_lens, computed, [blocks[i] for i in seqs], BLOCK_SIZE,
                                        DEVICE)  # fmt: skip
        if seats is not None:
            held = [seats.get(str(i)) or seats.seat(str(i), c, blocks[i][0])
                    for i, c in zip(seqs, computed)]  # fmt: skip
            meta.tail = build_tail_metadata(
                WINDOW, SINKS, [x.row for x in held], [x.exact_start for x in held],
                [(x.sink_slot, x.writes_sinks) for x in held], q_lens, computed,
                meta.decode_seq_ids, meta.decode_block_tables.shape[1] * BLOCK_SIZE, DEVICE,
            )  # fmt: skip
        return meta

    def qkv(seqs: list[int], ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
        k = torch.cat([kv[i][0, a:b] for i, (a, b) in zip(seqs, ranges)])
        v = torch.cat([kv[i][1, a:b] for i, (a, b) in zip(seqs, ranges)])
        q = torch.randn(len(k), KVH * group, HEAD_DIM, generator=gen)
        return [x.to(DEVICE, model_dtype) for x in (q, k, v)]

    first = [i for i, c in enumerate(contexts) if c > 1]  # the prompts before the decode
    if prefill and first:
        meta = step(first, [contexts[i] - 1 for i in first], [0] * len(first))
        q, k, v = qkv(first, [(0, contexts[i] - 1) for i in first])
        ref.write_and_attend(q, k, v, cache, ref.build_metadata(meta), HEAD_DIM**-0.5)
    elif first:
        assert not tail, "the tail's rings are written by steps"
        meta = build_attention_metadata([contexts[i] - 1 for i in first], [0] * len(first),
                                        [blocks[i] for i in first], BLOCK_SIZE, DEVICE)  # fmt: skip
        _, k, v = qkv(first, [(0, contexts[i] - 1) for i in first])
        if cache.rotation is not None:
            from infer8.attention.exact_tail import rotate

            k, v = rotate(k, cache.rotation), rotate(v, cache.rotation)
        write_kv(cache, k, v, meta.slot_mapping)
    seqs = list(range(len(contexts)))
    meta = step(seqs, [1] * len(seqs), [c - 1 for c in contexts])
    q, k, v = qkv(seqs, [(c - 1, c) for c in contexts])
    tri = triton_backend.TritonAttention(DEVICE, config, num_splits=num_splits)
    got = tri.write_and_attend(q, k, v, clone_cache(cache), tri.build_metadata(meta),
                               HEAD_DIM**-0.5)  # fmt: skip
    want = ref.write_and_attend(q, k, v, clone_cache(cache), ref.build_metadata(meta),
                                HEAD_DIM**-0.5)  # fmt: skip
    return got, want


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


# Every value of each axis, in pairs: E4M3 / E5M2, tail on / off, rotation on / off,
# GQA groups 1, 4, 8; contexts from 1 token (a split of one) to past the 8 splits' reach.
# The first runs in every suite, the rest in the slow group.
CASES = [
    (torch.float8_e4m3fn, True, True, 4),  # the engine's default
    (torch.float8_e5m2, False, False, 1),
    (torch.float8_e4m3fn, False, True, 8),
    (torch.float8_e4m3fn, True, False, 1),
    (torch.float8_e4m3fn, False, False, 4),
    (torch.float8_e5m2, True, False, 8),
    (torch.float8_e5m2, True, True, 1),
    (torch.float8_e5m2, False, True, 4),
]
CONTEXTS = [1, 3, 5, 24, 29, 40, 150, 301]


@pytest.mark.parametrize(
    "cache_dtype, tail, hadamard, group",
    [pytest.param(*case, marks=[pytest.mark.slow] if i else [],
                  id=f"{str(case[0])[11:]}-{'tail' if case[1] else 'notail'}-"
                     f"{'rot' if case[2] else 'plain'}-g{case[3]}")
     for i, case in enumerate(CASES)],
)  # fmt: skip
def test_decode_matches_the_reference(
    cache_dtype: torch.dtype, tail: bool, hadamard: bool, group: int
) -> None:
    got, want = _decode(torch.bfloat16, cache_dtype, tail, hadamard, group, CONTEXTS, 8)
    assert _rel(got, want) < REL_TOL[torch.bfloat16]


@pytest.mark.parametrize(
    "cache_dtype, tail, group",
    [
        (torch.float8_e4m3fn, True, 4),
        pytest.param(torch.float8_e4m3fn, True, 1, marks=pytest.mark.slow),
        pytest.param(torch.float8_e5m2, False, 8, marks=pytest.mark.slow),
    ],
)
def test_fp32_models_multiply_on_two_fp16_terms_to_fp32_accuracy(
    cache_dtype: torch.dtype, tail: bool, group: int
) -> None:
    """An fp32 model over an FP8 cache: q and the softmax weights split into two fp16 terms
    keep the products to ~2^-21 (~2e-7 measured; the tail kernel runs in fp32), so a position
    read twice or missed (~1/300 of a 301-token context's weight) shows."""
    got, want = _decode(torch.float32, cache_dtype, tail, False, group, CONTEXTS, 8)
    assert _rel(got, want) < REL_TOL[torch.float32]


def test_the_tail_kernel_owns_the_sinks_and_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the tail, decode_kernel skips the sinks and the window's tiles: left to it alone
    (decode_tail_kernel's slot dropped), outputs miss those positions and are far off."""
    good, want = _decode(torch.bfloat16, torch.float8_e4m3fn, True, False, 4, CONTEXTS, 8)
    launches = []

    class NoTail:  # its slot as a split without tokens writes it: -inf and zeros
        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            def launch(*args, **kwargs):  # type: ignore[no-untyped-def]
                mid_out, mid_lse, slot = args[7], args[8], args[-1]
                mid_out[:, :, slot] = 0.0
                mid_lse[:, :, slot] = float("-inf")
                launches.append(grid)

            return launch

    monkeypatch.setattr(triton_launch, "decode_tail_kernel", NoTail())
    bad, _ = _decode(torch.bfloat16, torch.float8_e4m3fn, True, False, 4, CONTEXTS, 8)
    assert launches, "the tail kernel was not launched"
    assert _rel(good, want) < REL_TOL[torch.bfloat16] < 0.1 < _rel(bad, want)


@pytest.mark.slow
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_long_contexts_at_the_default_kernel_config(cache_dtype: torch.dtype) -> None:
    """32K and 8K contexts beside short ones, at the engine's tile sizes and a GPU's splits."""
    contexts = [32768, 8193, 17, 1]
    got, want = _decode(torch.bfloat16, cache_dtype, False, cache_dtype != torch.bfloat16, 8,
                        contexts, 32, triton_launch.KernelConfig(), prefill=False)  # fmt: skip
    assert _rel(got, want) < REL_TOL[torch.bfloat16]
