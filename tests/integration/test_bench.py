"""The benchmark harness on a tiny model: load generator, capacity counts, compare's output."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from infer8.bench.capacity import run_capacity
from infer8.bench.serve import ServeConfig, run_serve
from infer8.bench.throughput import run_throughput
from infer8.bench.workload import BenchRequest, LengthSpec, make_requests
from infer8.cli import main
from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.entrypoints.openai.server import create_app
from infer8.utils import cdiv
from tests.utils import build_tiny_model

MODEL = "tiny-llama"


def _tiny_args(model_dir: Path, **changes: Any) -> EngineArgs:
    args: dict[str, Any] = dict(
        model=str(model_dir), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 20
    )
    args.update(changes)
    return EngineArgs(**args)


@pytest.fixture(scope="module")
def server(llama_dir: Path) -> Iterator[tuple[str, LLMEngine]]:
    """An infer8 server on 127.0.0.1 in this process."""
    engine = LLMEngine(_tiny_args(llama_dir, served_model_name=MODEL))
    with _serving(engine) as url:
        yield url, engine


@contextlib.contextmanager
def _serving(engine: LLMEngine) -> Iterator[str]:
    srv = uvicorn.Server(
        uvicorn.Config(create_app(engine), host="127.0.0.1", port=0, log_level="warning")
    )
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    port = srv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(20)


def _counter(url: str, name: str) -> float:
    """Return a Prometheus counter's value summed over its labels."""
    text = httpx.get(f"{url}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def _requests(engine: LLMEngine, num: int, output_len: str = "uniform:2:16") -> list[BenchRequest]:
    return make_requests(
        engine.tokenizer, num, LengthSpec.parse("8:40"), LengthSpec.parse(output_len), seed=3
    )


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_serve_counts_tokens_and_latencies_as_the_server_does(
    server: tuple[str, LLMEngine], endpoint: str
) -> None:
    url, engine = server
    requests = _requests(engine, 8)
    generated_before = _counter(url, "vllm:generation_tokens_total")
    config = ServeConfig(base_url=url, endpoint=endpoint, ignore_eos=True)
    r = run_serve(config, requests, engine.tokenizer, use_tqdm=False)
    assert (r["completed"], r["failed"], r["model"]) == (8, 0, MODEL)
    generated = _counter(url, "vllm:generation_tokens_total") - generated_before
    assert r["total_output_tokens"] == generated == sum(q.output_len for q in requests)
    for req, rec in zip(requests, r["requests"]):
        assert rec["output_tokens"] == req.output_len  # ignore_eos: exactly max_tokens
        assert rec["output_tokens_source"] == "usage"
        assert 0 < rec["ttft_s"] <= rec["e2el_s"]
        assert rec["num_chunks"] == rec["output_tokens"]  # infer8 streams a chunk per token
        assert len(rec["itl_s"]) == rec["num_chunks"] - 1
    if endpoint == "completions":  # the server tokenizes the same text the same way
        assert [rec["prompt_len"] for rec in r["requests"]] == [q.prompt_len for q in requests]
    assert r["total_input_tokens"] == sum(rec["prompt_len"] for rec in r["requests"])
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration_s"])
    assert r["ttft_p50_s"] <= r["e2el_p50_s"]


def test_serve_closed_loop_keeps_concurrency_bounded(server: tuple[str, LLMEngine]) -> None:
    url, engine = server
    r = run_serve(
        ServeConfig(base_url=url, model=MODEL, max_concurrency=2, ignore_eos=True),
        _requests(engine, 6),
        engine.tokenizer,
        use_tqdm=False,
    )
    assert r["completed"] == 6
    spans = [(q["start_s"], q["start_s"] + q["e2el_s"]) for q in r["requests"]]
    for start, _ in spans:  # at any send time, at most 2 requests are in flight
        assert sum(1 for s, e in spans if s <= start < e) <= 2


def test_serve_poisson_arrivals_goodput_and_usage_fallback(server: tuple[str, LLMEngine]) -> None:
    url, engine = server
    config = ServeConfig(
        base_url=url,
        request_rate=40.0,
        seed=1,
        ignore_eos=True,
        stream_usage=False,
        goodput_slos_ms={"ttft": 60_000.0, "e2el": 60_000.0},
    )
    r = run_serve(config, _requests(engine, 5), engine.tokenizer, use_tqdm=False)
    assert r["completed"] == 5 and r["num_good_requests"] == 5
    starts = [q["start_s"] for q in r["requests"]]
    assert starts == sorted(starts) and starts[-1] > 0.0  # spread out, not all at once
    assert set(r["output_tokens_sources"]) <= {"tokenizer", "chunks"}  # no usage was asked for
    strict = ServeConfig(base_url=url, ignore_eos=True, goodput_slos_ms={"ttft": 1e-6})
    r = run_serve(strict, _requests(engine, 2), engine.tokenizer, use_tqdm=False)
    assert r["num_good_requests"] == 0 and r["request_goodput"] == 0.0


def test_serve_counts_rejected_and_unreachable_requests_as_failed(
    server: tuple[str, LLMEngine],
) -> None:
    url, engine = server
    requests = _requests(engine, 3)
    too_long = BenchRequest(requests[0].prompt_token_ids, requests[0].prompt, 100_000)
    r = run_serve(ServeConfig(base_url=url), [*requests, too_long], use_tqdm=False)
    assert (r["completed"], r["failed"]) == (3, 1)
    assert not r["requests"][-1]["success"] and "HTTP 400" in r["errors"][0]
    assert r["total_output_tokens"] == sum(q["output_tokens"] for q in r["requests"][:3])
    # port 9 (discard): nothing listens, so every connection is refused
    dead = ServeConfig(base_url="http://127.0.0.1:9", model=MODEL, timeout_s=5.0)
    r = run_serve(dead, requests[:2], use_tqdm=False)
    assert (r["completed"], r["failed"]) == (0, 2) and "Cannot connect" in r["errors"][0]


@pytest.fixture(scope="module")
def capacity(llama_dir: Path) -> dict[str, Any]:
    return run_capacity(
        _tiny_args(llama_dir),
        context_len=100,
        prompt_len=40,
        max_tokens=200,
        kv_cache_dtypes=("bfloat16", "fp8_e4m3"),
    )


def test_capacity_counts_match_the_block_arithmetic(capacity: dict[str, Any]) -> None:
    groups = {(g["scheduler"], g["kv_cache_dtype"]): g for g in capacity["groups"]}
    assert len(groups) == 4
    budget = capacity["kv_cache_memory_bytes"]
    for (sched, _), g in groups.items():
        bs = g["block_size"]
        # an FP8 cache's exact-tail rings (one per seat) come out of the budget first
        kv_budget = budget - g["kv_exact_tail_bytes"]
        assert g["num_kv_blocks"] == kv_budget // (g["kv_bytes_per_token"] * bs)
        session_tokens = 100 if sched == "continuous" else 40 + 200  # static reserves the cap
        assert g["blocks_per_session"] == cdiv(session_tokens, bs)
        assert g["max_concurrent_sessions"] == g["num_kv_blocks"] // g["blocks_per_session"]
        assert g["matches_block_arithmetic"] and not g["is_saturated"]
        assert g["num_offered"] > g["max_concurrent_sessions"] >= 1
    for sched in ("static", "continuous"):
        wide, fp8 = groups[(sched, "bfloat16")], groups[(sched, "fp8_e4m3")]
        bytes_ratio = wide["kv_bytes_per_token"] / fp8["kv_bytes_per_token"]
        bytes_ratio *= (budget - fp8["kv_exact_tail_bytes"]) / budget
        sessions_ratio = fp8["max_concurrent_sessions"] / wide["max_concurrent_sessions"]
        # equal up to whole blocks and whole sessions
        assert sessions_ratio == pytest.approx(bytes_ratio, rel=1 / wide["max_concurrent_sessions"])
    assert (
        groups[("continuous", "bfloat16")]["max_concurrent_sessions"]
        > groups[("static", "bfloat16")]["max_concurrent_sessions"]
    )


def test_throughput_reports_step_stats_and_stops_at_each_output_length(llama_dir: Path) -> None:
    r = run_throughput(
        _tiny_args(llama_dir, scheduler="static", max_num_seqs=4),
        num_requests=6,
        input_len=LengthSpec.parse("4:20"),
        output_len=LengthSpec.parse("uniform:1:12"),
        max_tokens=16,
        peak_matmul_size=64,
        use_tqdm=False,
    )
    assert r["output_tokens"] == r["workload"]["output_tokens_total"]
    assert [q["output_len"] for q in r["requests"]] != [16] * 6
    assert r["num_padded_tokens"] > 0 and 0 < r["padding_waste_pct"] < 100
    assert r["max_batch_size"] <= 4 and r["mean_batch_size"] > 0
    assert r["num_preemptions"] == 0 and r["num_steps"] == len(r["timeline"]["time_s"])
    assert r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / r["elapsed_s"])
    assert 0 < r["compute_utilization_pct"] < 100


