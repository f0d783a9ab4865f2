"""docs/deployment.md against `infer8 plan`: every output and figure it quotes is the tool's.

The planner runs in-process (presets, no network) for each command the page shows; a change to
the planner that moves a number fails here until the page is regenerated from the tool.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from infer8.cli import main
from infer8.plan_presets import GiB

DOC = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"
REFERENCE = (
    "--model qwen2-72b-instruct --device h100-80gb --kv-cache-dtype fp8_e4m3 "
    "--gpu-memory-utilization 0.94 --max-num-seqs 512 --max-num-batched-tokens 16384"
)
H200_FP8 = (
    "--model qwen2-72b-instruct --device h200-141gb --weight-dtype fp8 --kv-cache-dtype fp8_e4m3 "
    "--gpu-memory-utilization 0.94 --max-num-seqs 512 --max-num-batched-tokens 16384"
)
VLLM_DEFAULTS_TP4 = (
    "--model qwen2-72b-instruct --device h100-80gb --kv-cache-dtype fp8_e4m3 "
    "--max-num-batched-tokens 2048 -tp 4"
)
SMALL_RESERVE = f"{REFERENCE} --weight-dtype fp8 --activation-reserve-gib 2 --max-model-len 4096"


def plan_stdout(args: str) -> str:
    """Return what `infer8 plan ARGS` prints (run in-process)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", *shlex.split(args)])
    return out.getvalue()


def plan_json(args: str) -> dict[str, Any]:
    """Return `infer8 plan ARGS --json` as an object."""
    return json.loads(plan_stdout(f"{args} --json"))


def _flat(text: str) -> str:
    """Return text with every run of whitespace one space (the page wraps prose at 100 columns)."""
    return " ".join(text.split())


def command_blocks(text: str) -> list[tuple[str, list[str]]]:
    """Return (arguments, output lines) for each ```bash block that runs `infer8 plan`.

    The output is the Markdown table or the fenced block that must follow the command.
    """
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```bash":
            i += 1
            continue
        end = lines.index("```", i + 1)
        command = " ".join(line.rstrip("\\").strip() for line in lines[i + 1 : end])
        i = end + 1
        if not command.startswith("infer8 plan "):
            continue
        while not lines[i].strip():
            i += 1
        if lines[i].startswith("|"):
            start = i
            while i < len(lines) and lines[i].startswith("|"):
                i += 1
            output = lines[start:i]
        else:
            assert lines[i] == "```", f"`{command}` is not followed by its output"
            end = lines.index("```", i + 1)
            output = lines[i + 1 : end]
            i = end + 1
        blocks.append((command.removeprefix("infer8 plan "), output))
    return blocks


def test_every_plan_output_on_the_page_is_what_the_tool_prints() -> None:
    blocks = command_blocks(DOC.read_text())
    # the table, one configuration's ways to fit, two claims
    assert len(blocks) == 4, [args for args, _ in blocks]
    for args, shown in blocks:
        printed = plan_stdout(args).splitlines()
        if shown[0].startswith("|"):  # a table: all of it
            assert shown == [line for line in printed if line.startswith("|")], args
        else:  # an excerpt: consecutive lines of the output
            starts = [i for i, line in enumerate(printed) if line == shown[0]]
            assert any(printed[s : s + len(shown)] == shown for s in starts), (args, shown)


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GiB:.2f}"


def _h200_overlay() -> str:
    fp8, bf16 = plan_json(H200_FP8), plan_json(H200_FP8.replace("fp8 --kv", "bf16 --kv"))
    assert fp8["fits"] and not bf16["fits"]
    return (
        f"weights {fp8['weights_gib_per_device']:.2f} GiB, KV budget {fp8['kv_budget_gib']:.2f} "
        f"GiB ({_gib(fp8['kv_exact_tail_bytes_per_device'])} GiB of it the exact tail's stores) = "
        f"{fp8['max_kv_tokens']:,} tokens, {fp8['max_concurrent_sessions']} full 32K-token "
        f"sessions (bf16 weights, {bf16['weights_gib_per_device']:.2f} GiB, do not fit)"
    )


def _h100_overlay() -> str:
    seed, vllm = plan_json(f"{REFERENCE} -tp 4"), plan_json(VLLM_DEFAULTS_TP4)
    assert (seed["max_num_seqs"], vllm["max_num_seqs"]) == (512, 256)
    assert vllm["gpu_memory_utilization"] == 0.9
    return (
        f"reserves {seed['activation_reserve_gib']:.2f} GiB of activations per GPU against "
        f"{vllm['activation_reserve_gib']:.2f} GiB with 2,048-token steps, leaving "
        f"{seed['max_kv_tokens']:,} KV tokens ({seed['max_concurrent_sessions']} full sessions) "
        f"instead of {vllm['max_kv_tokens']:,} ({vllm['max_concurrent_sessions']}) even at 0.94 "
        "utilization against 0.9 (both after the FP8 exact tail's stores: 512 and 256 seats, "
        f"{_gib(seed['kv_exact_tail_bytes_per_device'])} and "
        f"{_gib(vllm['kv_exact_tail_bytes_per_device'])} GiB per GPU)"
    )


