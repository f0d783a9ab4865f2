"""`infer8 bench serve`: stream requests at any OpenAI-compatible server and time every token.

Only standard API fields are sent (model, prompt or messages, max_tokens, temperature, stream,
stream_options.include_usage); `ignore_eos` (vLLM's and llama.cpp's extra) only on request.
Output tokens are counted from the server's usage when it reports it, else by re-tokenizing
the generated text, else by counting streamed chunks; each request records which.

The client is aiohttp, as `vllm bench serve`'s: on a machine the server shares, the load
generator's own CPU time is taken from the server (httpx's pure-Python stream parsing cost ~2.5x
aiohttp's per streamed chunk on a 2-core machine).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from infer8.bench.report import fmt, markdown_table, summarize
from infer8.bench.workload import BenchRequest, TokenizerLike, workload_summary
from infer8.progress import progress_bar

GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class ServeConfig:
    """Where to send requests and how fast."""

    base_url: str
    endpoint: str = "completions"  # or "chat"
    model: str | None = None  # None: the first id of GET /v1/models
    api_key: str | None = None
    request_rate: float = math.inf  # requests/s, Poisson arrivals; inf: all at once
    burstiness: float = 1.0  # gamma shape of inter-arrival times; 1.0 is Poisson
    max_concurrency: int | None = None  # closed loop: at most this many in flight
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    timeout_s: float = 600.0
    stream_usage: bool = True  # send stream_options.include_usage
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be completions or chat, got {self.endpoint!r}")
        if not self.request_rate > 0:
            raise ValueError(
                f"request_rate must be > 0 (inf for all at once), got {self.request_rate}"
            )
        if self.burstiness <= 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        bad = set(self.goodput_slos_ms) - set(GOODPUT_METRICS)
        if bad:
            raise ValueError(f"goodput SLOs are {GOODPUT_METRICS}, got {sorted(bad)}")


def server_address(config: ServeConfig) -> tuple[str, dict[str, str]]:
    """Return the server's base URL (without /v1) and the request headers (the API key)."""
    base_url = config.base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    return base_url, headers


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """Parse ["ttft:500", "tpot:50"] (milliseconds) into {"ttft": 500.0, "tpot": 50.0}."""
    slos = {}
    for spec in specs or []:
        name, sep, value = spec.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"bad --goodput {spec!r}; use NAME:MS with NAME in {GOODPUT_METRICS}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"bad --goodput {spec!r}: {value!r} is not a number") from None
        if slos[name] <= 0:
            raise ValueError(f"bad --goodput {spec!r}: the limit must be positive")
    return slos


@dataclass
class RequestResult:
    """What one streamed request did, timed from the moment it was sent."""

    success: bool = False
    error: str | None = None
    status_code: int | None = None
    prompt_len: int = 0
    output_tokens: int = 0
    output_tokens_source: str = "usage"
    num_chunks: int = 0  # streamed chunks that carried output
    start_s: float = 0.0  # when it was sent, from the start of the run
    ttft_s: float | None = None
    e2el_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    generated_text: str = ""

    @property
    def tpot_s(self) -> float | None:
        """Return (e2e latency - TTFT) / (output tokens - 1), as vLLM defines TPOT."""
        if self.ttft_s is None or self.e2el_s is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


