"""Prefill attention split into key ranges and a band equals one masked softmax over all keys."""

from __future__ import annotations

import pytest
import torch

from infer8.attention.cpu.split_prefill import (
    KeyRange,
    split_prefill_attention,
    two_value_attention,
)
from infer8.attention.cpu.tail_prefill import SequenceTail, dense_parts, prefill_parts


def _masked_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Explicit softmax attention: q [H, n, d], k/v [kvh, m, d], mask [n, m] (True = seen)."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = (q.double() @ k.double().transpose(1, 2)) * scale
    scores.masked_fill_(~mask, -float("inf"))
    return (torch.softmax(scores, -1) @ v.double()).float()


def test_a_cached_prefix_and_a_causal_chunk() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(6, 37, 16), torch.randn(2, 100, 16), torch.randn(2, 100, 16)
    s0 = 63  # the chunk holds positions 63..99
    ranges = [KeyRange(k[:, :s0], v[:, :s0]), KeyRange(k[:, s0:], v[:, s0:], causal=True)]
    mask = torch.arange(100)[None, :] <= torch.arange(s0, 100)[:, None]
    ref = _masked_reference(q, k, v, mask, 0.25)
    assert (split_prefill_attention(q, ranges, None, 0.25) - ref).abs().max() < 1e-5


