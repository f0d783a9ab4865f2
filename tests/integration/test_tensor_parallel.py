"""Tensor parallelism on CPU with gloo, 2 processes: TP=2 computes what TP=1 computes.

Each TP=2 engine spawns one worker process (the cost of these tests), so engines are built once
per case and torch runs one thread per process.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import uvicorn

from infer8 import LLM, SamplingParams
from infer8.attention.exact_tail import DEFAULT_EXACT_SINK_TOKENS, DEFAULT_EXACT_TAIL_TOKENS
from infer8.core.sched_output import SchedulerStats
from infer8.distributed.parallel_state import TensorParallelGroup
from infer8.engine import LLMEngine
from infer8.entrypoints.openai.cli_args import ServerConfig, make_serve_parser, serve_args_from
from infer8.entrypoints.openai.server import create_app
from infer8.models.loader import load_model
from tests.utils import build_tiny_model

PROMPTS = [
    [5, 6, 7, 8, 9, 10],
    [11, 12, 13],
    list(range(20, 77)),  # longer than the token budget: prefilled in chunks
    [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311],
    [42],
    list(range(100, 131)),
]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
NUM_BLOCKS, BLOCK_SIZE, NUM_LAYERS, HEAD_DIM = 12, 8, 2, 16
# (architecture, attention heads, KV heads): KV heads split 2 / 2, and one KV head replicated.
CASES = {
    "llama-4kv": ("llama", 8, 4),
    "qwen2-4kv": ("qwen2", 8, 4),
    "qwen2-1kv": ("qwen2", 4, 1),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_process() -> Iterator[None]:
    # The workers take the engine process's thread count: 2 processes on a 2-core machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for case, (arch, num_heads, num_kv_heads) in CASES.items():
        dirs[case] = build_tiny_model(
            tmp_path_factory.mktemp(case),
            arch,
            hidden_size=num_heads * HEAD_DIM,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
        )
    return dirs


@dataclass
class Run:
    token_ids: list[list[int]]
    logits: list[torch.Tensor]  # every step's sampled rows, recorded on rank 0
    num_preemptions: int


def _engine_kwargs(num_kv_heads: int, tp: int, kv_cache_dtype: str = "auto") -> dict[str, Any]:
    # The same number of blocks at every TP size, so both runs schedule (and preempt) alike.
    bytes_per_elem = 1 if kv_cache_dtype.startswith("fp8") else 4
    heads_per_rank = max(1, num_kv_heads // tp)
    per_token = NUM_LAYERS * 2 * heads_per_rank * HEAD_DIM * bytes_per_elem
    tail_bytes = 0
    if bytes_per_elem == 1:
        per_token += NUM_LAYERS * 2 * heads_per_rank * 2  # bf16 scale per token and head
        # the default exact tail: 6 seats x (W - 1 + S) residual tokens per rank, each an FP8
        # token's bytes, before the blocks
        store_tokens = DEFAULT_EXACT_TAIL_TOKENS - 1 + DEFAULT_EXACT_SINK_TOKENS
        tail_bytes = 6 * store_tokens * per_token
    return dict(
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_num_seqs=6,
        max_num_batched_tokens=24,
        max_model_len=96,
        kv_cache_memory_bytes=NUM_BLOCKS * BLOCK_SIZE * per_token + tail_bytes,
        kv_cache_dtype=kv_cache_dtype,
        tensor_parallel_size=tp,
    )


def _run(
    model_dir: Path,
    num_kv_heads: int,
    tp: int,
    kv_cache_dtype: str = "auto",
    quantization: str | None = None,
    speculative_config: str | None = None,
) -> Run:
    kwargs = _engine_kwargs(num_kv_heads, tp, kv_cache_dtype)
    llm = LLM(str(model_dir), quantization=quantization, speculative_config=speculative_config,
              **kwargs)  # fmt: skip
    engine = llm.engine
    try:
        assert engine.num_blocks == NUM_BLOCKS
        logits: list[torch.Tensor] = []
        compute_logits = engine.worker.model.compute_logits

        def record(hidden: torch.Tensor) -> torch.Tensor:
            out = compute_logits(hidden)
            logits.append(out.clone())
            return out

        engine.worker.model.compute_logits = record  # type: ignore[method-assign]
        stats: list[SchedulerStats] = []
        engine.stat_loggers.append(stats.append)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert engine.kv_cache_manager.num_free_blocks == NUM_BLOCKS
        return Run(
            [o.outputs[0].token_ids for o in outs],
            logits,
            sum(s.num_preemptions for s in stats),
        )
    finally:
        if engine.executor is not None:
            engine.executor.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_tp2_logits_and_greedy_match_tp1_with_chunking_and_preemption(
    case: str, model_dirs: dict[str, Path]
) -> None:
    num_kv_heads = CASES[case][2]
    single = _run(model_dirs[case], num_kv_heads, tp=1)
    split = _run(model_dirs[case], num_kv_heads, tp=2)
    assert single.num_preemptions > 0 and split.num_preemptions == single.num_preemptions
    assert split.token_ids == single.token_ids
    assert len(split.logits) == len(single.logits)
    for step, (ours, ref) in enumerate(zip(split.logits, single.logits)):
        assert ours.shape == ref.shape
        err = (ours - ref).abs().max().item()
        assert err < 1e-4, f"step {step}: max abs logits error {err}"


@pytest.mark.slow
def test_tp2_fp8_cache_matches_tp1_fp8_cache(model_dirs: dict[str, Path]) -> None:
    single = _run(model_dirs["qwen2-4kv"], 4, tp=1, kv_cache_dtype="fp8_e4m3")
    split = _run(model_dirs["qwen2-4kv"], 4, tp=2, kv_cache_dtype="fp8_e4m3")
    assert single.num_preemptions > 0
    assert split.token_ids == single.token_ids
    # Each rank quantizes its own KV heads with its own per-token scales: the same values.
    err = max((a - b).abs().max().item() for a, b in zip(split.logits, single.logits))
    assert err < 1e-3


@pytest.mark.slow
def test_tp2_with_drafts_gives_tp1s_tokens(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drafts verified on rank 0, rejected ones taken out of every rank's tail ring."""
    from infer8.spec_decode.speculator import StepCostModel

    monkeypatch.setattr(StepCostModel, "observe", lambda *args: None)  # drafts always
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    single = _run(model_dirs["qwen2-4kv"], 4, tp=1, kv_cache_dtype="fp8_e4m3")
    split = _run(model_dirs["qwen2-4kv"], 4, tp=2, kv_cache_dtype="fp8_e4m3",
                 speculative_config=spec)  # fmt: skip
    assert split.token_ids == single.token_ids
    assert len(split.logits) < len(single.logits)  # fewer steps: drafts were accepted


