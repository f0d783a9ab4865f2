"""`infer8 bench throughput | serve | suite | capacity | compare`: the flags (the runs are commands.py)."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from infer8.bench import commands
from infer8.bench.workload import LengthSpec
from infer8.entrypoints.args import add_engine_args


def _add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, metavar="PATH", help="write the full result as JSON")
    p.add_argument("--markdown", default=None, metavar="PATH", help="write the markdown report")
    p.add_argument("--plot-dir", default=None, metavar="DIR", help="write PNG plots here")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bars")


def _add_workload_args(
    p: argparse.ArgumentParser, num_requests: int, input_len: str, output_len: str
) -> None:
    """Add the workload flags; the workload's seed is --seed (the engine's, where there is one)."""
    spec_help = "N (fixed), uniform:LOW:HIGH, or lognormal:MEDIAN[:SIGMA[:MAX]] (long-tailed)"
    p.add_argument("--num-requests", "--num-prompts", type=int, default=num_requests)
    p.add_argument(
        "--input-len",
        type=LengthSpec.parse,
        default=input_len,
        help=f"prompt tokens: {spec_help} (default: {input_len})",
    )
    p.add_argument(
        "--output-len",
        type=LengthSpec.parse,
        default=output_len,
        help=f"output tokens: {spec_help} (default: {output_len})",
    )


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v for v in value.split(",") if v)


def add_bench_parser(sub: Any) -> None:
    """Register `infer8 bench` and its subcommands on the top-level subparsers."""
    bench = sub.add_parser("bench", help="benchmarks: throughput, serve, capacity, compare, suite")
    bsub = bench.add_subparsers(dest="bench", required=True)

    tp = bsub.add_parser("throughput", help="offline throughput and step stats of one engine")
    add_engine_args(tp)
    _add_workload_args(tp, 64, "128", "128")
    tp.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="send this cap and stop each request at its output length "
        "(as EOS would); default: max_tokens = output length",
    )
    tp.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    tp.add_argument(
        "--peak-matmul-size",
        type=int,
        default=2048,
        help="matmul size for the machine's peak FLOP/s (0: skip)",
    )
    _add_output_args(tp)
    tp.set_defaults(func=commands.cmd_throughput)

    st = bsub.add_parser(
        "suite",
        help="W1/W2/W3 offline + online serving in one run, each against its matmul roofline",
    )
    add_engine_args(st)
    st.add_argument(
        "--workloads",
        type=_csv,
        default=("W1", "W2", "W3"),
        help="offline workloads: W1 (64 x 128/128), W2 (128 x 12..244 / 12..244), "
        "W3 (32 x 2048/128)",
    )
    st.add_argument(
        "--online-concurrency",
        type=int,
        default=32,
        help="W1's requests against `infer8 serve` with these flags at this concurrency (0: skip)",
    )
    st.add_argument(
        "--scale", type=float, default=1.0, help="multiply request counts and lengths (quick runs)"
    )
    st.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="offline and online W1 run this many times, alternating; the online/offline ratio "
        "is reported per pair and as the median (this machine's noise exceeds the gap)",
    )
    _add_output_args(st)
    st.set_defaults(func=commands.cmd_suite)

    sd = bsub.add_parser(
        "spec-decode",
        help="speculative decoding against none: input-grounded requests at concurrency 1 and "
        "W1 at concurrency 32, one engine per method in one run",
    )
    add_engine_args(sd)
    sd.add_argument(
        "--methods", type=_csv, default=("none", "ngram", "suffix"),
        help="none, ngram, suffix (the first is the baseline the ratios divide by)",
    )  # fmt: skip
    sd.add_argument("--num-prompts", type=int, default=12, help="input-grounded requests")
    sd.add_argument("--max-tokens", type=int, default=128, help="their output cap")
    sd.add_argument("--w1-requests", type=int, default=32, help="W1's concurrency (0: skip)")
    _add_output_args(sd)
    sd.set_defaults(func=commands.cmd_spec_decode)

    lo = bsub.add_parser(
        "lora",
        help="W1 through the base model alone, one LoRA adapter and N adapters mixed uniformly, "
        "one engine per group in one run",
    )
    add_engine_args(lo)
    lo.add_argument("--num-adapters", type=int, default=4, help="adapters of the mixed group")
    lo.add_argument("--rank", type=int, default=16, help="the random adapters' rank")
    lo.add_argument("--num-requests", type=int, default=64, help="W1's requests (128/128)")
    lo.add_argument("--rounds", type=int, default=1, help="the groups run this many times, in turn")
    _add_output_args(lo)
    lo.set_defaults(func=commands.cmd_lora)

    sv = bsub.add_parser("serve", help="streaming load against any OpenAI-compatible server")
    sv.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    sv.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    sv.add_argument(
        "--model", default=None, help="model name to send (default: the server's first)"
    )
    sv.add_argument(
        "--tokenizer",
        default=None,
        help="HF dir or .gguf whose tokenizer cuts the prompts (default: infer8's default model)",
    )
    sv.add_argument("--api-key", default=None)
    _add_workload_args(sv, 200, "128", "128")
    sv.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s with Poisson arrivals (default inf: all at once)",
    )
    sv.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of inter-arrival times (1.0: Poisson)",
    )
    sv.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="closed loop: at most this many requests in flight",
    )
    sv.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos (a vLLM / llama.cpp extra) so outputs run to max_tokens",
    )
    sv.add_argument("--temperature", type=float, default=0.0)
    sv.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 (names: ttft, tpot, e2el)",
    )
    sv.add_argument(
        "--no-stream-usage",
        action="store_true",
        help="do not send stream_options.include_usage (for servers that refuse it)",
    )
    sv.add_argument(
        "--extra-body",
        type=json.loads,
        default={},
        help="JSON object merged into every request body",
    )
    sv.add_argument(
        "--dataset-name",
        choices=["random", "grounded"],
        default="random",
        help="random: prompts cut from public-domain text at --input-len; grounded: chats whose "
        "answers copy much of the prompt (rewrite, annotate or fix a given code block or "
        "paragraph: speculative decoding's workload), sent as completions of the chat template's "
        "text, --output-len the cap",
    )
    sv.add_argument("--timeout-s", type=float, default=600.0)
    sv.add_argument("--seed", type=int, default=0, help="seed of lengths, prompts and arrivals")
    slo = sv.add_argument_group(
        "sessions at an SLO (--sessions-slo): the most concurrent multi-turn chat sessions the "
        "server holds within p99 limits, by a bounded search over concurrency"
    )
    slo.add_argument(
        "--sessions-slo",
        action="store_true",
        help="search for the most concurrent chat sessions within the SLO (chat endpoint)",
    )
    slo.add_argument("--slo-ttft-p99-ms", type=float, default=2000.0)
    slo.add_argument("--slo-tpot-p99-ms", type=float, default=150.0)
    slo.add_argument("--session-turns", type=int, default=4, help="turns per session")
    slo.add_argument(
        "--session-first-len",
        type=LengthSpec.parse,
        default=LengthSpec.parse("lognormal:200:0.8:1000"),
        help="tokens of a session's first message",
    )
    slo.add_argument(
        "--session-turn-len",
        type=LengthSpec.parse,
        default=LengthSpec.parse("uniform:20:120"),
        help="tokens of each follow-up message",
    )
    slo.add_argument(
        "--session-output-len",
        type=LengthSpec.parse,
        default=LengthSpec.parse("uniform:32:256"),
        help="max_tokens of each answer",
    )
    slo.add_argument("--think-time-s", type=float, default=3.0, help="mean pause between turns")
    slo.add_argument("--warmup-s", type=float, default=10.0, help="per level, not judged")
    slo.add_argument("--window-s", type=float, default=60.0, help="per level, judged")
    slo.add_argument("--max-sessions", type=int, default=256)
    slo.add_argument("--max-probes", type=int, default=8, help="levels probed at most")
    _add_output_args(sv)
    sv.set_defaults(func=commands.cmd_serve)

    cp = bsub.add_parser("capacity", help="concurrent sessions that fit a fixed KV budget")
    add_engine_args(cp)
    cp.add_argument(
        "--context-len", type=int, default=1024, help="tokens each session holds (prompt + output)"
    )
    cp.add_argument(
        "--prompt-len",
        type=int,
        default=None,
        help="static: prompt tokens (default: context_len / 2)",
    )
    cp.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="static: the max_tokens a client sends and static reserves (default: context_len)",
    )
    cp.add_argument("--schedulers", type=_csv, default=("static", "continuous"))
    cp.add_argument("--kv-cache-dtypes", type=_csv, default=("bfloat16", "fp8_e4m3"))
    _add_output_args(cp)
    cp.set_defaults(func=commands.cmd_capacity)

    cm = bsub.add_parser("compare", help="{static, continuous} x {bf16, fp8} KV on one workload")
    add_engine_args(cm)
    _add_workload_args(cm, 64, "128", "uniform:20:150")
    cm.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="the cap every request is sent with (default: the longest output)",
    )
    cm.add_argument("--schedulers", type=_csv, default=("static", "continuous"))
    cm.add_argument("--kv-cache-dtypes", type=_csv, default=("bfloat16", "fp8_e4m3"))
    cm.add_argument(
        "--hf-baseline",
        action="store_true",
        help="also run Hugging Face transformers generate (static batches)",
    )
    cm.add_argument("--hf-batch-size", type=int, default=32)
    cm.add_argument(
        "--eval-tokens",
        type=int,
        default=2048,
        help="tokens for the FP8 accuracy delta (infer8 eval kv); 0 skips it",
    )
    cm.add_argument("--eval-text", default="areopagitica.txt")
    cm.add_argument("--peak-matmul-size", type=int, default=2048)
    _add_output_args(cm)
    cm.set_defaults(func=commands.cmd_compare)
