"""Sessions at an SLO: the most concurrent chat sessions a server holds within latency limits.

Each session is a multi-turn chat (`/v1/chat/completions`, streamed): a first user message, the
model's answer, a think time, the next user message with the whole history, and so on; a
session that has used its turns starts afresh, so the number of live sessions stays fixed.
For one concurrency the run lasts a window (after a warm-up); it passes when no request fails
and the p99 TTFT and p99 TPOT of the requests sent in the window (each run to its end) stay
within the limits. The search doubles the concurrency until a level fails, then bisects between the last
pass and the first failure, probing a bounded number of levels. Only standard API fields are
sent, so the same command measures any OpenAI-compatible server.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from infer8.bench.report import fmt, markdown_table, summarize
from infer8.bench.serve import (
    RequestResult,
    ServeConfig,
    _send,
    fetch_model_id,
    open_client,
    server_address,
)
from infer8.bench.workload import BenchRequest, LengthSpec, TokenizerLike, load_prompt_corpus

if TYPE_CHECKING:
    import aiohttp


@dataclass(frozen=True)
class SessionSLO:
    """The chat-session workload and the limits one concurrency must meet."""

    ttft_p99_ms: float = 2000.0
    tpot_p99_ms: float = 150.0
    num_turns: int = 4
    first_len: LengthSpec = LengthSpec.parse("lognormal:200:0.8:1000")  # system + question
    turn_len: LengthSpec = LengthSpec.parse("uniform:20:120")  # each follow-up question
    output_len: LengthSpec = LengthSpec.parse("uniform:32:256")
    think_time_s: float = 3.0  # mean (exponential) pause between an answer and the next turn
    warmup_s: float = 10.0
    window_s: float = 60.0
    max_sessions: int = 256
    max_probes: int = 8

    def __post_init__(self) -> None:
        if self.ttft_p99_ms <= 0 or self.tpot_p99_ms <= 0:
            raise ValueError("the SLO limits must be positive")
        if self.num_turns < 1 or self.max_sessions < 1 or self.max_probes < 1:
            raise ValueError("num_turns, max_sessions and max_probes must be >= 1")
        if self.window_s <= 0 or self.warmup_s < 0 or self.think_time_s < 0:
            raise ValueError("window_s must be > 0; warmup_s and think_time_s >= 0")


@dataclass
class LevelResult:
    """What one concurrency did in its window."""

    num_sessions: int
    num_requests: int
    num_failed: int
    ttft_p99_s: float | None
    tpot_p99_s: float | None
    output_tokens_per_s: float
    passed: bool
    # TTFT of a returning session (turns after the first: the history may be cached), median
    returning_ttft_p50_s: float | None = None


def level_passes(results: list[RequestResult], slo: SessionSLO) -> tuple[bool, dict[str, Any]]:
    """Return whether finished requests meet the SLO, and their summary."""
    ok = [r for r in results if r.success]
    ttft = summarize([r.ttft_s for r in ok if r.ttft_s is not None], "ttft")
    tpot = summarize([r.tpot_s for r in ok if r.tpot_s is not None], "tpot")
    failed = len(results) - len(ok)
    ttft_p99, tpot_p99 = ttft["ttft_p99_s"], tpot["tpot_p99_s"]
    passed = (
        bool(ok)
        and failed == 0
        and ttft_p99 is not None
        and ttft_p99 * 1e3 <= slo.ttft_p99_ms
        and (tpot_p99 is None or tpot_p99 * 1e3 <= slo.tpot_p99_ms)
    )
    return passed, {"num_failed": failed, "ttft_p99_s": ttft_p99, "tpot_p99_s": tpot_p99}


def next_level(passed: dict[int, bool], max_sessions: int) -> int | None:
    """Return the next concurrency to probe (doubling, then bisecting), None when settled."""
    best = max((n for n, ok in passed.items() if ok), default=0)
    worst = min((n for n, ok in passed.items() if not ok), default=None)
    if worst is None:
        if best >= max_sessions:
            return None
        return min(max_sessions, max(1, 2 * best))
    if worst == 1 or worst - best <= 1:
        return None
    return (best + worst) // 2


class _Texts:
    """Cuts user messages of sampled token lengths from the shipped public-domain texts."""

    def __init__(self, tokenizer: TokenizerLike, seed: int) -> None:
        self.tokenizer = tokenizer
        self.corpus = load_prompt_corpus(tokenizer)
        self.rng = random.Random(seed)

    def message(self, spec: LengthSpec) -> tuple[str, int]:
        (n,) = spec.sample(1, self.rng)
        n = min(n, len(self.corpus) - 1)
        start = self.rng.randrange(len(self.corpus) - n)
        return self.tokenizer.decode(self.corpus[start : start + n]), n


async def run_level(
    config: ServeConfig,
    slo: SessionSLO,
    num_sessions: int,
    texts: _Texts,
    client: aiohttp.ClientSession,
    model: str,
) -> LevelResult:
    """Hold `num_sessions` chat sessions for warm-up + window; judge every request sent in the
    window once it ends (sessions send nothing new after the window)."""
    base_url, headers = server_address(config)
    url = f"{base_url}/v1/chat/completions"
    start = time.perf_counter()
    window_start, window_end = start + slo.warmup_s, start + slo.warmup_s + slo.window_s
    in_window: list[RequestResult] = []
    returning: list[RequestResult] = []  # of those, turns after a session's first
    rng = random.Random(config.seed + num_sessions)

    async def session_loop() -> None:
        await asyncio.sleep(rng.uniform(0, min(slo.think_time_s, slo.warmup_s)))  # stagger
        while time.perf_counter() < window_end:
            messages: list[dict[str, str]] = []
            for turn in range(slo.num_turns):
                if time.perf_counter() >= window_end:
                    return  # no new request after the window; those sent in it finish
                text, _ = texts.message(slo.first_len if turn == 0 else slo.turn_len)
                messages.append({"role": "user", "content": text})
                (max_tokens,) = slo.output_len.sample(1, rng)
                body: dict[str, Any] = {
                    "model": model, "messages": messages, "max_tokens": max_tokens,
                    "temperature": config.temperature, "stream": True,
                    **({"stream_options": {"include_usage": True}} if config.stream_usage else {}),
                    **config.extra_body,
                }  # fmt: skip
                sent = time.perf_counter()
                result = await _send(
                    client, url, headers, body, BenchRequest([], text, max_tokens), True,
                    texts.tokenizer, start,
                )  # fmt: skip
                if sent >= window_start:  # judged: every request sent in the window
                    in_window.append(result)
                    if turn:
                        returning.append(result)
                if not result.success:
                    return  # a failed session stops: the level has failed anyway
                messages.append({"role": "assistant", "content": result.generated_text})
                pause_s = rng.expovariate(1.0 / slo.think_time_s) if slo.think_time_s else 0.0
                await asyncio.sleep(pause_s)

    tasks = [asyncio.create_task(session_loop()) for _ in range(num_sessions)]
    await asyncio.gather(*tasks)  # the requests sent in the window run to their end
    passed, summary = level_passes(in_window, slo)
    tokens = sum(r.output_tokens for r in in_window if r.success)
    ttft_returning = [r.ttft_s for r in returning if r.success and r.ttft_s is not None]
    return LevelResult(
        num_sessions=num_sessions,
        num_requests=len(in_window),
        num_failed=summary["num_failed"],
        ttft_p99_s=summary["ttft_p99_s"],
        tpot_p99_s=summary["tpot_p99_s"],
        output_tokens_per_s=tokens / slo.window_s,
        passed=passed,
        returning_ttft_p50_s=summarize(ttft_returning, "ttft")["ttft_p50_s"],
    )


async def find_max_sessions_async(
    config: ServeConfig, slo: SessionSLO, tokenizer: TokenizerLike, log: bool = True
) -> dict[str, Any]:
    """Search for the most concurrent sessions within the SLO; return every probe and the answer."""
    base_url, headers = server_address(config)
    texts = _Texts(tokenizer, config.seed)
    levels: list[LevelResult] = []
    passed: dict[int, bool] = {}
    async with open_client(slo.max_sessions, config.timeout_s) as client:
        model = config.model or await fetch_model_id(client, base_url, headers)
        level: int | None = 1
        while level is not None and len(levels) < slo.max_probes:
            result = await run_level(config, slo, level, texts, client, model)
            levels.append(result)
            passed[level] = result.passed
            if log:
                print(
                    f"sessions {level}: {'pass' if result.passed else 'FAIL'} "
                    f"(TTFT p99 {fmt(result.ttft_p99_s, 1e3)} ms, TPOT p99 "
                    f"{fmt(result.tpot_p99_s, 1e3)} ms, returning TTFT p50 "
                    f"{fmt(result.returning_ttft_p50_s, 1e3)} ms, {result.num_failed} failed, "
                    f"{result.num_requests} requests)",
                    flush=True,
                )
            level = next_level(passed, slo.max_sessions)
    best = max((n for n, ok in passed.items() if ok), default=0)
    return {
        "bench": "sessions",
        "base_url": base_url,
        "model": model,
        "slo": {  # asdict would turn the length specs into dicts: keep their spec strings
            f.name: (v.describe() if isinstance(v := getattr(slo, f.name), LengthSpec) else v)
            for f in fields(slo)
        },
        "max_sessions_within_slo": best,
        "search_settled": level is None,
        "levels": [asdict(r) for r in levels],
    }


def find_max_sessions(
    config: ServeConfig, slo: SessionSLO, tokenizer: TokenizerLike, log: bool = True
) -> dict[str, Any]:
    """Run the search (blocking)."""
    return asyncio.run(find_max_sessions_async(config, slo, tokenizer, log))


def format_sessions(result: dict[str, Any]) -> str:
    """Return the search as markdown: the answer, then every probed level."""
    slo = result["slo"]
    rows = [
        [
            str(r["num_sessions"]), "pass" if r["passed"] else "FAIL", str(r["num_requests"]),
            str(r["num_failed"]), fmt(r["ttft_p99_s"], 1e3, 0), fmt(r["tpot_p99_s"], 1e3, 0),
            fmt(r["output_tokens_per_s"]), fmt(r.get("returning_ttft_p50_s"), 1e3, 0),
        ]
        for r in sorted(result["levels"], key=lambda r: r["num_sessions"])
    ]  # fmt: skip
    settled = "" if result["search_settled"] else " (the probe budget ran out first)"
    return (
        f"## infer8 bench serve --sessions-slo: {result['model']} at {result['base_url']}\n\n"
        f"**{result['max_sessions_within_slo']} concurrent chat sessions** within TTFT p99 <= "
        f"{slo['ttft_p99_ms']:.0f} ms and TPOT p99 <= {slo['tpot_p99_ms']:.0f} ms{settled}.\n\n"
        f"Sessions of {slo['num_turns']} turns (first message {slo['first_len']}, follow-ups "
        f"{slo['turn_len']}, answers {slo['output_len']} tokens, think time "
        f"{slo['think_time_s']} s mean); each level: {slo['warmup_s']:.0f} s warm-up, "
        f"{slo['window_s']:.0f} s judged.\n\n"
        + markdown_table(
            [
                "sessions",
                "result",
                "requests",
                "failed",
                "TTFT p99 ms",
                "TPOT p99 ms",
                "output tok/s",
                "returning TTFT p50 ms",
            ],
            rows,
        )
    )
