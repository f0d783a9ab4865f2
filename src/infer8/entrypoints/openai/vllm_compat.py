"""vLLM serve flags that infer8 has no flag of its own for: mapped, accepted with a warning, or refused.

`infer8 serve` takes vLLM's command lines unchanged. infer8's own flags (generated from EngineArgs
and ServerConfig) already carry vLLM's names; this module adds the rest of what a serving user
types, each with one line saying what happens to it. The table in docs/vllm-flags.md is
generated from `COMPAT_FLAGS` and `NATIVE_FLAGS` (a test keeps them in step).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

# What a flag does here: "alias" maps onto an infer8 field, "ignored" is accepted with a
# one-line warning (it has no meaning here), "refused" stops start-up with the reason unless its
# value is one of `ok_values` (which mean what infer8 does anyway).
Status = str


@dataclass(frozen=True)
class CompatFlag:
    """One vLLM flag infer8 does not implement under its own name."""

    flag: str
    status: Status
    reason: str
    takes_value: bool = True
    ok_values: tuple[str, ...] = ()
    target: str | None = None  # for "alias": the infer8 field it sets
    short: str | None = None  # a short form, e.g. -tp


COMPAT_FLAGS: tuple[CompatFlag, ...] = (
    CompatFlag(
        "--max-num-queued-reqs",
        "alias",
        "same as --max-waiting-requests",
        target="max_waiting_requests",
    ),
    CompatFlag(
        "--shutdown-timeout",
        "alias",
        "same as --shutdown-grace-period-s",
        target="shutdown_grace_period_s",
    ),
    CompatFlag(
        "--trust-remote-code",
        "ignored",
        "infer8 never runs code from a model directory; the Llama family needs none",
        takes_value=False,
    ),
    CompatFlag(
        "--no-trust-remote-code", "ignored", "infer8 never runs remote code", takes_value=False
    ),
    CompatFlag(
        "--disable-log-requests",
        "ignored",
        "infer8 does not log request contents",
        takes_value=False,
    ),
    CompatFlag(
        "--enable-log-requests",
        "ignored",
        "infer8 does not log request contents",
        takes_value=False,
    ),
    CompatFlag(
        "--no-enable-log-requests",
        "ignored",
        "infer8 does not log request contents",
        takes_value=False,
    ),
    CompatFlag(
        "--disable-log-stats",
        "ignored",
        "infer8 logs no periodic stats; read /metrics",
        takes_value=False,
    ),
    CompatFlag(
        "--enable-chunked-prefill", "ignored", "chunked prefill is always on", takes_value=False
    ),
    CompatFlag(
        "--no-enable-chunked-prefill",
        "refused",
        "chunked prefill is always on in infer8",
        takes_value=False,
    ),
    CompatFlag(
        "--download-dir",
        "ignored",
        "infer8 never downloads models: pass a local directory or .gguf file",
    ),
    CompatFlag("--revision", "ignored", "no model hub access: pass a local path"),
    CompatFlag("--tokenizer-revision", "ignored", "no model hub access"),
    CompatFlag("--code-revision", "ignored", "no model hub access"),
    CompatFlag("--hf-token", "ignored", "no model hub access"),
    CompatFlag(
        "--load-format",
        "refused",
        "infer8 reads Safetensors directories and GGUF files, detected from the path",
        ok_values=("auto", "safetensors", "gguf"),
    ),
    CompatFlag(
        "--tokenizer",
        "refused",
        "the tokenizer is read from the model directory or "
        "GGUF file; a separate tokenizer path is not supported",
    ),
    CompatFlag(
        "--tokenizer-mode",
        "refused",
        "infer8 uses the fast (Rust) tokenizer",
        ok_values=("auto", "hf"),
    ),
    CompatFlag("--swap-space", "ignored", "no CPU swap space: preempted requests are recomputed"),
    CompatFlag("--max-seq-len-to-capture", "ignored", "CUDA graph sizes are chosen by infer8"),
    CompatFlag("--cudagraph-capture-sizes", "ignored", "CUDA graph sizes are chosen by infer8"),
    CompatFlag("--max-cudagraph-capture-size", "ignored", "CUDA graph sizes are chosen by infer8"),
    CompatFlag(
        "--compilation-config",
        "ignored",
        "infer8 has one compilation mode (--enforce-eager turns it off)",
    ),
    CompatFlag(
        "--optimization-level",
        "ignored",
        "infer8 has one compilation mode (--enforce-eager turns it off)",
        short="-O",
    ),
    CompatFlag(
        "--attention-backend",
        "ignored",
        "infer8 picks one attention backend per device at start-up",
    ),
    CompatFlag(
        "--disable-custom-all-reduce",
        "ignored",
        "tensor parallelism uses torch.distributed's all-reduce",
        takes_value=False,
    ),
    CompatFlag(
        "--async-scheduling", "ignored", "steps are scheduled synchronously", takes_value=False
    ),
    CompatFlag("--max-log-len", "ignored", "infer8 does not log request contents"),
    CompatFlag("--limit-mm-per-prompt", "ignored", "infer8 serves text-only models"),
    CompatFlag(
        "--chat-template-content-format",
        "refused",
        "messages are rendered as strings",
        ok_values=("auto", "string"),
    ),
    CompatFlag(
        "--response-role", "refused", "responses use the role 'assistant'", ok_values=("assistant",)
    ),
    CompatFlag(
        "--max-logprobs",
        "refused",
        "infer8 returns at most 20 logprobs per token",
        ok_values=tuple(str(i) for i in range(21)),
    ),
    CompatFlag(
        "--kv-offloading-backend",
        "refused",
        "the host-memory tier of --kv-offloading-size is infer8's own (vLLM's native); "
        "LMCache is not supported",
        ok_values=("native",),
    ),
    CompatFlag(
        "--distributed-executor-backend",
        "refused",
        "tensor-parallel ranks are processes (mp) or torchrun-launched; Ray is not supported",
        ok_values=("mp", "uni"),
    ),
    CompatFlag(
        "--pipeline-parallel-size",
        "refused",
        "pipeline parallelism is not implemented; use --tensor-parallel-size",
        ok_values=("1",),
        short="-pp",
    ),
    CompatFlag(
        "--data-parallel-size",
        "refused",
        "run replicas behind a Kubernetes Service instead (deploy/k8s)",
        ok_values=("1",),
        short="-dp",
    ),
    CompatFlag(
        "--cpu-offload-gb",
        "refused",
        "weight offloading is not implemented",
        ok_values=("0", "0.0"),
    ),
    CompatFlag(
        "--enable-sleep-mode", "refused", "sleep mode is not implemented", takes_value=False
    ),
    CompatFlag(
        "--hf-overrides",
        "refused",
        "config overrides are not supported; edit the model's config.json",
        ok_values=("{}",),
    ),
    CompatFlag(
        "--enable-expert-parallel",
        "ignored",
        "infer8 serves dense models (no experts)",
        takes_value=False,
        short="-ep",
    ),
    CompatFlag(
        "--kv-cache-dtype-skip-layers",
        "refused",
        "every layer uses --kv-cache-dtype",
        ok_values=("[]",),
    ),
    CompatFlag(
        "--num-gpu-blocks-override",
        "refused",
        "size the cache with --kv-cache-memory-bytes instead",
    ),
)

# infer8's own flags that carry vLLM's names and meaning (for the docs table).
NATIVE_FLAGS: tuple[tuple[str, str], ...] = (
    ("--model / positional MODEL", "a local Hugging Face directory or .gguf file"),
    ("--served-model-name", "the name clients use (default: the --model string)"),
    ("--host, --port, --api-key, --uvicorn-log-level", "as in vLLM"),
    ("--dtype", "auto = bfloat16 on CPUs with bf16 units, else float32; bfloat16 on GPU"),
    ("--max-model-len, --seed, --enforce-eager", "as in vLLM"),
    (
        "--generation-config, --override-generation-config",
        "sampling defaults from "
        "generation_config.json (auto), none (vllm), or a folder; overrides as JSON",
    ),
    ("--quantization", "fp8 (online FP8 weights) or none"),
    ("--chat-template", "a Jinja template file or string replacing the model's"),
    ("--block-size, --kv-cache-dtype, --kv-cache-memory-bytes", "as in vLLM (fp8 = fp8_e4m3)"),
    (
        "--gpu-memory-utilization",
        "fraction of device memory; on CPU the KV cache is capped "
        "at 4 GiB unless --kv-cache-memory-bytes is given",
    ),
    ("--enable-prefix-caching / --no-enable-prefix-caching", "on by default"),
    (
        "--kv-offloading-size",
        "as in vLLM (GiB of host memory; the native backend): evicted prefix blocks are kept "
        "there and copied back on a hit",
    ),
    ("--max-num-seqs, --max-num-batched-tokens", "as in vLLM"),
    (
        "--scheduling-policy",
        "as in vLLM: fcfs (default), or priority: requests' `priority` field (lower first, "
        "then arrival) orders admission and preemption; a non-zero priority under fcfs is a 400",
    ),
    ("--tensor-parallel-size, -tp", "one process per device"),
    (
        "--kv-events-config",
        "as in vLLM: prefix-cache events over ZMQ in vLLM's schema, with replay "
        "(docs/deployment.md)",
    ),
    (
        "--speculative-config",
        "as in vLLM for the ngram and suffix methods (num_speculative_tokens, "
        "prompt_lookup_min/max, suffix_decoding_*, disable_by_batch_size); methods that need a "
        "draft model or head are refused by name",
    ),
    (
        "--enable-lora, --lora-modules, --max-loras, --max-lora-rank, --max-cpu-loras",
        "as in vLLM: PEFT adapters (q/k/v/o/gate/up/down, rsLoRA) mixed in one batch; "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True or --allow-runtime-lora-updating serves "
        "/v1/load_lora_adapter and /v1/unload_lora_adapter; not yet with tensor parallelism",
    ),
    ("--disable-fastapi-docs, --disable-uvicorn-access-log, --root-path", "as in vLLM"),
    ("--ssl-keyfile, --ssl-certfile", "HTTPS, as in vLLM"),
    (
        "--allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials",
        "CORS, as in vLLM (JSON lists)",
    ),
)


def _dest(flag: str) -> str:
    return "vllm_" + flag.lstrip("-").replace("-", "_")


def add_vllm_compat_args(parser: argparse.ArgumentParser) -> None:
    """Add the flags of COMPAT_FLAGS (their own section of --help; docs/vllm-flags.md)."""
    group = parser.add_argument_group(
        "vLLM's other flags (accepted as vLLM's, with a warning, or refused with the reason)"
    )
    for compat in COMPAT_FLAGS:
        names = [compat.flag] + ([compat.short] if compat.short else [])
        help_ = f"vLLM flag: {compat.status}: {compat.reason}"
        if compat.takes_value:
            metavar = compat.flag.lstrip("-").replace("-", "_").upper()
            group.add_argument(
                *names, dest=_dest(compat.flag), default=None, help=help_, metavar=metavar
            )
        else:
            group.add_argument(
                *names, dest=_dest(compat.flag), action="store_true", default=None, help=help_
            )


def apply_vllm_compat(ns: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """Return (infer8 field -> value from aliases, warning lines); raise ValueError if refused."""
    overrides: dict[str, Any] = {}
    warnings: list[str] = []
    for compat in COMPAT_FLAGS:
        value = getattr(ns, _dest(compat.flag), None)
        if value is None:
            continue
        text = str(value)
        shown = f"{compat.flag} {text}" if compat.takes_value else compat.flag
        if compat.status == "alias":
            assert compat.target is not None
            overrides[compat.target] = value
        elif compat.status == "ignored":
            warnings.append(f"warning: {shown} has no effect in infer8: {compat.reason}")
        elif compat.takes_value and text in compat.ok_values:
            continue  # the value says what infer8 does anyway
        else:
            raise ValueError(f"{shown} is not supported: {compat.reason}")
    return overrides, warnings


def parse_json_list(value: str | list[str], flag: str) -> list[str]:
    """Parse a vLLM-style JSON list flag value such as '["*"]' (a bare word is one item)."""
    if isinstance(value, list):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return [value]
    if not isinstance(parsed, list) or not all(isinstance(x, str) for x in parsed):
        raise ValueError(f"{flag} must be a JSON list of strings, got {value!r}")
    return parsed


def flags_table_markdown() -> str:
    """Return the docs table of every vLLM serve flag infer8 handles and what it does."""
    lines = ["| vLLM flag | in infer8 | note |", "|---|---|---|"]
    for flag, note in NATIVE_FLAGS:
        lines.append(f"| `{flag}` | supported | {note} |")
    for compat in COMPAT_FLAGS:
        flag = compat.flag + (f", {compat.short}" if compat.short else "")
        status = {
            "alias": "supported",
            "ignored": "accepted, warns",
            "refused": "refused"
            if not compat.ok_values
            else "refused unless "
            + " / ".join(f"`{v}`" for v in compat.ok_values[:3])
            + (" ..." if len(compat.ok_values) > 3 else ""),
        }[compat.status]
        lines.append(f"| `{flag}` | {status} | {compat.reason} |")
    return "\n".join(lines) + "\n"