def _how_it_counts() -> str:
    tp1 = plan_json(f"{REFERENCE} -tp 1")
    return (
        f"H100 80GB = {tp1['device_memory_gib']:.2f} GiB) holds the weights"
        f" || {tp1['activation_reserve_gib']:.2f} GiB for the reference deployment's 16384 tokens "
        "and 512 sequences on Qwen2-72B"
    )


def _kv_bytes() -> str:
    scaled = plan_json(f"{REFERENCE} -tp 1")["kv_bytes_per_token"]
    elements = plan_json(f"{REFERENCE} -tp 1 --no-kv-scales")["kv_bytes_per_token"]
    bf16 = plan_json(REFERENCE.replace("fp8_e4m3", "auto"))["kv_bytes_per_token"]
    return (
        f"Qwen2-72B stores {elements:,} bytes of fp8 elements + {scaled - elements:,} of scales = "
        f"{scaled:,} bytes per token ({bf16:,} in bf16)"
    )


def _reference_model() -> str:
    tp1 = plan_json(f"{REFERENCE} -tp 1")
    return (
        f"Qwen2-72B-Instruct ({tp1['num_params'] / 1e9:.2f} B parameters) on H100 80GB"
        f" || (H100: {tp1['bandwidth_gbps']:,.0f} GB/s)"
    )


def _tail_at_tp2() -> str:
    tp2 = plan_json(f"{REFERENCE} --weight-dtype fp8 -tp 2")
    seats = f"{tp2['max_num_seqs']} seats x ({tp2['kv_cache_exact_tail_tokens']} - 1 + "
    return (
        f"{seats}{tp2['kv_cache_exact_sink_tokens']}) FP8 residual tokens, e.g. "
        f"{_gib(tp2['kv_exact_tail_bytes_per_device'])} GiB per device at TP 2"
    )


def _what_it_says() -> str:
    bf16, fp8 = plan_json(f"{REFERENCE} -tp 1"), plan_json(f"{REFERENCE} --weight-dtype fp8")
    sessions = {
        (w, tp): plan_json(f"{REFERENCE} --weight-dtype {w} -tp {tp}")["max_concurrent_sessions"]
        for w, tp in (("bf16", 4), ("fp8", 2), ("fp8", 4))
    }
    return (
        f"bf16 weights alone are {bf16['weights_gib_per_device']:.2f} GiB against "
        f"{bf16['usable_gib_per_device']:.2f} GiB usable. Even fp8 weights "
        f"({fp8['weights_gib_per_device']:.2f} GiB) leave nothing"
        f" || (TP 4: {sessions['bf16', 4]} sessions of 32K tokens); fp8 weights fit on 2 "
        f"({sessions['fp8', 2]} sessions) or give {sessions['fp8', 4]} sessions on 4"
    )


def _small_reserve() -> str:
    tail, no_tail = (
        plan_json(SMALL_RESERVE),
        plan_json(f"{SMALL_RESERVE} --kv-cache-exact-tail-tokens 0"),
    )
    assert tail["kv_budget_gib"] == no_tail["kv_budget_gib"]
    return (
        f"fp8 weights leave a {tail['kv_budget_gib']:.2f} GiB KV budget, of which the exact tail's "
        f"stores for {tail['max_num_seqs']} seats take "
        f"{_gib(tail['kv_exact_tail_bytes_per_device'])} GiB: {tail['max_kv_tokens']:,} tokens, "
        f"{tail['max_concurrent_sessions']} sessions. Without the tail (the same command with "
        f"`--kv-cache-exact-tail-tokens 0`) it holds {no_tail['max_kv_tokens']:,} tokens: "
        f"{no_tail['max_concurrent_sessions']} sessions"
    )


# Figures quoted in prose: the commands the page names, and the page's sentences rendered from
# the tool's --json output (" || " separates fragments that sit apart on the page).
PROSE: dict[str, tuple[list[str], Callable[[], str]]] = {
    "gpu-h200-fp8 overlay": ([H200_FP8], _h200_overlay),
    "gpu-h100-fp8 overlay": ([f"{REFERENCE} -tp 4", VLLM_DEFAULTS_TP4], _h100_overlay),
    "how it counts": ([], _how_it_counts),
    "KV bytes per token": ([], _kv_bytes),
    "the reference model": ([], _reference_model),
    "the exact tail at TP 2": ([], _tail_at_tp2),
    "what the table says": ([], _what_it_says),
    "a 2 GiB reserve": ([SMALL_RESERVE], _small_reserve),
}


@pytest.mark.parametrize("name", list(PROSE))
def test_figures_quoted_in_prose_are_what_the_tool_prints(name: str) -> None:
    page = _flat(DOC.read_text())
    commands, render = PROSE[name]
    for args in commands:
        assert f"`infer8 plan {args}`" in page, f"the page no longer shows `infer8 plan {args}`"
    for fragment in render().split(" || "):
        assert fragment in page, f"{name}: the page should read {fragment!r}"


def test_every_plan_command_in_prose_is_checked() -> None:
    page = _flat(DOC.read_text())
    inline = set(re.findall(r"`infer8 plan (--[^`]+)`", page))
    checked = {args for commands, _ in PROSE.values() for args in commands}
    assert inline == checked