def test_compare_writes_four_groups_markdown_and_plots(llama_dir: Path, tmp_path: Path) -> None:
    json_path, md_path, plot_dir = tmp_path / "c.json", tmp_path / "c.md", tmp_path / "plots"
    # fmt: off
    argv = [
        "bench", "compare", str(llama_dir), "--dtype", "float32", "--enforce-eager",
        "--kv-cache-memory-bytes", str(300_000), "--num-requests", "6", "--input-len", "12",
        "--output-len", "uniform:2:14", "--eval-tokens", "32", "--peak-matmul-size", "64",
        "--hf-baseline", "--hf-batch-size", "3", "--disable-tqdm",
        "--json", str(json_path), "--markdown", str(md_path), "--plot-dir", str(plot_dir),
    ]
    # fmt: on
    assert main(argv) == 0
    r = json.loads(json_path.read_text())
    groups = r["groups"]
    assert [(g["scheduler"], g["kv_cache_dtype"]) for g in groups] == [
        ("static", "bfloat16"),
        ("continuous", "bfloat16"),
        ("static", "fp8_e4m3"),
        ("continuous", "fp8_e4m3"),
    ]
    required = (
        "max_concurrent_sessions",
        "output_tokens_per_s",
        "padding_waste_pct",
        "compute_utilization_pct",
        "ttft_p50_s",
        "tpot_p50_s",
    )
    useful = r["workload"]["output_tokens_total"]
    for g in groups:
        assert all(isinstance(g[k], (int, float)) for k in required), g
        assert g["output_tokens"] == useful  # every group generated the same requests
        assert g["max_concurrent_sessions"] == g["capacity"]["expected_sessions"]
        assert (g["padding_waste_pct"] > 0) == (g["scheduler"] == "static")
    assert groups[2]["accuracy_delta_pct"] is not None  # fp8 vs the model's fp32 cache
    assert groups[0]["accuracy_delta_pct"] is None  # a bf16 cache is not the fp32 reference
    assert r["hf_baseline"]["output_tokens_per_s"] > 0
    assert r["hf_baseline"]["output_tokens"] == useful
    markdown = md_path.read_text()
    assert markdown.count("| infer8 ") == 4 and "| HF transformers generate, batch 3 |" in markdown
    pngs = sorted(p.name for p in plot_dir.glob("*.png"))
    assert len(pngs) == 6 and all((plot_dir / p).stat().st_size > 1000 for p in pngs)


