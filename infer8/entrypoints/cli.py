"""The `infer8` command: serve, pull, generate, demo (flags generated from EngineArgs)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from collections.abc import Callable
from typing import Any

from infer8.config import EngineArgs

# Choices for string options, listed in --help and in the error for a bad value.
CHOICES: dict[str, list[str]] = {
    "dtype": ["auto", "bfloat16", "float16", "float32"],
    "device": ["auto", "cpu", "cuda"],
    "kv_cache_dtype": ["auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"],
    "kv_scale": ["dynamic", "static"],
    "scheduler": ["continuous", "static"],
}
HELP: dict[str, str] = {
    "model": "Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct)",
    "enforce_eager": "never compile graphs (torch.compile / CUDA graphs)",
    "kv_cache_memory_bytes": "KV cache budget in bytes (overrides --gpu-memory-utilization)",
    "gpu_memory_utilization": "fraction of device memory (RAM on CPU) for weights+activations+KV",
    "kv_scale": "FP8 KV scaling: dynamic per-token scales, or static per-layer scales",
    "kv_scales_path": "JSON file of static KV scales made by `infer8 calibrate-kv`",
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
        help_ = HELP.get(f.name, "") + f" (default: {default})"
        if kind is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=help_
            )
        elif f.name == "model":
            parser.add_argument(flag, dest="model_flag", default=None, help=help_)
        else:
            parser.add_argument(
                flag, type=kind, default=default, choices=CHOICES.get(f.name), help=help_
            )
    if positional_model:
        parser.add_argument("model", nargs="?", default=None, help=HELP["model"])


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


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with its subcommands."""
    parser = argparse.ArgumentParser(prog="infer8", description=__doc__)
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


if __name__ == "__main__":
    sys.exit(main())