@pytest.mark.slow
def test_tp2_fp8_weights_match_tp1_fp8_weights(model_dirs: dict[str, Path]) -> None:
    # Row-parallel shards take their per-channel scales over every rank: the same weights.
    single = _run(model_dirs["llama-4kv"], 4, tp=1, quantization="fp8")
    split = _run(model_dirs["llama-4kv"], 4, tp=2, quantization="fp8")
    assert split.token_ids == single.token_ids
    err = max((a - b).abs().max().item() for a, b in zip(split.logits, single.logits))
    assert err < 1e-4


def test_head_count_that_does_not_divide_is_refused_before_starting(tmp_path: Path) -> None:
    model_dir = build_tiny_model(
        tmp_path / "m", "llama", hidden_size=48, num_attention_heads=3, num_key_value_heads=1
    )
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=r"does not divide the model's 3 attention heads"):
        LLM(str(model_dir), dtype="float32", tensor_parallel_size=2)
    assert set(multiprocessing.active_children()) == before  # refused before any spawn


def _stub_group(rank: int, world_size: int) -> TensorParallelGroup:
    """A group to load one rank's shard in this process (loading runs no collective)."""
    return TensorParallelGroup(rank, world_size, None, None, lambda: None)  # type: ignore[arg-type]


def _param_bytes(model: torch.nn.Module, replicated: bool) -> int:
    """Return the bytes of the norm weights (replicated) or of every other weight (sharded)."""
    return sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if ("norm" in name) == replicated
    )


