"""Exact-tail indices, seats, Hadamard rotation and the tail's memory accounting (no weights)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from infer8.attention.exact_tail import (
    DEFAULT_EXACT_TAIL_TOKENS,
    TailRows,
    build_tail_metadata,
    hadamard,
    resolve_exact_tail,
    rotate,
)
from infer8.plan import DEVICE_PRESETS, PlanInputs, load_model_shape, plan_capacity
from infer8.worker.kv_cache import KVCacheSpec


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
    # window 4 (ring 3); seq 0: prefill chunk [10, 18) on row 2; seq 1: decode at position 5
    meta = build_tail_metadata(4, [2, 0], [0, 3], [8, 1], [10, 5], [1], torch.device("cpu"))
    assert meta.write_token_ids.tolist() == [5, 6, 7, 8]
    assert meta.write_slots.tolist() == [2 * 3 + 15 % 3, 2 * 3 + 16 % 3, 2 * 3 + 17 % 3, 5 % 3]
    # the chunk reads positions 7, 8, 9 from the ring (queries at 10.. see (a - 4, a])
    assert meta.ring_read_slots[0].tolist() == [6 + 7 % 3, 6 + 8 % 3, 6 + 9 % 3]
    # the decode token at 5 reads 3, 4 from the ring: its row holds exact values from 3 only
    b, pos, slots = meta.decode_overlay
    assert b.tolist() == [0, 0] and pos.tolist() == [3, 4] and slots.tolist() == [0, 1]


def test_seats_are_reused_and_a_resumed_request_starts_a_new_exact_range() -> None:
    rows = TailRows(2)
    assert rows.row_for("a", 0) == (0, 0) and rows.row_for("b", 32) == (1, 32)
    assert rows.row_for("a", 50) == (0, 0)  # still the same row and range
    rows.release(["a"])  # finished or preempted
    assert rows.row_for("c", 16) == (0, 16)


def test_auto_turns_the_tail_on_only_for_fp8_on_the_reference_backend() -> None:
    assert resolve_exact_tail(None, None, True, True, False, 64) == (
        DEFAULT_EXACT_TAIL_TOKENS,
        True,
    )
    assert resolve_exact_tail(None, None, True, False, False, 64) == (0, False)  # Triton
    assert resolve_exact_tail(8, True, False, True, False, 64) == (0, False)  # bf16 cache
    assert resolve_exact_tail(None, None, True, True, True, 64) == (16, False)  # static scales
    with pytest.raises(ValueError, match="dynamic scales"):
        resolve_exact_tail(None, True, True, True, True, 64)


def _default_model_spec(dtype: torch.dtype, tail: int = 0) -> KVCacheSpec:
    return KVCacheSpec(30, 3, 64, 16, dtype, tail, torch.bfloat16)  # SmolLM2-135M


def test_fp8_with_the_default_tail_holds_at_least_1_9x_the_bf16_sessions() -> None:
    # `infer8 bench capacity` defaults: 512 MiB, 1,024-token sessions, seats = the offer
    # (arithmetic + a 10% margin), so the rings of every seat come out of the budget.
    budget, blocks_per_session = 512 << 20, 1024 // 16
    bf16 = _default_model_spec(torch.bfloat16).num_blocks_for(budget) // blocks_per_session
    spec = _default_model_spec(torch.float8_e4m3fn, DEFAULT_EXACT_TAIL_TOKENS)
    plain = spec.num_blocks_for(budget) // blocks_per_session
    seats = plain + max(2, plain // 10)
    fp8 = spec.num_blocks_for(budget, seats) // blocks_per_session
    assert spec.tail_bytes(seats) == seats * 15 * 2 * 3 * 64 * 2 * 30
    assert fp8 < plain and fp8 / bf16 >= 1.9, (fp8, plain, bf16)


def test_plan_counts_the_tail_rings() -> None:
    base = PlanInputs(
        model=load_model_shape("smollm2-135m"),
        device=DEVICE_PRESETS["h100-80gb"],
        kv_cache_dtype="fp8_e4m3",
    )
    with_tail = dataclasses.replace(base, kv_cache_exact_tail_tokens=16)
    a, b = plan_capacity(base), plan_capacity(with_tail)
    ring_tokens = 256 * 15
    lost_tokens = a.max_kv_tokens - b.max_kv_tokens
    # bf16 ring bytes / fp8 token bytes, rounded to blocks
    ratio = (2 * 3 * 64 * 2 * 30) / a.kv_bytes_per_token_per_device
    assert abs(lost_tokens - ring_tokens * ratio) <= 16
    assert b.to_json_dict()["kv_exact_tail_bytes_per_device"] == ring_tokens * 2 * 3 * 64 * 2 * 30
