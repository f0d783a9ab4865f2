"""`infer8 demo`: chat with the default model, then compare static and continuous batching and a
16-bit with an FP8 KV cache (measured in demo_compare.py; stated here)."""

from __future__ import annotations

import dataclasses
import statistics
import textwrap
from collections.abc import Callable

from infer8.config import EngineArgs
from infer8.demo_compare import (
    Comparison,
    bytes_per_token,
    compare_engines,
    throughput_ratios,
    too_busy_reason,
)
from infer8.entrypoints.llm import LLM
from infer8.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Name three primary colors.",
    "Write a haiku about the sea.",
]
# The KV budget of every engine when none is given, so capacities compare at equal memory.
DEMO_KV_BYTES = 512 << 20


def run_demo(
    args: EngineArgs,
    num_requests: int = 32,
    output_lens: tuple[int, ...] = (8, 16, 32, 64),
    chat_max_tokens: int = 48,
    num_rounds: int = 3,
    load_average: Callable[[], float | None] | None = None,
) -> int:
    """Chat with the model, then compare static/continuous batching and 16-bit/fp8 KV caches.

    load_average: returns the machine's 1-minute load average (default os.getloadavg's).
    """
    kv_bytes = args.kv_cache_memory_bytes or DEMO_KV_BYTES
    args = dataclasses.replace(args, kv_cache_memory_bytes=kv_bytes)
    _chat(args, chat_max_tokens)
    kv_mib = kv_bytes / (1 << 20)
    print(
        f"== {num_requests} requests of {min(output_lens)}..{max(output_lens)} output tokens: "
        f"three engines of {kv_mib:,.0f} MiB KV, stepped in turn, {num_rounds} rounds =="
    )
    comparison = compare_engines(
        args, QUESTIONS, num_requests, output_lens, num_rounds, load_average
    )
    for line in describe(comparison):
        print(line)
    return 0


def _chat(args: EngineArgs, max_tokens: int) -> None:
    """Answer QUESTIONS greedily (this engine prints the start-up lines; it is dropped after)."""
    llm = LLM(**dataclasses.asdict(args))
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    print(f"\n== Chat (greedy: temperature 0, {_over_defaults(llm)}) ==")
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    for q, out in zip(QUESTIONS, llm.chat(chats, greedy)):
        print(f"> {q}\n{out.outputs[0].text.strip()}\n")


def _over_defaults(llm: LLM) -> str:
    """Return what the demo's greedy sampling replaces: the model's defaults, or none."""
    defaults = llm.engine.default_sampling
    if not defaults:
        return "the API's default"
    listed = ", ".join(f"{k} {v}" for k, v in defaults.items())
    return f"set by the demo over the model's defaults ({listed})"


def describe(c: Comparison) -> list[str]:
    """Return the comparison's lines: the counted work first (the headline), then the times."""
    static, cont = c.groups[0].runs[0], c.groups[1].runs[0]
    lines = [
        f"Work, counted (the same on any machine, however busy), {c.num_seats} seats "
        "(max_num_seqs):",
        f"{'scheduler':<12}{'KV cache':<12}{'KV tokens':>11}{'steps':>8}{'tokens/step':>13}"
        f"{'padding':>9}",
    ]
    for g in c.groups:
        run = g.runs[0]
        lines.append(
            f"{g.scheduler:<12}{g.kv_dtype:<12}{g.capacity_tokens:>11,}{run.num_steps:>8}"
            f"{run.tokens_per_step:>13.2f}{run.padding_pct:>8.1f}%"
        )
    lines += _wrap(
        f"Continuous batching: the same {cont.num_output_tokens:,} output tokens in "
        f"{cont.num_steps} steps against static batching's {static.num_steps} "
        f"({cont.num_steps / static.num_steps:.2f}x the steps); padding {cont.padding_pct:.1f}% "
        f"of computed tokens against {static.padding_pct:.1f}%."
    )
    lines += _wrap(_capacity_text(c))
    lines += _timing_lines(c)
    return lines


def _wrap(text: str) -> list[str]:
    """Return a paragraph as lines of at most 100 characters, continuations indented."""
    return textwrap.wrap(text, width=100, subsequent_indent="  ", break_on_hyphens=False)


def _capacity_text(c: Comparison) -> str:
    """Return the one FP8 capacity figure (README and docs state it in the same words)."""
    fp8_bytes, bf16_bytes = bytes_per_token(c.fp8_spec)
    scales = "a bf16 scale per token and KV head"
    if c.fp8_spec.format.scale != "dynamic":
        scales = "scales per KV head, not per token"
    text = (
        f"FP8 KV capacity: {c.fp8_capacity_ratio:.2f}x the tokens of a bf16 cache in the same "
        f"memory ({fp8_bytes:,} bytes a token over all layers, 1 byte an element plus {scales}, "
        f"against bf16's {bf16_bytes:,})."
    )
    base, fp8 = c.groups[1], c.groups[2]
    if base.kv_dtype != "bfloat16":
        text += f" This run's second row is {base.kv_dtype}, not bf16."
    if fp8.num_tail_rows:
        text += (
            f" The FP8 row's KV tokens are net of its exact-tail rings ({_mib(fp8.tail_bytes)} "
            f"for {fp8.num_tail_rows} seats, a cost per running request, not per token)."
        )
    return text


def _mib(num_bytes: int) -> str:
    """Return a byte count in MiB, or in KiB below a tenth of one."""
    mib = num_bytes / (1 << 20)
    return f"{mib:.1f} MiB" if mib >= 0.1 else f"{num_bytes / 1024:.0f} KiB"


def _timing_lines(c: Comparison) -> list[str]:
    """Return the timing ratios with their spread, or say plainly that they mean nothing here."""
    static, cont, fp8 = (g.runs for g in c.groups)
    ratios = {
        "continuous / static": throughput_ratios(cont, static),
        f"FP8 / {c.groups[1].kv_dtype}": throughput_ratios(fp8, cont),
    }
    reason = too_busy_reason(ratios, c.load_average, c.num_cpus, c.num_threads)
    if reason is not None:
        return _wrap(
            f"Time: the machine is too busy to time: {reason}. A timing ratio would not be "
            "meaningful here, so none is shown; the counted work above is the comparison."
        )
    spread = f"min-max over {len(cont)} rounds" if len(cont) > 1 else "one round: no spread"
    lines = [f"Time, each engine by the sum of its own steps; median ({spread}):"]
    for name, values in ratios.items():
        lines.append(
            f"  {name} output tokens/s: {statistics.median(values):.2f}x "
            f"({min(values):.2f}-{max(values):.2f})"
        )
    return lines