@pytest.mark.parametrize(
    "s0, q_len, window, exact_start, num_sinks",
    [(0, 50, 6, 0, 4), (40, 30, 6, 0, 4), (40, 30, 6, 16, 4), (40, 30, 6, 38, 4),
     (3, 10, 8, 0, 4), (40, 1, 4, 0, 0), (20, 5, 30, 0, 2), (40, 30, 1, 0, 4), (0, 300, 24, 0, 4),
     (261, 40, 24, 192, 4), (90, 20, 24, 0, 4)],
)  # fmt: skip
def test_tail_parts_match_the_masked_rule(
    s0: int, q_len: int, window: int, exact_start: int, num_sinks: int
) -> None:
    # query a reads tail values from its window's start, cut at its segment's start (segments
    # of 4 windows) and at exact_start, quantized values before (its first num_sinks at tail
    # precision): the rule spelled out as a mask.
    torch.manual_seed(1)
    seq_len, kvh, d = s0 + q_len, 2, 16
    kb, vb = torch.randn(kvh, seq_len, d), torch.randn(kvh, seq_len, d)  # block values
    kt, vt = kb + 0.1 * torch.randn_like(kb), vb + 0.1 * torch.randn_like(vb)  # tail values
    segment = 4 * window
    lo = max(exact_start, s0 - window + 1, s0 // segment * segment)
    # store rows: the ring's residuals of [lo, s0), then the sinks' of [0, min(S, lo))
    ring_pos = list(range(lo, s0))
    sink_pos = list(range(min(num_sinks, lo)))
    res_k = torch.cat([kt[:, ring_pos] - kb[:, ring_pos], kt[:, sink_pos] - kb[:, sink_pos]], 1)
    res_v = torch.cat([vt[:, ring_pos] - vb[:, ring_pos], vt[:, sink_pos] - vb[:, sink_pos]], 1)
    ring_slots = torch.arange(len(ring_pos))
    sink_slots = torch.arange(len(ring_pos), len(ring_pos) + len(sink_pos))
    new = (kt[:, s0:].transpose(0, 1), vt[:, s0:].transpose(0, 1))
    seq_tail = SequenceTail(
        (res_k, res_v), new, ring_slots, sink_slots, num_sinks, exact_start, window
    )
    ranges, band = prefill_parts(kb.clone(), vb.clone(), seq_tail)
    q = torch.randn(2 * kvh, q_len, d)
    got = split_prefill_attention(q, ranges, band, 0.3)

    a = torch.arange(s0, seq_len)[:, None]
    j = torch.arange(seq_len)[None, :]
    first_exact = torch.maximum(a - window + 1, a // segment * segment).clamp(min=exact_start)
    quant_seen = (j <= a) & (j < first_exact)
    tail_seen = (j <= a) & (j >= first_exact)
    # keys: every position twice, as its quantized (block) value and as its tail value; a sink
    # is read at tail precision where it is read quantized
    sink = j < num_sinks
    k_all = torch.cat([torch.where(sink[..., None], kt, kb), kt], 1)
    v_all = torch.cat([torch.where(sink[..., None], vt, vb), vt], 1)
    ref = _masked_reference(q, k_all, v_all, torch.cat([quant_seen, tail_seen], 1), 0.3)
    assert (got - ref).abs().max() < 1e-5
    # the dense form short prompts take: the same rule, the same numbers
    exact, reads = dense_parts(kb.clone(), vb.clone(), seq_tail)
    dense = two_value_attention(q, (kb, exact[0]), (vb, exact[1]), reads, s0, 0.3)
    assert (dense - ref).abs().max() < 1e-5
    # and its native pass (GQA 2: each task's third head slot is padding)
    native = _native().two_value_attention(q, (kb, exact[0]), (vb, exact[1]), reads, s0, 0.3)
    assert native.shape == q.shape and (native - ref).abs().max() < 1e-5


def _native():  # noqa: ANN202
    from infer8.kernels.cpu import NativeKernels

    kernels = NativeKernels.load()
    assert kernels is not None
    return kernels.prefill


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "s0, q_len, group, d",
    [(0, 128, 3, 64), (70, 61, 3, 64), (5, 3, 4, 64), (0, 9, 1, 64), (0, 37, 3, 128),
     (3, 30, 3, 96), (0, 21, 3, 72)],
)  # fmt: skip
def test_native_two_value_attention_matches_torch(
    dtype: torch.dtype, s0: int, q_len: int, group: int, d: int
) -> None:
    """The C pass against two_value_attention in float32 on the same (rounded) inputs: q as
    the model hands it (a [H, q_len, d] view of [q_len, H, d]), a band and sinks read second.
    bf16 with AVX512-BF16 takes dot products of bf16 pairs (head dims in slabs of 32: 64, 128,
    and 96's slab of 32 after one of 64; 72 takes the float32 path), odd key counts included."""
    torch.manual_seed(2)
    kvh, n, window = 3, s0 + q_len, 24
    q = torch.randn(q_len, kvh * group, d).to(dtype).transpose(0, 1)
    kb, vb = torch.randn(kvh, n, d).to(dtype), torch.randn(kvh, n, d).to(dtype)
    ke, ve = (kb + 0.2 * torch.randn_like(kb)).to(dtype), (vb + 0.2 * torch.randn_like(vb))
    ve = ve.to(dtype)
    j, a = torch.arange(n)[None, :], torch.arange(s0, n)[:, None]
    reads = (j > a - window) | (j < 4)
    f = [x.float() for x in (q, kb, ke, vb, ve)]
    want = two_value_attention(f[0], (f[1], f[2]), (f[3], f[4]), reads, s0, 0.125)
    got = _native().two_value_attention(q, (kb, ke), (vb, ve), reads, s0, 0.125)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the output's rounding
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
def test_native_two_value_rotations_are_the_separate_rotations(dtype: torch.dtype, d: int) -> None:
    """rotate_q / rotate_out inside the pass: bit for bit the native rotation of q before the
    call and of its output after it (an FP8 prefill with Hadamard-rotated keys)."""
    from infer8.kernels.cpu import NativeKernels

    kernels = NativeKernels.load()
    assert kernels is not None
    native, rotate = kernels.prefill, kernels.elementwise.rotate
    torch.manual_seed(3)
    kvh, group, s0, q_len, window = 3, 3, 6, 40, 24
    n = s0 + q_len
    q = (torch.randn(q_len, kvh * group, d) * 2).to(dtype)
    kb, ke = ((torch.randn(kvh, n, d) * 2).to(dtype) for _ in range(2))
    vb, ve = (torch.randn(kvh, n, d).to(dtype) for _ in range(2))
    j, a = torch.arange(n)[None, :], torch.arange(s0, n)[:, None]
    reads = (j > a - window) | (j < 4)
    args = ((kb, ke), (vb, ve), reads, s0, 0.125)
    got = native.two_value_attention(q.transpose(0, 1), *args, True, True)
    inner = native.two_value_attention(rotate(q).transpose(0, 1), *args)
    want = rotate(inner.transpose(0, 1))
    assert torch.equal(got.transpose(0, 1), want)
    assert not torch.equal(inner, got)  # the rotations change the output


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "q_len, window, valid_from, first, exact_start",
    [(200, 24, 0, 17, 0), (70, 24, 30, 0, 48), (5, 8, 11, -7, 0), (64, 24, 0, 60, 0),
     (150, 8, 0, 40, 0)],
)  # fmt: skip
def test_native_band_matches_the_torch_band(
    q_len: int, window: int, valid_from: int, first: int, exact_start: int, dtype: torch.dtype
) -> None:
    """The C band (float32 or bf16 CPU) against _band_part in float32 on the same inputs:
    outputs and log-sum-exps, GQA 3, each query's segment in the second values and the
    positions before it in the first; rows that see no key (valid_from past their window) get
    -inf and zeros in both."""
    from infer8.attention.cpu.split_prefill import Band, _band_part

    native = _native()
    torch.manual_seed(0)
    kvh, group, d = 3, 3, 64
    q = torch.randn(kvh * group, q_len, d)
    k = torch.randn(kvh, q_len + window - 1, d) * 2
    v = torch.randn(kvh, q_len + window - 1, d)
    kq, vq = k + torch.randn_like(k), v + torch.randn_like(v)
    q, k, v, kq, vq = (x.to(dtype) for x in (q, k, v, kq, vq))
    f = [x.float() for x in (k, v, kq, vq)]
    want_out, want_lse = _band_part(
        q.float(),
        Band(f[0], f[1], window, valid_from, f[2], f[3], first, exact_start, 4 * window),
        0.125,
    )
    band = Band(k, v, window, valid_from, kq, vq, first, exact_start, 4 * window)
    got_out, got_lse = native.band_attention(q, band, 0.125)
    assert got_out.dtype == dtype and got_lse.dtype == torch.float32
    unseen = want_lse == -float("inf")
    assert torch.equal(got_lse == -float("inf"), unseen)
    assert unseen.any() == (valid_from >= window)
    torch.testing.assert_close(got_lse[~unseen], want_lse[~unseen], rtol=1e-5, atol=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the output's rounding
    torch.testing.assert_close(got_out.float(), want_out, rtol=tol, atol=tol)
    if q_len >= window:  # the first values matter: the same band read all-exact differs
        all_exact = Band(k, v, window, valid_from, k, v, first, exact_start, 4 * window)
        assert (native.band_attention(q, all_exact, 0.125)[0] - got_out).abs().max() > 0.05
