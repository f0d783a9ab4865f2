"""`infer8 demo`'s output on a tiny model: each start-up line once, headers that say the truth, a
headline that noise cannot flip, and one FP8 capacity figure, the README's."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
from pathlib import Path

import pytest
import torch

from infer8.attention.kv_cache import KVCacheSpec
from infer8.config import EngineArgs
from infer8.demo import QUESTIONS, describe, run_demo
from infer8.demo_compare import (
    Comparison,
    EngineGroup,
    EngineRun,
    compare_engines,
    too_busy_reason,
)
from tests.utils import build_tiny_model, infer8_log_messages

REPO = Path(__file__).resolve().parents[2]
# The default model's (SmolLM2-135M-Instruct) KV shape: 30 layers, 3 KV heads of 64
DEFAULT_MODEL_KV = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "block_size": 16}
# 12 requests on 3 seats: enough for a static batch's wait on its longest request to show
NUM_REQUESTS, OUTPUT_LENS = 12, (2, 4, 8, 16)
# the capacity sentence; README and docs may wrap it across lines
CAPACITY = re.compile(
    r"(\d+\.\d\d)x\s+the\s+tokens\s+of\s+a\s+bf16\s+cache\s+in\s+the\s+same\s+memory"
)


@pytest.fixture(scope="module")
def args(tmp_path_factory: pytest.TempPathFactory) -> EngineArgs:
    """Return engine args for a tiny Qwen2 (head_dim 64, the default model's) whose generation
    config sets temperature."""
    model_dir = build_tiny_model(
        tmp_path_factory.mktemp("demo"),
        "qwen2",
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    config_path = model_dir / "generation_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "temperature": 0.2, "top_p": 0.9}))
    return EngineArgs(
        model=str(model_dir),
        dtype="float32",
        kv_cache_memory_bytes=4 << 20,
        enforce_eager=True,  # no torch.compile: seconds, not tens of seconds
    )


@pytest.fixture(scope="module")
def demo_out(args: EngineArgs) -> str:
    """Return what the demo prints on the tiny model (the load average read as idle)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), infer8_log_messages() as logged:
        code = run_demo(
            args,
            num_requests=NUM_REQUESTS,
            output_lens=OUTPUT_LENS,
            chat_max_tokens=8,
            num_rounds=2,
            load_average=lambda: 0.0,
        )
    assert code == 0
    return out.getvalue() + "\n".join(logged)  # the start-up facts are log lines


@pytest.fixture(scope="module")
def busy(args: EngineArgs) -> Comparison:
    """Return the comparison measured while the load average reads far above the core count."""
    with contextlib.redirect_stdout(io.StringIO()):
        return compare_engines(
            args, QUESTIONS, NUM_REQUESTS, OUTPUT_LENS, num_rounds=2, load_average=lambda: 99.0
        )


def test_each_start_up_line_prints_once(demo_out: str) -> None:
    """Check the engines the demo builds print the start-up lines once, not once each."""
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


def _steps_on_seats(output_lens: list[int], num_seats: int, scheduler: str) -> int:
    """Return the steps a scheduler needs for requests of these output lengths, one token per
    request and step (the first from the prefill): a static batch runs until its longest
    request is done; continuous batching refills a seat the step after it frees."""
    if scheduler == "static":
        batches = range(0, len(output_lens), num_seats)
        return sum(max(output_lens[i : i + num_seats]) for i in batches)
    waiting, running, num_steps = list(output_lens), [], 0
    while waiting or running:
        while waiting and len(running) < num_seats:
            running.append(waiting.pop(0))
        running = [n - 1 for n in running if n > 1]
        num_steps += 1
    return num_steps


def _table(out: str) -> dict[str, tuple[int, float, float]]:
    """Return the printed work table: steps, tokens/step and padding % per row's label."""
    rows = re.findall(
        r"^(static|continuous) +(float32|FP8 \(E4M3\)) +[\d,]+ +(\d+) +([\d.]+) +([\d.]+)%$",
        out,
        flags=re.MULTILINE,
    )
    assert len(rows) == 3, out
    return {f"{p} {kv}": (int(s), float(t), float(pad)) for p, kv, s, t, pad in rows}


def test_continuous_batching_needs_fewer_steps_and_no_padding(
    demo_out: str, busy: Comparison
) -> None:
    """Check the headline's counts: continuous batching finishes the same variable-length
    workload in fewer steps than static batching and computes no padding, the same in every
    round and every run, however loaded the machine."""
    lens, seats = busy.output_lens, busy.num_seats
    assert seats == 3 and sorted(set(lens)) == sorted(OUTPUT_LENS)
    expected = {
        "static float32": _steps_on_seats(lens, seats, "static"),
        "continuous float32": _steps_on_seats(lens, seats, "continuous"),
        "continuous FP8 (E4M3)": _steps_on_seats(lens, seats, "continuous"),
    }
    assert expected["continuous float32"] < expected["static float32"]
    table = _table(demo_out)
    assert {k: v[0] for k, v in table.items()} == expected, demo_out
    assert table["static float32"][2] > 10.0 and table["continuous float32"][2] == 0.0
    assert table["continuous float32"][1] > table["static float32"][1]
    for group in busy.groups:  # the busy run counted the same work, in both of its rounds
        assert [r.num_steps for r in group.runs] == [table[_label(group)][0]] * 2
        assert all(r.num_output_tokens == sum(lens) for r in group.runs)
    steps = expected["continuous float32"], expected["static float32"]
    said = " ".join(demo_out.split())  # unwrapped
    assert f"output tokens in {steps[0]} steps against static batching's {steps[1]}" in said