def _payload(config: ServeConfig, model: str, request: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": request.output_len, "stream": True}
    body["temperature"] = config.temperature
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    if config.stream_usage:
        body["stream_options"] = {"include_usage": True}
    if config.ignore_eos:
        body["ignore_eos"] = True
    body.update(config.extra_body)
    return body


def _chunk_text(choice: dict[str, Any], is_chat: bool) -> tuple[str, bool]:
    """Return (text, carries output) of one streamed choice; chat's role-only chunk carries none."""
    if not is_chat:
        return choice.get("text") or "", True
    delta = choice.get("delta") or {}
    text = delta.get("content") or ""
    is_role_only = bool(delta.get("role")) and not text and choice.get("finish_reason") is None
    return text, not is_role_only


def open_client(limit: int, timeout_s: float) -> aiohttp.ClientSession:
    """Return the HTTP client of a run: up to `limit` connections kept open."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit, limit_per_host=limit),
        # like httpx's Timeout(timeout_s): per read, not per request (a long stream is fine)
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=timeout_s),
    )


async def _sse_data(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """Yield the payload of each `data:` line of a server-sent event stream, any line length."""
    pending = b""
    async for piece in response.content.iter_any():
        pending += piece
        *lines, pending = pending.split(b"\n")
        for line in lines:
            line = line.strip()
            if line.startswith(b"data:"):
                yield line[5:].strip().decode()
    if pending.strip().startswith(b"data:"):
        yield pending.strip()[5:].strip().decode()


async def _send(
    client: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    body: dict[str, Any],
    request: BenchRequest,
    is_chat: bool,
    tokenizer: TokenizerLike | None,
    run_start: float,
) -> RequestResult:
    """Send one streaming request and time its chunks."""
    result = RequestResult(prompt_len=request.prompt_len)
    texts: list[str] = []
    usage: dict[str, Any] | None = None
    start = time.perf_counter()
    result.start_s = start - run_start
    last: float | None = None
    try:
        async with client.post(url, json=body, headers=headers) as response:
            result.status_code = response.status
            if response.status != 200:
                detail = (await response.read()).decode(errors="replace")
                result.error = f"HTTP {response.status}: {detail[:300]}"
                return result
            async for data in _sse_data(response):
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return result
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    text, carries_output = _chunk_text(choice, is_chat)
                    if not carries_output:
                        continue
                    now = time.perf_counter()
                    if result.ttft_s is None:
                        result.ttft_s = now - start
                    else:
                        assert last is not None
                        result.itl_s.append(now - last)
                    last = now
                    result.num_chunks += 1
                    texts.append(text)
        result.e2el_s = time.perf_counter() - start
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, OSError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.generated_text = "".join(texts)
    if usage is not None and usage.get("completion_tokens") is not None:
        result.output_tokens = int(usage["completion_tokens"])
        result.prompt_len = int(usage.get("prompt_tokens") or request.prompt_len)
    elif tokenizer is not None and result.generated_text:
        result.output_tokens = len(
            tokenizer.encode(result.generated_text, add_special_tokens=False)
        )
        result.output_tokens_source = "tokenizer"
    else:
        result.output_tokens = result.num_chunks
        result.output_tokens_source = "chunks"
    result.success = True
    return result


def arrival_offsets_s(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Return send times from the start: gamma inter-arrivals of mean 1/rate (Poisson at 1.0)."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    t, offsets = 0.0, []
    for _ in range(num):
        offsets.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return offsets


async def fetch_model_id(
    client: aiohttp.ClientSession, base_url: str, headers: dict[str, str]
) -> str:
    """Return the first model id the server lists at /v1/models."""
    async with client.get(f"{base_url}/v1/models", headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"GET {base_url}/v1/models answered {response.status}; pass --model")
        data = (await response.json()).get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])


async def run_serve_async(
    config: ServeConfig,
    requests: list[BenchRequest],
    tokenizer: TokenizerLike | None = None,
    use_tqdm: bool = True,
) -> dict[str, Any]:
    """Send every request on its arrival schedule; return metrics and per-request records."""
    base_url, headers = server_address(config)
    is_chat = config.endpoint == "chat"
    url = f"{base_url}/v1/chat/completions" if is_chat else f"{base_url}/v1/completions"
    limit = config.max_concurrency or len(requests)
    async with open_client(limit, config.timeout_s) as client:
        model = config.model or await fetch_model_id(client, base_url, headers)
        semaphore = asyncio.Semaphore(limit)
        offsets = arrival_offsets_s(
            len(requests), config.request_rate, config.burstiness, config.seed
        )
        bar = progress_bar(
            total=len(requests), desc="bench serve", disable=not use_tqdm, unit="req"
        )

        async def one(request: BenchRequest) -> RequestResult:
            async with semaphore:
                body = _payload(config, model, request)
                result = await _send(
                    client, url, headers, body, request, is_chat, tokenizer, run_start
                )
            bar.update(1)
            return result

        run_start = time.perf_counter()
        tasks = []
        for request, offset in zip(requests, offsets):
            delay = run_start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request)))
        results = await asyncio.gather(*tasks)
        duration_s = time.perf_counter() - run_start
        bar.close()
    metrics = serve_metrics(results, duration_s, config.goodput_slos_ms)
    return {
        "bench": "serve",
        "base_url": base_url,
        "endpoint": config.endpoint,
        "model": model,
        "config": {k: v for k, v in asdict(config).items() if k != "api_key"},
        "workload": workload_summary(requests),
        **metrics,
        "requests": [
            {
                "success": r.success,
                "error": r.error,
                "prompt_len": r.prompt_len,
                "output_tokens": r.output_tokens,
                "output_tokens_source": r.output_tokens_source,
                "num_chunks": r.num_chunks,
                "start_s": r.start_s,
                "ttft_s": r.ttft_s,
                "tpot_s": r.tpot_s,
                "e2el_s": r.e2el_s,
                "itl_s": r.itl_s,
            }
            for r in results
        ],
    }


def run_serve(
    config: ServeConfig,
    requests: list[BenchRequest],
    tokenizer: TokenizerLike | None = None,
    use_tqdm: bool = True,
) -> dict[str, Any]:
    """Run the load generator to completion (see run_serve_async)."""
    return asyncio.run(run_serve_async(config, requests, tokenizer, use_tqdm))


def serve_metrics(
    results: list[RequestResult], duration_s: float, slos_ms: dict[str, float]
) -> dict[str, Any]:
    """Return vLLM-style aggregate metrics of a serve run (latencies in seconds)."""
    ok = [r for r in results if r.success]
    num_in = sum(r.prompt_len for r in ok)
    num_out = sum(r.output_tokens for r in ok)
    metrics: dict[str, Any] = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:10],
        "total_input_tokens": num_in,
        "total_output_tokens": num_out,
        "output_tokens_sources": sorted({r.output_tokens_source for r in ok}),
        "request_throughput": len(ok) / duration_s,
        "output_throughput": num_out / duration_s,
        "total_token_throughput": (num_in + num_out) / duration_s,
    }
    metrics |= summarize([r.ttft_s for r in ok if r.ttft_s is not None], "ttft")
    metrics |= summarize([r.tpot_s for r in ok if r.tpot_s is not None], "tpot")
    metrics |= summarize([x for r in ok for x in r.itl_s], "itl")
    metrics |= summarize([r.e2el_s for r in ok if r.e2el_s is not None], "e2el")
    if slos_ms:
        good = sum(1 for r in ok if _meets(r, slos_ms))
        metrics["goodput_slos_ms"] = dict(slos_ms)
        metrics["num_good_requests"] = good
        metrics["request_goodput"] = good / duration_s
    return metrics


def _meets(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    """Return whether a request met every SLO (a missing value, e.g. TPOT of 1 token, passes)."""
    values = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2el": r.e2el_s}
    return all(values[k] is None or values[k] * 1e3 <= limit for k, limit in slos_ms.items())


def format_serve(r: dict[str, Any]) -> str:
    """Return a markdown report of run_serve's result."""
    c = r["config"]
    rate = "all at once" if math.isinf(c["request_rate"]) else f"{c['request_rate']:g} req/s"
    rows = [
        ["successful / failed requests", f"{r['completed']} / {r['failed']}"],
        ["duration", f"{r['duration_s']:.2f} s"],
        ["input / output tokens", f"{r['total_input_tokens']} / {r['total_output_tokens']}"],
        ["request throughput", f"{r['request_throughput']:.2f} req/s"],
        ["output token throughput", f"{r['output_throughput']:.1f} tok/s"],
        ["total token throughput", f"{r['total_token_throughput']:.1f} tok/s"],
    ]
    if "request_goodput" in r:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in r["goodput_slos_ms"].items())
        rows.append(
            [
                f"goodput ({slos})",
                f"{r['request_goodput']:.2f} req/s ({r['num_good_requests']} good)",
            ]
        )
    for name, label in (
        ("ttft", "TTFT"),
        ("tpot", "TPOT"),
        ("itl", "ITL"),
        ("e2el", "E2E latency"),
    ):
        values = " / ".join(fmt(r[f"{name}_{k}_s"], 1e3) for k in ("mean", "p50", "p99"))
        rows.append([f"{label} mean / median / p99", f"{values} ms"])
    head = (
        f"## infer8 bench serve: {r['model']} at {r['base_url']} ({r['endpoint']})\n\n"
        f"{r['workload']['num_requests']} requests, arrivals {rate}, max concurrency "
        f"{c['max_concurrency'] or 'unbounded'}, ignore_eos {c['ignore_eos']}; output tokens "
        f"counted from: {', '.join(r['output_tokens_sources']) or '-'}.\n\n"
    )
    errors = "".join(f"\n- {e}" for e in r["errors"])
    return (
        head
        + markdown_table(["metric", "value"], rows)
        + (f"\n\nErrors:{errors}" if errors else "")
    )
