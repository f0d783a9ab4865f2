"""The same request gives the same answer: outputs that do not depend on the prefix cache, the
batch, the chunking, preemption or the host tier, for every cache dtype and FP8 option.

One request (TARGET) is served (a) alone, (b) again after its prefix was cached, (c) in a batch
with other requests, (d) chunked at 16, 64 and 512 tokens, (e) preempted and recomputed, (f)
with its prefix evicted to the host tier and loaded back. Its greedy tokens must be the same
and its top-5 logprobs equal within LOGPROB_TOL.

LOGPROB_TOL: float32 compute, so the paths differ only in summation order (other matmul shapes
for other batch and chunk sizes: relative differences of ~1e-7 per product, over a 2-layer
model with logits of magnitude < 10, give < 1e-5). 1e-4 leaves room for that and for an FP8
rounding that a 1e-7 difference tips over, yet is far below what a definition that depends on
the path gives: reading one window of 24 positions quantized instead of exactly moves these
logprobs by > 1e-3 (the last test shows it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from infer8 import LLM, SamplingParams
from infer8.config import EngineArgs
from infer8.core.sched_output import SchedulerStats
from infer8.engine import LLMEngine
from infer8.entrypoints.openai.cli_args import ServerConfig
from infer8.quant import kv_scales
from infer8.request import Request
from infer8.worker.memory import GiB
from tests.utils import start_server, stop_server

LOGPROB_TOL = 1e-4
README_QUESTION = {
    "role": "user",
    "content": "What is the capital of France? Answer in one sentence.",
}
TARGET = [50 + (37 * i + 11) % 400 for i in range(100)]  # 12 full blocks of 8 and 4 tokens
OTHERS = [[60 + (13 * i + 7 * k) % 380 for i in range(40 + 20 * k)] for k in range(3)]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)

VARIANTS = {
    "float32": dict(kv_cache_dtype="auto"),
    "bfloat16": dict(kv_cache_dtype="bfloat16"),
    "fp8_e4m3": dict(kv_cache_dtype="fp8_e4m3"),  # the defaults: tail 24, sinks 4, rotation
    "fp8_e5m2": dict(kv_cache_dtype="fp8_e5m2"),
    "fp8_e4m3 no rotation": dict(kv_cache_dtype="fp8_e4m3", kv_cache_hadamard=False),
    "fp8_e4m3 no tail": dict(
        kv_cache_dtype="fp8_e4m3", kv_cache_exact_tail_tokens=0, kv_cache_hadamard=False
    ),
    "fp8_e4m3 tail 8, no sinks": dict(
        kv_cache_dtype="fp8_e4m3", kv_cache_exact_tail_tokens=8, kv_cache_exact_sink_tokens=0
    ),
    # static per-layer scales (scales_path: an amax of 8 for every K and V channel), tail on
    "fp8_e4m3 static scales": dict(kv_cache_dtype="fp8_e4m3", kv_scale="static"),
}

Answer = tuple[list[int], list[dict[int, float]]]


@pytest.fixture(scope="module")
def scales_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The static variant's scales: an amax of 8 for the tiny Llama's 2 layers x 2 x 16."""
    amax = [torch.full((2, 16), 8.0) for _ in range(2)]
    path = tmp_path_factory.mktemp("scales") / "scales.json"
    kv_scales.save_calibration(path, amax, amax, "layer", model="tiny", num_tokens=0)
    return path


def _llm(model_dir: Path, variant: str, scales: Path | None = None, **kwargs: Any) -> LLM:
    options: dict[str, Any] = dict(
        dtype="float32", block_size=8, max_model_len=160, max_num_seqs=4,
        kv_cache_memory_bytes=1 << 22, **VARIANTS[variant],
    )  # fmt: skip
    if options.get("kv_scale") == "static":
        options["kv_scales_path"] = str(scales)
    options.update(kwargs)
    return LLM(str(model_dir), **options)


def _answers(llm: LLM, prompts: list[list[int]]) -> list[Answer]:
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    answers = []
    for out in outs:
        completion = out.outputs[0]
        logprobs = completion.logprobs or []
        answers.append((list(completion.token_ids), [dict(lp) for lp in logprobs]))
    return answers


def _assert_same(got: Answer, want: Answer, what: str) -> None:
    assert got[0] == want[0], f"{what}: other tokens"
    for i, (g, w) in enumerate(zip(got[1], want[1], strict=True)):
        assert g.keys() == w.keys(), f"{what}: other top-5 at step {i}"
        err = max(abs(g[t] - w[t]) for t in w)
        assert err < LOGPROB_TOL, f"{what}: logprobs differ by {err:.2e} at step {i}"