def _label(group: EngineGroup) -> str:
    return f"{group.scheduler} {group.kv_dtype}"


def _ratio_from_spec(**shape: int) -> str:
    """Return bf16's bytes per token over FP8 (E4M3, dynamic scales)'s, as the demo prints it."""
    bf16 = KVCacheSpec(dtype=torch.bfloat16, **shape)
    fp8 = KVCacheSpec(dtype=torch.float8_e4m3fn, kv_scale="dynamic", **shape)
    return f"{bf16.bytes_per_token / fp8.bytes_per_token:.2f}"


def test_capacity_is_one_figure_from_the_spec_in_demo_readme_and_docs(
    demo_out: str, busy: Comparison
) -> None:
    """Check the printed FP8 capacity is bf16's bytes per token over FP8's (from KVCacheSpec),
    not shrunk by the exact tail's rings (the 1.64x once printed), and that README and docs
    state the same figure for the default model in the same words."""
    printed = CAPACITY.findall(demo_out)
    assert len(printed) == 1, demo_out
    tiny = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 64, "block_size": 16}
    assert printed[0] == _ratio_from_spec(**tiny)
    default_model = _ratio_from_spec(**DEFAULT_MODEL_KV)
    assert printed[0] == default_model == "1.94"  # head_dim 64: 2 x 64 / (64 + 2) bytes
    # the FP8 engine keeps exact-tail rings out of its budget: the figure leaves them out
    assert busy.fp8_spec.exact_tail_tokens > 0 and busy.groups[2].num_tail_rows > 0
    assert f"{busy.fp8_capacity_ratio:.2f}" == printed[0]
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("### FP8 KV cache") :]
    section = section[: section.index("\n### ", 1)]
    assert CAPACITY.findall(section) == [default_model], section
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        stated = set(CAPACITY.findall(path.read_text()))
        assert stated <= {default_model}, (path, stated)
        assert not re.search(r"\b1\.64x|x1\.94\b", path.read_text()), path


def test_a_busy_machine_gets_a_plain_warning_not_a_timing_ratio(busy: Comparison) -> None:
    """Check that a load average above the cores replaces the timing ratios with a plain
    warning, and the counted work stays."""
    out = "\n".join(describe(busy))
    assert "Time: the machine is too busy to time: its load average is 99.0 on" in out, out
    assert "A timing ratio would not be meaningful here, so none is shown" in out
    assert "output tokens/s" not in out
    assert re.search(r"in \d+ steps against static batching's \d+", out), out
    assert CAPACITY.search(out), out


def test_a_quiet_machine_gets_the_median_ratio_and_its_spread(busy: Comparison) -> None:
    """Check the timing line on a quiet machine: each round's paired ratio, median and range."""
    static_s, cont_s = [2.0, 2.0, 2.0], [1.6, 1.5, 1.55]  # continuous 1.25x, 1.33x, 1.29x
    groups = [
        dataclasses.replace(g, runs=[dataclasses.replace(g.runs[0], time_s=t) for t in times])
        for g, times in zip(busy.groups, [static_s, cont_s, cont_s])
    ]
    quiet = dataclasses.replace(busy, groups=groups, load_average=0.0)
    out = "\n".join(describe(quiet))
    assert "too busy" not in out, out
    assert "median (min-max over 3 rounds)" in out, out
    assert "continuous / static output tokens/s: 1.29x (1.25-1.33)" in out, out
    assert "FP8 / float32 output tokens/s: 1.00x (1.00-1.00)" in out, out


def test_too_busy_reasons() -> None:
    """Check the two tests of a busy machine: load beyond the cores and this run's own threads,
    and rounds that disagree by more than 1.2x (the 0.52x vs 1.05x flip)."""
    steady = {"continuous / static": [1.30, 1.34, 1.28]}
    assert too_busy_reason(steady, 2.9, num_cpus=2, num_threads=2) is None  # this run's own
    assert too_busy_reason(steady, None, num_cpus=2, num_threads=2) is None
    loaded = too_busy_reason(steady, 3.1, num_cpus=2, num_threads=2)
    assert loaded is not None and "load average is 3.1 on 2 cores" in loaded
    flipped = too_busy_reason({"continuous / static": [0.52, 1.05]}, 0.5, 2, 2)
    assert (
        flipped is not None
        and "rounds disagree by more than 1.2x (continuous / static 0.52x to 1.05x)" in flipped
    )


def test_run_figures() -> None:
    """Check the per-run figures: padding's share of computed tokens and tokens per step."""
    run = EngineRun(num_steps=10, num_output_tokens=30, num_scheduled_tokens=60)
    run.num_padded_tokens = 20
    assert run.padding_pct == pytest.approx(25.0) and run.tokens_per_step == 3.0
