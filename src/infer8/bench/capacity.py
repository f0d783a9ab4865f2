"""`infer8 bench capacity`: how many sessions of a context length a fixed KV budget holds at once.

Measured by admitting requests into a real engine, not only computed:

- continuous (paged, on demand): N requests whose prompts are `context_len` tokens long are
  offered at once, with a token budget and seat count that fit them all in one step. The
  scheduler allocates blocks for each admitted prompt until the pool runs out; every request
  admitted in that step holds `context_len` tokens of K/V at the same time (the step writes
  them), which is what a session that has grown to `context_len` tokens holds.
- static (reserve up front): N requests of `prompt_len` prompt tokens and `max_tokens` are
  offered; the scheduler reserves prompt + max_tokens for each admitted request, as a static
  batcher must when it cannot know how long an answer will be.

The measured count is checked against the block arithmetic (num_blocks // blocks per
session); N is that arithmetic plus a margin, so a measurement equal to N would mean the
offer, not the cache, was the limit (reported as `is_saturated`). The continuous measurement
prefills sessions x context_len tokens in one step, so it needs that step's activation memory
besides the KV budget: with a very large budget, measure a shorter context.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import torch

from infer8.attention.kv_cache import KVCacheSpec
from infer8.bench.report import fmt, fmt_bytes, markdown_table
from infer8.bench.throughput import bench_engine_args
from infer8.bench.workload import LengthSpec, make_requests
from infer8.config import EngineArgs, KVCacheDType, parse_dtype
from infer8.engine import LLMEngine, resolve_model_path
from infer8.models.loader import read_hf_config
from infer8.sampling_params import SamplingParams
from infer8.utils import cdiv

DEFAULT_KV_BYTES = 512 << 20


def tokens_per_session(scheduler: str, context_len: int, prompt_len: int, max_tokens: int) -> int:
    """Return the tokens one session holds: its context (continuous) or its reservation."""
    return prompt_len + max_tokens if scheduler == "static" else context_len


def _engine(args: EngineArgs, num_seqs: int, num_batched_tokens: int) -> LLMEngine:
    return LLMEngine(
        bench_engine_args(
            args,
            max_num_seqs=max(1, num_seqs),
            max_num_batched_tokens=max(1, num_batched_tokens),
            enable_prefix_caching=False,  # distinct prompts anyway; count allocation only
            enforce_eager=True,  # one step: compiling or capturing graphs would cost more
        )
    )


def _estimate_blocks(args: EngineArgs) -> tuple[int, int] | None:
    """Return (num_blocks, block_size) the engine will have, from config.json; None if unknown."""
    try:
        cfg = read_hf_config(Path(resolve_model_path(args.model)))
    except ValueError:
        return None  # a GGUF file: let a probe engine tell
    num_heads = cfg["num_attention_heads"]
    model_dtype = parse_dtype(args.dtype) or torch.bfloat16
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    kv_dtype = KVCacheDType.parse(args.kv_cache_dtype).torch_dtype(model_dtype)
    spec = KVCacheSpec(
        num_layers=cfg["num_hidden_layers"],
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        block_size=args.block_size,
        dtype=kv_dtype,
    )
    assert args.kv_cache_memory_bytes is not None
    # Without the exact tail's rings: they depend on the seats, which this estimate sizes (the
    # engine built with those seats counts them, and the offer then has room to spare).
    return spec.num_blocks_for(args.kv_cache_memory_bytes), args.block_size


def measure_capacity(
    args: EngineArgs,
    context_len: int,
    prompt_len: int,
    max_tokens: int,
    margin: int | None = None,
) -> dict[str, Any]:
    """Admit sessions into an engine built from args (its scheduler and KV dtype and budget).

    Returns the measured `max_concurrent_sessions` with the arithmetic it is checked against.
    """
    if args.kv_cache_memory_bytes is None:
        raise ValueError("capacity needs a fixed KV budget: set kv_cache_memory_bytes")
    if not 0 < prompt_len < context_len:
        raise ValueError(f"need 0 < prompt_len < context_len, got {prompt_len}, {context_len}")
    scheduler = args.scheduler
    session_tokens = tokens_per_session(scheduler, context_len, prompt_len, max_tokens)
    prompt_tokens = context_len if scheduler == "continuous" else prompt_len

    def plan(num_blocks: int, block_size: int) -> tuple[int, int, int]:
        """Return blocks per session, the sessions that fit, and how many to offer."""
        blocks_per_session = cdiv(session_tokens, block_size)
        expected = num_blocks // blocks_per_session
        if expected < 1:
            raise ValueError(
                f"the KV budget ({num_blocks} blocks of {block_size} tokens) holds no session "
                f"of {session_tokens} tokens; raise --kv-cache-memory-bytes"
            )
        return (
            blocks_per_session,
            expected,
            expected + (margin if margin is not None else max(2, expected // 10)),
        )

    # Seats and a token budget large enough for everything offered, so only the KV cache can
    # limit admission; sized from the config when it can be read, else from a probe engine.
    estimate = _estimate_blocks(args)
    if estimate is None:
        probe = _engine(args, 1, context_len)
        estimate = probe.num_blocks, probe.cache_config.block_size
        del probe
        gc.collect()
    num_offered = plan(*estimate)[2]
    engine = _engine(args, num_offered, num_offered * prompt_tokens)
    num_blocks, block_size = engine.num_blocks, engine.cache_config.block_size
    if scheduler == "static":  # the engine caps a reservation at max_model_len
        session_tokens = min(session_tokens, engine.max_model_len)
    blocks_per_session, expected, num_offered_needed = plan(num_blocks, block_size)
    if num_offered_needed > num_offered:  # the estimate was low: rebuild with enough room
        num_offered = num_offered_needed
        del engine
        gc.collect()
        engine = _engine(args, num_offered, num_offered * prompt_tokens)
    requests = make_requests(
        engine.tokenizer,
        num_offered,
        LengthSpec("fixed", prompt_tokens),
        LengthSpec("fixed", 1),
        vocab_size=engine.vocab_size,
    )
    # continuous: one output token (the prompt is the whole session); static: the client's cap
    params = SamplingParams(
        max_tokens=1 if scheduler == "continuous" else max_tokens, temperature=0.0, ignore_eos=True
    )
    t0 = time.perf_counter()
    ids = [engine.add_request(r.prompt_token_ids, params) for r in requests]
    try:
        engine.step()
        stats = engine.last_stats
    finally:
        engine.abort_request(ids)
    elapsed_s = time.perf_counter() - t0
    admitted = len(stats.admitted_req_ids)
    # Continuous requests finish (and free) within the step, static ones still hold their
    # reservation: what the step scheduled and holds must agree with the admitted count.
    if scheduler == "static":
        is_consistent = stats.num_kv_blocks_used == admitted * blocks_per_session
    else:
        is_consistent = stats.num_scheduled_tokens == admitted * context_len
    result = {
        "scheduler": scheduler,
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_storage_dtype": str(engine.kv_spec.dtype).removeprefix("torch."),
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "kv_bytes_per_token": engine.kv_spec.bytes_per_token,
        "kv_exact_tail_tokens": engine.kv_spec.exact_tail_tokens,
        "kv_exact_tail_bytes": engine.kv_spec.tail_bytes(engine.num_tail_rows),
        "num_kv_blocks": num_blocks,
        "block_size": block_size,
        "context_len": context_len,
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
        "tokens_per_session": session_tokens,
        "blocks_per_session": blocks_per_session,
        "expected_sessions": expected,
        "num_offered": num_offered,
        "max_concurrent_sessions": admitted,
        "kv_blocks_held": admitted * blocks_per_session,
        "step_scheduled_tokens": stats.num_scheduled_tokens,
        "step_kv_blocks_used": stats.num_kv_blocks_used,
        "step_preemptions": stats.num_preemptions,
        "matches_block_arithmetic": admitted == expected and is_consistent,
        "is_saturated": admitted >= num_offered,
        "measure_s": elapsed_s,
    }
    del engine
    gc.collect()
    return result


def run_capacity(
    args: EngineArgs,
    context_len: int = 1024,
    prompt_len: int | None = None,
    max_tokens: int | None = None,
    schedulers: tuple[str, ...] = ("static", "continuous"),
    kv_cache_dtypes: tuple[str, ...] = ("bfloat16", "fp8_e4m3"),
) -> dict[str, Any]:
    """Measure every scheduler x KV dtype at one budget; return groups and their ratios."""
    if args.kv_cache_memory_bytes is None:
        args = bench_engine_args(args, kv_cache_memory_bytes=DEFAULT_KV_BYTES)
    prompt_len = prompt_len if prompt_len is not None else context_len // 2
    max_tokens = max_tokens if max_tokens is not None else context_len
    groups = []
    for kv in kv_cache_dtypes:
        for sched in schedulers:
            group_args = bench_engine_args(args, scheduler=sched, kv_cache_dtype=kv)
            print(f"capacity: {sched} scheduler, {kv} KV cache ...", flush=True)
            groups.append(measure_capacity(group_args, context_len, prompt_len, max_tokens))
    return {
        "bench": "capacity",
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "context_len": context_len,
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
        "groups": groups,
        "ratios": capacity_ratios(groups),
        "method": __doc__,
    }


def capacity_ratios(groups: list[dict[str, Any]]) -> dict[str, float]:
    """Return fp8/16-bit ratios per scheduler, continuous/static per dtype, and best/worst."""
    by_key = {(g["scheduler"], g["kv_cache_dtype"]): g["max_concurrent_sessions"] for g in groups}
    ratios: dict[str, float] = {}
    dtypes = list(dict.fromkeys(g["kv_cache_dtype"] for g in groups))
    scheds = list(dict.fromkeys(g["scheduler"] for g in groups))
    fp8 = [d for d in dtypes if KVCacheDType.parse(d).is_fp8]
    wide = [d for d in dtypes if not KVCacheDType.parse(d).is_fp8]
    for s in scheds:
        for d8 in fp8:
            for dw in wide:
                if by_key.get((s, dw)):
                    ratios[f"{s}:{d8}/{dw}"] = by_key[(s, d8)] / by_key[(s, dw)]
    if "static" in scheds and "continuous" in scheds:
        for d in dtypes:
            if by_key.get(("static", d)):
                ratios[f"{d}:continuous/static"] = by_key[("continuous", d)] / by_key[("static", d)]
    worst, best = min(by_key.values()), max(by_key.values())
    if worst:
        ratios["best/worst"] = best / worst
    return ratios


def format_capacity(r: dict[str, Any]) -> str:
    """Return a markdown report of run_capacity's result."""
    rows = [
        [
            g["scheduler"],
            g["kv_cache_dtype"],
            str(g["kv_bytes_per_token"]),
            str(g["num_kv_blocks"]),
            str(g["tokens_per_session"]),
            str(g["blocks_per_session"]),
            str(g["expected_sessions"]),
            f"**{g['max_concurrent_sessions']}**"
            + (" (offer-limited)" if g["is_saturated"] else ""),
            "yes" if g["matches_block_arithmetic"] else "NO",
        ]
        for g in r["groups"]
    ]
    table = markdown_table(
        [
            "scheduler",
            "KV dtype",
            "KV bytes/token",
            "KV blocks",
            "tokens/session",
            "blocks/session",
            "arithmetic",
            "measured sessions",
            "match",
        ],
        rows,
    )
    ratios = ", ".join(f"{k} {fmt(v, digits=2)}x" for k, v in r["ratios"].items())
    return (
        f"## infer8 bench capacity: sessions of {r['context_len']} tokens in "
        f"{fmt_bytes(r['kv_cache_memory_bytes'])} of KV cache\n\n"
        f"{table}\n\nRatios: {ratios}.\n\n"
        f"Continuous sessions hold their {r['context_len']}-token context (blocks allocated on "
        f"demand); static sessions reserve prompt {r['prompt_len']} + max_tokens "
        f"{r['max_tokens']} = {r['prompt_len'] + r['max_tokens']} tokens at admission. "
        "Counts are requests actually admitted in one engine step with every offered request "
        "fitting the seat and token limits, so only the KV cache limits them."
    )