def test_each_rank_holds_half_of_the_sharded_weights(model_dirs: dict[str, Path]) -> None:
    model_dir = str(model_dirs["llama-4kv"])
    full, _, _ = load_model(model_dir, torch.float32, torch.device("cpu"))
    for rank in (0, 1):
        shard, _, _ = load_model(
            model_dir, torch.float32, torch.device("cpu"), _stub_group(rank, 2)
        )
        assert 2 * _param_bytes(shard, replicated=False) == _param_bytes(full, replicated=False)
        assert _param_bytes(shard, replicated=True) == _param_bytes(full, replicated=True)
        layer = shard.layers[0]
        # 4 of the 8 query heads and 2 of the 4 KV heads, for K and for V
        assert layer.self_attn.qkv_proj.weight.shape == ((4 + 2 * 2) * HEAD_DIM, 8 * HEAD_DIM)
        assert layer.self_attn.num_heads == 4 and layer.self_attn.num_kv_heads == 2
        assert shard.embed_tokens.weight.shape[0] == full.embed_tokens.weight.shape[0] // 2
        # the rank's slice of the checkpoint: its query heads' rows, its MLP columns
        rows = slice(rank * 4 * HEAD_DIM, (rank + 1) * 4 * HEAD_DIM)
        full_q = full.layers[0].self_attn.qkv_proj.weight[: 8 * HEAD_DIM]
        assert torch.equal(layer.self_attn.qkv_proj.weight[: 4 * HEAD_DIM], full_q[rows])
        cols = slice(rank * 64, (rank + 1) * 64)
        assert torch.equal(layer.mlp.down_proj.weight, full.layers[0].mlp.down_proj.weight[:, cols])


def test_worker_death_between_steps_is_reported_by_health_and_the_next_step(
    model_dirs: dict[str, Path],
) -> None:
    llm = LLM(str(model_dirs["qwen2-1kv"]), **_engine_kwargs(1, tp=2))
    engine = llm.engine
    assert engine.executor is not None
    try:
        assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert engine.is_healthy()
        (worker,) = engine.executor.workers
        assert worker.process is not None and worker.process.pid is not None
        os.kill(worker.process.pid, signal.SIGKILL)
        killed = time.monotonic()
        while engine.is_healthy():  # noticed while idle, without a step
            assert time.monotonic() - killed < 5.0, "still healthy 5 s after a worker died"
            time.sleep(0.01)
        with pytest.raises(
            RuntimeError, match=r"worker rank 1 died \(exit code -9, killed by SIGKILL"
        ):
            llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    finally:
        engine.executor.shutdown()


# -- the server, and a worker's death ------------------------------------------------------------
MODEL = "tiny-tp"


@dataclass
class RunningServer:
    url: str
    engine: LLMEngine
    server: uvicorn.Server
    thread: threading.Thread


@pytest.fixture(scope="module")
def tp_server(model_dirs: dict[str, Path]) -> Iterator[RunningServer]:
    ns = make_serve_parser().parse_args(
        [
            str(model_dirs["llama-4kv"]),
            "--tensor-parallel-size",
            "2",
            "--dtype",
            "float32",
            "--kv-cache-memory-bytes",
            str(4 << 20),
            "--served-model-name",
            MODEL,
        ]
    )
    engine_args, _ = serve_args_from(ns)
    assert engine_args.tensor_parallel_size == 2
    engine = LLMEngine(engine_args)
    app = create_app(engine, ServerConfig(host="127.0.0.1", port=0))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield RunningServer(f"http://127.0.0.1:{port}", engine, server, thread)
    server.should_exit = True
    thread.join(20)
    assert engine.executor is not None
    engine.executor.shutdown()


def test_server_with_tensor_parallel_size_2_answers_a_chat(tp_server: RunningServer) -> None:
    client = openai.OpenAI(base_url=f"{tp_server.url}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Paris is the capital of"}],
        max_tokens=8,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    assert reply.choices[0].finish_reason == "length"
    assert httpx.get(f"{tp_server.url}/health").status_code == 200