def _stats(llm: LLM) -> list[SchedulerStats]:
    stats: list[SchedulerStats] = []
    llm.engine.stat_loggers.append(stats.append)
    return stats


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_one_request_one_answer_whatever_the_path(
    llama_dir: Path, variant: str, scales_path: Path
) -> None:
    llm = _llm(llama_dir, variant, scales_path)
    (alone,) = _answers(llm, [TARGET])  # (a)
    stats = _stats(llm)
    (again,) = _answers(llm, [TARGET])  # (b) its prefix is cached now
    hits = sum(s.num_prefix_cache_hits for s in stats)
    assert hits == 96  # 12 cached blocks, cut to a segment start (4 windows of 24)
    _assert_same(again, alone, "(b) after a prefix hit")

    batch = _answers(
        _llm(llama_dir, variant, scales_path), OTHERS[:2] + [TARGET] + OTHERS[2:]
    )  # (c)
    _assert_same(batch[2], alone, "(c) in a batch")

    for chunk in (16, 64, 512):  # (d)
        (chunked,) = _answers(
            _llm(llama_dir, variant, scales_path, max_num_batched_tokens=chunk), [TARGET]
        )
        _assert_same(chunked, alone, f"(d) chunked at {chunk}")

    # (e) 37 blocks: all four are admitted (36 blocks), and the first decodes need 2 more, so the
    # last admitted (TARGET) is preempted, then recomputed (from its own cached blocks)
    spec_llm = _llm(llama_dir, variant, scales_path)
    spec, rows = spec_llm.engine.kv_spec, spec_llm.engine.num_tail_rows
    tight = _llm(
        llama_dir,
        variant,
        scales_path,
        kv_cache_memory_bytes=spec.tail_bytes(rows) + 37 * spec.bytes_per_block,
    )
    assert tight.engine.num_blocks == 37
    preempted: list[list[int]] = []
    preempt = tight.engine.scheduler._preempt

    def spy(request: Request, out: object) -> None:
        preempted.append(list(request.prompt_token_ids))
        preempt(request, out)  # type: ignore[arg-type]

    tight.engine.scheduler._preempt = spy  # type: ignore[method-assign]
    answers = _answers(tight, OTHERS + [TARGET])
    assert TARGET in preempted
    _assert_same(answers[3], alone, "(e) preempted and recomputed")

    # (f) its prefix evicted to the host tier by the others, then loaded back
    tiered = _llm(
        llama_dir,
        variant,
        scales_path,
        kv_cache_memory_bytes=spec.tail_bytes(rows) + 20 * spec.bytes_per_block,
        kv_offloading_size=64 * spec.bytes_per_block / GiB,
    )
    _answers(tiered, [TARGET])
    for other in OTHERS:
        _answers(tiered, [other])
    stats = _stats(tiered)
    (loaded,) = _answers(tiered, [TARGET])
    assert sum(s.num_host_cache_hits for s in stats) > 0
    _assert_same(loaded, alone, "(f) loaded back from the host tier")


def test_the_rule_matters_reading_a_window_quantized_moves_the_logprobs(llama_dir: Path) -> None:
    # The same request with a tail of 24 and with none: > 10x LOGPROB_TOL apart, so the test
    # above would see a path that read the window of its first computed query quantized.
    (with_tail,) = _answers(_llm(llama_dir, "fp8_e4m3 no rotation"), [TARGET])
    (without,) = _answers(_llm(llama_dir, "fp8_e4m3 no tail"), [TARGET])
    err = max(abs(a[t] - b[t]) for a, b in zip(with_tail[1], without[1]) for t in a.keys() & b)
    assert err > 10 * LOGPROB_TOL


def test_long_prompts_take_the_split_path_with_the_same_rule(llama_dir: Path) -> None:
    # Past 256 positions of context a chunk attends by key ranges and a band (split_prefill):
    # a hit, chunks of 64 and one chunk of 512 agree there too.
    long_target = [50 + (29 * i + 5) % 400 for i in range(420)]
    options = dict(max_model_len=448, kv_cache_memory_bytes=1 << 23)
    llm = _llm(llama_dir, "fp8_e4m3", **options)
    (alone,) = _answers(llm, [long_target])
    stats = _stats(llm)
    (again,) = _answers(llm, [long_target])
    assert sum(s.num_prefix_cache_hits for s in stats) == 384  # 52 blocks, cut to 4 x 96
    _assert_same(again, alone, "after a prefix hit")
    for chunk in (64, 512):
        (chunked,) = _answers(_llm(llama_dir, "fp8_e4m3", max_num_batched_tokens=chunk, **options),
                              [long_target])  # fmt: skip
        _assert_same(chunked, alone, f"chunked at {chunk}")


@pytest.mark.real_model
def test_the_readme_question_sent_three_times_through_the_server_gets_one_answer() -> None:
    # The default model on an FP8 server. The questions alone are shorter than a segment (96
    # tokens), so they are computed whole each time; behind a long system prompt the second
    # and third requests hit the prefix cache. float32 compute, so that no machine's bf16
    # rounding of other matmul shapes can tip a near tie (the FP8 rule is what this checks).
    args = EngineArgs(kv_cache_dtype="fp8_e4m3", max_num_seqs=64, dtype="float32")
    engine = LLMEngine(args)
    running = start_server(engine, ServerConfig())
    try:
        system = {
            "role": "system",
            "content": " ".join(["You are a careful geography tutor."] * 16),
        }
        for messages in (
            [{"role": "user", "content": "What is the capital of France?"}],
            [README_QUESTION],
            [system, README_QUESTION],
        ):
            replies = []
            for _ in range(3):
                reply = httpx.post(
                    running.url + "/v1/chat/completions",
                    json={
                        "model": engine.served_model_name,
                        "messages": messages,
                        "temperature": 0,
                        "max_tokens": 8,
                        "logprobs": True,
                        "top_logprobs": 2,
                    },
                    timeout=120,
                )
                assert reply.status_code == 200, reply.text
                choice = reply.json()["choices"][0]
                first = choice["logprobs"]["content"][0]["top_logprobs"]
                replies.append((choice["message"]["content"], first))
            assert replies[1][0] == replies[0][0] == replies[2][0], replies
            for _, first in replies[1:]:
                for got, want in zip(first, replies[0][1], strict=True):
                    assert got["token"] == want["token"]
                    assert abs(got["logprob"] - want["logprob"]) < LOGPROB_TOL
        assert running.metric("vllm:prefix_cache_hits_total") >= 2 * 96
    finally:
        stop_server(running)
