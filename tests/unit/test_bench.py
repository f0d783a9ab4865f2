"""The benchmark harness's pure parts: length specs, arrivals, goodput SLOs, FLOP counts."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from infer8.bench.flops import ModelFlops
from infer8.bench.report import fmt_bytes, summarize
from infer8.bench.serve import RequestResult, arrival_offsets_s, parse_goodput, serve_metrics
from infer8.bench.workload import LengthSpec


@pytest.mark.parametrize(
    ("spec", "kind", "low", "high"),
    [
        ("128", "fixed", 128, 128),
        ("uniform:20:150", "uniform", 20, 150),
        ("20:150", "uniform", 20, 150),
        ("lognormal:64", "lognormal", 1, 512),
        ("lognormal:64:0.5:300", "lognormal", 1, 300),
    ],
)
def test_length_specs_parse_sample_and_round_trip(
    spec: str, kind: str, low: int, high: int
) -> None:
    length = LengthSpec.parse(spec)
    assert length.kind == kind
    assert LengthSpec.parse(length.describe()) == length
    values = length.sample(2000, random.Random(0))
    assert low <= min(values) and max(values) <= high
    assert values == length.sample(2000, random.Random(0))  # seeded
    if kind == "uniform":
        assert min(values) == low and max(values) == high
    if kind == "lognormal":  # long tail: the median is the spec's, the mean is above it
        values.sort()
        assert abs(values[1000] - 64) <= 6
        assert sum(values) / len(values) > 64


@pytest.mark.parametrize(
    "spec", ["", "abc", "uniform:5", "uniform:9:3", "0", "lognormal:x", "1:2:3"]
)
def test_bad_length_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        LengthSpec.parse(spec)


def test_poisson_arrivals_have_the_requested_rate() -> None:
    assert arrival_offsets_s(5, math.inf, 1.0, 0) == [0.0] * 5
    offsets = arrival_offsets_s(4000, 20.0, 1.0, 0)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets[-1] / (len(offsets) - 1) == pytest.approx(1 / 20, rel=0.05)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    for bad in (["ttft"], ["latency:5"], ["ttft:x"], ["ttft:0"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    fast = RequestResult(success=True, output_tokens=11, ttft_s=0.1, e2el_s=0.6)  # tpot 50 ms
    slow = RequestResult(success=True, output_tokens=11, ttft_s=0.9, e2el_s=1.0)
    failed = RequestResult(success=False, error="HTTP 400")
    m = serve_metrics([fast, slow, failed], 2.0, {"ttft": 500.0, "tpot": 60.0})
    assert (m["completed"], m["failed"], m["num_good_requests"]) == (2, 1, 1)
    assert m["request_goodput"] == 0.5
    assert m["total_output_tokens"] == 22
    assert m["tpot_mean_s"] == pytest.approx((0.05 + 0.01) / 2)


def test_request_flops_count_every_computed_position() -> None:
    arch = SimpleNamespace(
        hidden_size=8,
        intermediate_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        num_hidden_layers=3,
        vocab_size=10,
    )
    f = ModelFlops.from_arch(arch)
    per_layer = 8 * (8 + 2 * 4) + 8 * 8 + 8 * 32 + 16 * 8
    assert f.layer_flops_per_token == 2 * 3 * per_layer
    # 3 prompt + 2 output tokens: positions 0..3 computed, attending to 1..4 tokens, 2 samples
    expected = f.layer_flops_per_token * 4 + f.attn_flops_per_context_token * 10 + 2 * 2 * 8 * 10
    assert f.request_flops(3, 2) == expected
    assert f.request_flops(3, 0) == 0


def test_summaries_and_byte_formatting() -> None:
    s = summarize([0.1, 0.2, 0.3], "ttft")
    assert s["ttft_mean_s"] == pytest.approx(0.2) and s["ttft_p50_s"] == pytest.approx(0.2)
    assert summarize([], "ttft")["ttft_p99_s"] is None
    assert (fmt_bytes(128 << 20), fmt_bytes(1536), fmt_bytes(10)) == ("128 MiB", "1.50 KiB", "10 B")


def test_session_search_doubles_then_bisects_within_its_bounds() -> None:
    from infer8.bench.serve import RequestResult
    from infer8.bench.sessions import SessionSLO, level_passes, next_level

    assert next_level({}, 64) == 1
    assert next_level({1: True, 2: True, 4: True}, 64) == 8
    assert next_level({1: True, 2: True, 4: True, 8: False}, 64) == 6
    assert next_level({1: True, 2: True, 4: True, 8: False, 6: True}, 64) == 7
    assert next_level({1: True, 2: True, 4: True, 8: False, 6: True, 7: False}, 64) is None
    assert next_level({1: False}, 64) is None  # even one session misses the SLO
    assert next_level({32: True, 64: True}, 64) is None  # the cap holds
    slo = SessionSLO(ttft_p99_ms=100, tpot_p99_ms=20)
    fast = RequestResult(success=True, ttft_s=0.05, e2el_s=0.25, output_tokens=11)  # TPOT 20 ms
    slow = RequestResult(success=True, ttft_s=0.5, e2el_s=0.6, output_tokens=2)
    assert level_passes([fast] * 10, slo)[0]
    assert not level_passes([fast] * 10 + [slow], slo)[0]  # p99 TTFT over the limit
    assert not level_passes([fast, RequestResult(success=False, error="HTTP 503")], slo)[0]
    assert not level_passes([], slo)[0]
