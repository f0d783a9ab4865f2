"""Exact-tail indices, seats, Hadamard rotation and the tail's memory accounting (no weights)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from infer8.attention.exact_tail import (
    DEFAULT_EXACT_SINK_TOKENS,
    DEFAULT_EXACT_TAIL_TOKENS,
    ExactTailConfig,
    _decode_positions,
    add_residual,
    build_tail_metadata,
    describe_exact_tail,
    hadamard,
    quantize_residual,
    resolve_exact_tail,
    rotate,
    tail_segment,
)
from infer8.attention.kv_cache import KVCacheSpec
from infer8.plan import PlanInputs, exact_tail_bytes, plan_capacity
from infer8.plan_cli import format_plan
from infer8.plan_presets import DEVICE_PRESETS, load_model_shape
from infer8.quant import fp8
from infer8.quant.fp8 import kv_dtype_name


def test_hadamard_rotation_keeps_attention_scores() -> None:
    h = hadamard(64)
    assert torch.allclose(h @ h, torch.eye(64), atol=1e-6)  # symmetric, its own inverse
    q, k = torch.randn(5, 3, 64), torch.randn(7, 3, 64)
    k[:, :, 5] *= 40  # an outlier channel is spread over the whole head
    scores = torch.einsum("qhd,khd->hqk", q, k)
    scores_rot = torch.einsum("qhd,khd->hqk", rotate(q, h), rotate(k, h))
    assert torch.allclose(scores, scores_rot, rtol=1e-4, atol=1e-3)
    assert rotate(k, h).abs().amax(-1).mean() < k.abs().amax(-1).mean() / 3


def test_a_long_chunk_writes_only_its_last_w_minus_1_tokens_to_the_ring() -> None:
    # window 4 (ring 3), no sinks; seq 0: prefill chunk [10, 18) on row 2; seq 1: decode at 5
    no_sinks = [(-1, False)] * 2
    meta = build_tail_metadata(
        4, 0, [2, 0], [0, 3], no_sinks, [8, 1], [10, 5], [1], 8, torch.device("cpu")
    )
    assert meta.write_token_ids.tolist() == [5, 6, 7, 8]
    assert meta.write_slots.tolist() == [2 * 3 + 15 % 3, 2 * 3 + 16 % 3, 2 * 3 + 17 % 3, 5 % 3]
    # rows read: the decode's ring row and sink row (none: row 0, unused), then row 2
    assert meta.read_rows.tolist() == [0, 0, 2]
    # the chunk reads positions 7, 8, 9 from the ring (queries at 10.. see (a - 4, a]),
    # in the third row read
    assert meta.ring_read_slots[0].tolist() == [6 + 7 % 3, 6 + 8 % 3, 6 + 9 % 3]
    # the decode token at 5 reads 3, 4 from its ring (offsets 0, 1): its row holds exact
    # values from 3 only, so offset 2 (position 2) is unused; its new token is at 0 * 8 + 5
    assert meta.decode_pos.tolist() == [[3, 4, 0, 0, 0, 0]]
    assert meta.decode_valid.tolist() == [[1, 1, 0, 0, 0, 0]]
    assert meta.decode_new.tolist() == [5]
    # segments of 4 windows (16 positions) cut windows at 16, 32, ...: a chunk starting at 17
    # reads only 16 from the ring, a decode at 16 reads none of it
    meta = build_tail_metadata(
        4, 0, [2, 0], [0, 0], no_sinks, [4, 1], [17, 16], [1], 24, torch.device("cpu")
    )
    assert tail_segment(4) == 16
    assert meta.ring_read_slots[0].tolist() == [6 + 16 % 3]
    assert meta.decode_valid.tolist() == [[0, 0, 0, 0, 0, 0]]


def test_sinks_are_written_by_the_first_chunk_and_read_by_later_decodes() -> None:
    # window 4 (ring 3), 2 sinks: a row's store is 5 wide (ring offsets 0-2, sink offsets 3-4).
    # seq 0 prefills [0, 3) on row 1 and writes the sinks of sink slot 1; seq 1 decodes at 9
    # on row 0 and reads the sinks of slot 0, which another request wrote (a prefix hit).
    cpu = torch.device("cpu")
    meta = build_tail_metadata(
        4, 2, [1, 0], [0, 0], [(1, True), (0, False)], [3, 1], [0, 9], [1], 16, cpu
    )
    assert meta.sink_write_token_ids.tolist() == [0, 1]
    assert meta.sink_write_slots.tolist() == [1 * 5 + 3, 1 * 5 + 4]
    assert meta.write_token_ids.tolist() == [0, 1, 2, 3]
    assert meta.write_slots.tolist() == [5, 6, 7, 9 % 3]
    assert meta.num_sinks == [2, 2]
    assert meta.read_rows.tolist() == [0, 0]  # its ring row, its sink slot's row
    # ring offsets hold 6, 7, 8; the sink row's sink offsets hold 0, 1
    assert meta.decode_pos.tolist() == [[6, 7, 8, 0, 0, 0, 0, 0, 0, 1]]
    assert meta.decode_valid.tolist() == [[1, 1, 1, 0, 0, 0, 0, 0, 1, 1]]
    # a sequence whose window still covers its first positions reads no sink from the store
    meta = build_tail_metadata(4, 2, [0], [0], [(0, True)], [1], [2], [0], 16, cpu)
    assert meta.decode_pos.tolist()[0][:3] == [0, 1, 0]  # from the ring: positions 0, 1
    assert meta.decode_valid.tolist() == [[1, 1] + [0] * 8]
    assert meta.sink_write_slots.tolist() == []


def test_block_value_plus_residual_carries_about_8_mantissa_bits() -> None:
    x = torch.randn(64, 3, 64) * torch.logspace(-2, 2, 64)[:, None, None]
    s = fp8.dynamic_scale(x, torch.float8_e4m3fn)[..., None]
    block = fp8.dequantize(fp8.quantize(x, s, torch.float8_e4m3fn), s, torch.float32)
    tail = add_residual(block, *quantize_residual(x, block))
    amax = x.abs().amax(-1, keepdim=True)
    assert ((block - x).abs() / amax).max() > 2**-6  # E4M3 alone: ~3 mantissa bits
    assert ((tail - x).abs() / amax).max() < 2**-8  # with the residual: bf16's class
    assert quantize_residual(x, block)[0].dtype == torch.float8_e4m3fn


def test_auto_turns_the_tail_on_only_for_fp8_where_the_kernels_read_it() -> None:
    from infer8.device_probe import tail_kernels_available

    cuda = torch.device("cuda")
    assert tail_kernels_available(torch.device("cpu"))
    assert tail_kernels_available(cuda, (9, 0)) and tail_kernels_available(cuda, (8, 9))
    assert not tail_kernels_available(cuda, (8, 0))  # Ampere: no E4M3 for the residuals
    default = ExactTailConfig(DEFAULT_EXACT_TAIL_TOKENS, DEFAULT_EXACT_SINK_TOKENS, True)
    assert resolve_exact_tail(None, None, True, True, False, 64) == default
    assert resolve_exact_tail(None, None, True, False, False, 64) == ExactTailConfig()  # sm_80
    assert resolve_exact_tail(8, True, False, True, False, 64) == ExactTailConfig()  # bf16
    static = resolve_exact_tail(None, None, True, True, True, 64)
    assert static == ExactTailConfig(DEFAULT_EXACT_TAIL_TOKENS, DEFAULT_EXACT_SINK_TOKENS)
    assert resolve_exact_tail(0, None, True, True, False, 64).sink_tokens == 0  # no tail
    with pytest.raises(ValueError, match="dynamic scales"):
        resolve_exact_tail(None, True, True, True, True, 64)
    with pytest.raises(ValueError, match="needs kv_cache_exact_tail_tokens"):
        resolve_exact_tail(0, None, True, True, False, 64, sink_tokens=4)
    with pytest.raises(ValueError, match="fit in one block"):
        resolve_exact_tail(None, None, True, True, False, 64, sink_tokens=9, block_size=8)


def _default_model_spec(dtype: torch.dtype, tail: int = 0, sinks: int = 0) -> KVCacheSpec:
    return KVCacheSpec(30, 3, 64, 16, dtype, tail, sinks)  # SmolLM2-135M


def test_fp8_with_the_default_tail_holds_at_least_1_9x_the_bf16_sessions() -> None:
    # `infer8 bench capacity` defaults: 512 MiB, 1,024-token sessions, seats = the offer
    # (arithmetic + a 10% margin), so the rings of every seat come out of the budget.
    budget, blocks_per_session = 512 << 20, 1024 // 16
    bf16 = _default_model_spec(torch.bfloat16).num_blocks_for(budget) // blocks_per_session
    spec = _default_model_spec(
        torch.float8_e4m3fn, DEFAULT_EXACT_TAIL_TOKENS, DEFAULT_EXACT_SINK_TOKENS
    )
    plain = spec.num_blocks_for(budget) // blocks_per_session
    seats = plain + max(2, plain // 10)
    sessions = spec.num_blocks_for(budget, seats) // blocks_per_session
    # 23 ring + 4 sink residual tokens per seat, each an FP8 token's bytes (64 + a bf16 scale)
    assert spec.tail_bytes(seats) == seats * 27 * 2 * 3 * (64 + 2) * 30
    assert sessions < plain and sessions / bf16 >= 1.9, (sessions, plain, bf16)


def test_plan_counts_the_tail_rings() -> None:
    base = PlanInputs(
        model=load_model_shape("smollm2-135m"),
        device=DEVICE_PRESETS["h100-80gb"],
        kv_cache_dtype="fp8_e4m3",
        kv_cache_exact_tail_tokens=0,
    )
    with_tail = dataclasses.replace(
        base, kv_cache_exact_tail_tokens=16, kv_cache_exact_sink_tokens=0
    )
    a, b = plan_capacity(base), plan_capacity(with_tail)
    store_tokens = 256 * 15
    lost_tokens = a.max_kv_tokens - b.max_kv_tokens
    # a residual token costs an FP8 token (with its scales); rounded to blocks
    assert a.kv_bytes_per_token_per_device == 2 * 3 * (64 + 2) * 30
    assert abs(lost_tokens - store_tokens) <= 16
    assert b.to_json_dict()["kv_exact_tail_bytes_per_device"] == store_tokens * 2 * 3 * 66 * 30
    sinks = dataclasses.replace(with_tail, kv_cache_exact_sink_tokens=4)
    assert plan_capacity(sinks).to_json_dict()["kv_exact_tail_bytes_per_device"] == (
        256 * 19 * 2 * 3 * 66 * 30
    )
    assert "256 seats x (16 - 1 + 4) FP8 residual tokens" in format_plan(plan_capacity(sinks))
    assert "exact tail" not in format_plan(a)
    # auto is the engine's: a tail on GPUs with E4M3 (the Triton kernels read it), none on A100s
    auto = dataclasses.replace(
        base, kv_cache_exact_tail_tokens=None, kv_cache_exact_sink_tokens=None
    )
    assert (auto.kv_cache_exact_tail_tokens, auto.kv_cache_exact_sink_tokens) == (24, 4)
    a100 = dataclasses.replace(
        auto, device=DEVICE_PRESETS["a100-80gb"], kv_cache_dtype="fp8_e5m2",
        kv_cache_exact_tail_tokens=None, kv_cache_exact_sink_tokens=None,
    )  # fmt: skip
    assert a100.kv_cache_exact_tail_tokens == 0 and exact_tail_bytes(a100) == 0


def test_decode_positions_match_a_sequence_by_sequence_reading() -> None:
    """The decode sequences' read positions, built as tensors, against the plain per-sequence
    definition: ring offset j holds the position p in [s0 - ring, s0) with p % ring == j,
    valid from the latest of the ring's oldest position, the query's segment start and the
    sequence's first exact position; its sinks valid below that."""
    rng = random.Random(0)
    for _ in range(500):
        ring, sinks = rng.choice([0, 1, 5, 23]), rng.choice([0, 1, 4])
        n = rng.randint(0, 6)
        s0 = [rng.randint(0, 300) for _ in range(n)]  # windows cut at 4, 8, 20 or 96
        starts = [max(0, x - rng.randint(0, 60)) for x in s0]
        slots = [rng.choice([-1, rng.randint(0, 9)]) for _ in range(n)]
        want_pos, want_valid = [], []
        for s, start, slot in zip(s0, starts, slots):
            segment = tail_segment(ring + 1)
            lo = max(start, s - ring, s // segment * segment)
            ring_pos = [s - ring + (j - (s - ring)) % ring for j in range(ring)]
            num_read = min(sinks if slot >= 0 else 0, lo)
            pos = ring_pos + [0] * (sinks + ring) + list(range(sinks))
            valid = [float(p >= lo) for p in ring_pos] + [0.0] * (sinks + ring)
            valid += [float(p < num_read) for p in range(sinks)]
            want_pos.append([p if v else 0 for p, v in zip(pos, valid)])
            want_valid.append(valid)
        pos, valid = _decode_positions(ring + 1, sinks, s0, starts, slots)
        assert pos.dtype == torch.int64 and valid.dtype == torch.float32
        assert pos.shape == valid.shape == (n, 2 * (ring + sinks))
        assert pos.tolist() == want_pos and valid.tolist() == want_valid


def test_start_up_line_says_which_tokens_stay_exact() -> None:
    """Check the FP8 cache's start-up suffix names the tokens kept at 16-bit, in words."""
    spec = KVCacheSpec(
        num_layers=30,
        num_kv_heads=3,
        head_dim=64,
        block_size=16,
        dtype=torch.float8_e4m3fn,
        exact_tail_tokens=24,
        exact_sink_tokens=4,
        hadamard=True,
    )
    mib = spec.tail_bytes(256) / (1 << 20)
    assert describe_exact_tail(spec, 256) == (
        f"; each running request's first 4 and last 24 tokens read at 16-bit precision "
        f"({mib:.1f} MiB of it, for up to 256 running requests); K and V Hadamard-rotated "
        "before quantizing"
    )
    assert kv_dtype_name(spec.dtype) == "FP8 (E4M3)"
    assert kv_dtype_name(torch.float8_e5m2) == "FP8 (E5M2)"
    assert kv_dtype_name(torch.bfloat16) == "bfloat16"