def test_sessions_at_slo_finds_the_largest_level_within_the_limits(
    server: tuple[str, LLMEngine],
) -> None:
    from infer8.bench.sessions import SessionSLO, find_max_sessions, format_sessions

    url, engine = server
    short = dict(
        num_turns=3, first_len=LengthSpec.parse("8:20"), turn_len=LengthSpec.parse("4:10"),
        output_len=LengthSpec.parse("4:12"), think_time_s=0.05, warmup_s=0.3, window_s=2.0,
        max_sessions=4, max_probes=3,
    )  # fmt: skip
    config = ServeConfig(base_url=url, endpoint="chat", ignore_eos=True)
    loose = find_max_sessions(config, SessionSLO(60_000, 60_000, **short), engine.tokenizer, False)
    # 1, 2, 4 sessions all pass: the search stops at max_sessions
    assert [lv["num_sessions"] for lv in loose["levels"]] == [1, 2, 4]
    assert loose["max_sessions_within_slo"] == 4 and loose["search_settled"]
    for level in loose["levels"]:
        assert level["passed"] and level["num_failed"] == 0 and level["num_requests"] > 0
        assert 0 < level["ttft_p99_s"] < 60 and level["output_tokens_per_s"] > 0
    strict = find_max_sessions(config, SessionSLO(0.001, 60_000, **short), engine.tokenizer, False)
    assert strict["max_sessions_within_slo"] == 0 and len(strict["levels"]) == 1
    assert "**0 concurrent chat sessions**" in format_sessions(strict)
    assert "| 4 | pass |" in format_sessions(loose)
    assert loose["slo"]["turn_len"] == "uniform:4:10"  # spec strings, as the flags take them