def test_killing_a_worker_mid_run_makes_the_server_unhealthy_within_seconds(
    tp_server: RunningServer,
) -> None:
    executor = tp_server.engine.executor
    assert executor is not None
    (worker,) = executor.workers
    assert worker.process is not None and worker.process.pid is not None
    responses: list[httpx.Response] = []
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 500, "ignore_eos": True}
    request = threading.Thread(
        target=lambda: responses.append(
            httpx.post(f"{tp_server.url}/v1/completions", json=body, timeout=60)
        )
    )
    request.start()
    deadline = time.monotonic() + 20
    while tp_server.engine.last_stats.num_running == 0:  # the request is running
        assert not responses, responses[0].text
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)
    os.kill(worker.process.pid, signal.SIGKILL)
    killed = time.monotonic()
    while httpx.get(f"{tp_server.url}/health").status_code != 503:
        assert time.monotonic() - killed < 5.0, "still healthy 5 s after a worker died"
        time.sleep(0.05)
    request.join(10)
    (response,) = responses
    assert response.status_code == 503
    message = response.json()["error"]["message"]
    assert "tensor-parallel worker rank 1 died" in message and "SIGKILL" in message
    new = httpx.post(f"{tp_server.url}/v1/completions", json=body, timeout=10)
    assert new.status_code == 503  # refused at once, not hung


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_launched_ranks_serve_with_rank_0_as_the_server(
    model_dirs: dict[str, Path],
) -> None:
    port = _free_port()
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "infer8.entrypoints.openai.api_server",
        f"--model={model_dirs['qwen2-4kv']}",
        "--tensor-parallel-size=2",
        "--dtype=float32",
        f"--kv-cache-memory-bytes={4 << 20}",
        f"--served-model-name={MODEL}",
        f"--port={port}",
    ]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the launched server did not come up"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0.0}
        reply = httpx.post(f"{url}/v1/completions", json={**body, "ignore_eos": True}, timeout=30)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 6
        proc.send_signal(signal.SIGTERM)  # torchrun passes it on; rank 0 drains, then stops rank 1
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_tp2_from_a_script_on_stdin_without_a_main_guard(model_dirs: dict[str, Path]) -> None:
    # Ranks are their own processes of the package: nothing re-imports the user's script.
    kwargs = _engine_kwargs(4, tp=2)
    script = (
        "import torch\n"
        "torch.set_num_threads(1)\n"
        "from infer8 import LLM, SamplingParams\n"
        f"llm = LLM({str(model_dirs['llama-4kv'])!r}, **{kwargs!r})\n"
        "out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0,"
        " ignore_eos=True), use_tqdm=False)\n"
        "print('TOKENS', out[0].outputs[0].token_ids)\n"
        "llm.engine.executor.shutdown()\n"
    )
    result = subprocess.run(
        [sys.executable, "-"],
        input=script,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FileNotFoundError" not in result.stderr
    tokens = [line for line in result.stdout.splitlines() if line.startswith("TOKENS")]
    assert len(tokens) == 1 and len(eval(tokens[0].removeprefix("TOKENS "))) == 4


def test_the_worker_runs_a_hand_built_scheduler_output_alone(model_dirs: dict[str, Path]) -> None:
    # The device side is reachable through plain data only: no engine, no scheduler.
    from infer8.config import EngineArgs
    from infer8.core.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
    from infer8.worker.worker import Worker

    model_dir = str(model_dirs["llama-4kv"])
    args = EngineArgs(model=model_dir, **{**_engine_kwargs(4, tp=1), "device": "cpu"})
    worker = Worker.from_args(args, model_dir)
    assert worker.num_blocks == NUM_BLOCKS and worker.is_driver
    prompt = [5, 6, 7, 8, 9, 10]
    first = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", prompt, GREEDY, [2])],
        scheduled=[ScheduledRequest("a", 0, len(prompt), [0])],
    )
    token = worker.execute_model(first).sampled_token_ids["a"]
    # the next step carries that token to the runner, as it does to every rank under TP
    second = SchedulerOutput(
        scheduled=[ScheduledRequest("a", len(prompt), 1, [])], new_token_ids={"a": [token]}
    )
    token2 = worker.execute_model(second).sampled_token_ids["a"]
    assert worker.runner.states["a"].output_token_ids == [token]
    # the same two tokens as the engine's greedy run of the same prompt
    llm = LLM(model_dir, **_engine_kwargs(4, tp=1))
    expected = llm.generate(
        [prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    assert [token, token2] == expected[0].outputs[0].token_ids


def test_the_executor_and_workers_never_import_the_engine() -> None:
    code = (
        "import sys, infer8.executor, infer8.executor.tensor_parallel, infer8.executor.rank\n"
        "print('infer8.engine' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
