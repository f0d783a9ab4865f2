"""`infer8 demo`'s output on a tiny model: each start-up line once, headers that say the truth."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest

from infer8.config import EngineArgs
from infer8.demo import run_demo
from tests.utils import build_tiny_model


@pytest.fixture(scope="module")
def demo_out(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Return what the demo prints on a tiny model whose generation config sets temperature."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("demo"), "llama")
    config_path = model_dir / "generation_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "temperature": 0.2, "top_p": 0.9}))
    args = EngineArgs(
        model=str(model_dir),
        dtype="float32",
        max_num_seqs=4,
        kv_cache_memory_bytes=4 << 20,
        enforce_eager=True,  # no torch.compile: seconds, not tens of seconds
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert run_demo(args, num_requests=2, output_lens=(4, 8), chat_max_tokens=8) == 0
    return out.getvalue()


def test_each_start_up_line_prints_once(demo_out: str) -> None:
    """Check the three engines the demo builds print the start-up lines once, not three times."""
    lines = demo_out.splitlines()
    assert sum(line.startswith("KV cache:") for line in lines) == 1, demo_out
    assert sum(line.startswith("Sampling defaults") for line in lines) == 1, demo_out


def test_start_up_lines_say_what_the_cache_holds(demo_out: str) -> None:
    """Check the KV line reads in words: size, type, tokens, requests of the longest length."""
    line = next(line for line in demo_out.splitlines() if line.startswith("KV cache:"))
    assert re.fullmatch(
        r"KV cache: \d+\.\d\d GiB float32, room for [\d,]+ tokens = \d+\.\d\d requests of 512 "
        r"tokens \(the longest allowed\), in [\d,]+ blocks of 16",
        line,
    ), line
    assert (
        "Sampling defaults (the generation config's) for requests that set none: temperature "
        "0.2, top_p 0.9" in demo_out
    )


def test_the_chat_header_names_the_sampling_it_uses(demo_out: str) -> None:
    """Check the header says greedy is the demo's choice over the model's own defaults."""
    assert (
        "== Chat (greedy: temperature 0, set by the demo over the model's defaults "
        "(temperature 0.2, top_p 0.9)) ==" in demo_out
    )


def test_fp8_capacity_is_stated_against_a_bf16_cache(demo_out: str) -> None:
    """Check the FP8 ratio uses the README's bf16 baseline and labels this run's float32 one."""
    match = re.search(
        r"fp8 KV capacity: (\d+\.\d\d)x a bfloat16 cache's \((\d+\.\d\d)x this run's float32 "
        r"cache's\)",
        demo_out,
    )
    assert match is not None, demo_out
    vs_bf16, vs_fp32 = float(match.group(1)), float(match.group(2))
    assert 1.0 < vs_bf16 < 2.0 and vs_fp32 == pytest.approx(2 * vs_bf16, rel=0.05)