class _VirtualClock:
    """A clock that moves only when a token chunk arrives, by a scripted step: two clients that
    read the same stream on it see the same times, whatever the machine's load."""

    def __init__(self) -> None:
        self.now_s = 0.0
        self.num_chunks = 0

    def perf_counter(self) -> float:
        return self.now_s

    def chunk_arrived(self) -> None:
        # the first token after a prefill, then uneven gaps (averaging per token matters)
        self.now_s += 0.25 if self.num_chunks == 0 else (0.01, 0.03, 0.02)[self.num_chunks % 3]
        self.num_chunks += 1

    def restart(self) -> None:
        self.num_chunks = 0


def test_serve_latencies_follow_the_official_openai_clients_definitions(
    server: tuple[str, LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench serve's TTFT and TPOT against a plain loop over the openai client timed the way
    vLLM's bench defines them, on the same streams and one virtual clock (exact agreement)."""
    import types

    import openai

    from infer8.bench import serve as serve_module

    url, engine = server
    clock = _VirtualClock()
    sse_data = serve_module._sse_data

    async def timed_sse_data(response):  # type: ignore[no-untyped-def]
        clock.restart()
        async for data in sse_data(response):
            if data != "[DONE]" and json.loads(data).get("choices"):
                clock.chunk_arrived()
            yield data

    monkeypatch.setattr(serve_module, "_sse_data", timed_sse_data)
    monkeypatch.setattr(
        serve_module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter)
    )
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0)

    def official(request: BenchRequest) -> tuple[float, float]:
        clock.restart()
        start, first = clock.perf_counter(), None
        stream = client.completions.create(
            model=MODEL, prompt=request.prompt, max_tokens=request.output_len,
            temperature=0.0, stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        for chunk in stream:
            if chunk.choices:
                clock.chunk_arrived()
            # vLLM's rule: the first chunk with a choice, even with empty text (a token that
            # ends inside a UTF-8 character decodes to nothing yet)
            if chunk.choices and first is None:
                first = clock.perf_counter() - start
        end = clock.perf_counter() - start
        assert first is not None
        return first, (end - first) / (request.output_len - 1)

    config = ServeConfig(base_url=url, model=MODEL, max_concurrency=1, ignore_eos=True)
    for request in _requests(engine, 4, output_len="12"):
        r = run_serve(config, [request], engine.tokenizer, use_tqdm=False)
        assert r["completed"] == 1
        ours = (r["requests"][0]["ttft_s"], r["requests"][0]["tpot_s"])
        theirs = official(request)
        assert ours == pytest.approx(theirs, rel=1e-9), (ours, theirs)
        assert ours[0] == pytest.approx(0.25)  # a token after the prefill, not the request


@pytest.mark.slow
def test_suite_runs_every_workload_against_its_matmul_roofline(
    llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "suite.json"
    argv = ["bench", "suite", str(llama_dir), "--dtype", "float32", "--scale", "0.1"]
    argv += ["--kv-cache-memory-bytes", str(4 << 20), "--max-num-seqs", "8"]
    argv += ["--online-concurrency", "4", "--repeats", "2", "--disable-tqdm", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    rows = {r["workload"]: r for r in result["rows"]}
    assert list(rows) == ["W1", "W2", "W3", "online c=4"]
    assert rows["W3"]["num_requests"] == 3 and rows["W1"]["num_requests"] == 6
    for name in ("W1", "W2", "W3"):
        r = rows[name]
        assert 0 < r["matmul_only_s"] < r["elapsed_s"] * 2 and r["output_tokens_per_s"] > 0
        assert r["matmul_share"] == pytest.approx(r["matmul_only_s"] / r["elapsed_s"])
    online = rows["online c=4"]
    assert online["failed"] == 0 and online["num_requests"] == 6
    assert online["vs_offline"] == pytest.approx(
        online["output_tokens_per_s"] / rows["W1"]["output_tokens_per_s"]
    )
    # --repeats 2: the first pair is the table's rows, the second a fresh offline/online pair
    pairs = result["online_vs_offline_pairs"]
    assert len(pairs) == 2 and pairs[0]["ratio"] == pytest.approx(online["vs_offline"])
    assert all(
        p["ratio"] == pytest.approx(p["online_tokens_per_s"] / p["offline_tokens_per_s"])
        for p in pairs
    )
    assert result["online_vs_offline_median"] == pytest.approx(
        (pairs[0]["ratio"] + pairs[1]["ratio"]) / 2
    )


def test_spec_decode_bench_reports_each_method_against_none(tmp_path: Path) -> None:
    from infer8.bench.spec_decode import format_spec_decode, run_spec_decode_bench

    # the grounded chats run to ~1,200 tokens under the tiny byte-level tokenizer
    model_dir = build_tiny_model(tmp_path / "llama", max_position_embeddings=2048)
    r = run_spec_decode_bench(
        _tiny_args(model_dir, kv_cache_memory_bytes=1 << 24), ("none", "ngram"), num_prompts=3, max_tokens=24, w1_requests=4,
        use_tqdm=False,
    )  # fmt: skip
    none, ngram = r["rows"]
    assert none["grounded_speedup"] == 1.0 and none["grounded"]["num_drafts"] == 0
    assert ngram["grounded"]["num_draft_tokens"] > 0  # the grounded prompts get drafts
    assert 0 <= ngram["grounded"]["acceptance_rate"] <= 1
    assert ngram["num_same_outputs"] == 3  # float32: the same greedy tokens
    assert ngram["w1_output_tok_s"] > 0 and ngram["w1_ratio"] > 0
    table = format_spec_decode(r)
    assert "| ngram |" in table and "3/3" in table


def test_grounded_requests_are_chat_template_text_any_server_tokenizes_alike(
    llama_dir: Path,
) -> None:
    from infer8.bench.spec_decode import grounded_conversations, grounded_requests
    from infer8.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(llama_dir)
    requests = grounded_requests(tokenizer, 4, 64)
    assert len(requests) == 4 and all(r.output_len == 64 for r in requests)
    for r, conv in zip(requests, grounded_conversations(4)):
        assert r.prompt_token_ids == tokenizer.encode_chat(conv)
        assert conv[-1]["content"][:40] in r.prompt  # the task's text, in the template
    assert any("```python" in r.prompt for r in requests)  # code to copy
