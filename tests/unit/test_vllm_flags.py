"""vLLM command lines run unchanged: mapped, accepted with one warning line, or refused clearly."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from infer8.entrypoints.openai.cli_args import make_serve_parser, serve_args_from
from infer8.entrypoints.openai.vllm_compat import apply_vllm_compat, flags_table_markdown

DOCS = Path(__file__).resolve().parents[2] / "docs" / "vllm-flags.md"

# Command lines as people deploy vLLM (the seed's first), with the model given both ways.
VLLM_COMMAND_LINES = [
    "--model=/models/qwen2 --kv-cache-dtype=fp8_e4m3 --gpu-memory-utilization=0.94 "
    "--max-num-seqs=512 --max-num-batched-tokens=16384 --enforce-eager",
    "/models/llama --host 0.0.0.0 --port 8000 --trust-remote-code --disable-log-requests "
    "--served-model-name llama3 --max-model-len 8192 -tp 1",
    "/models/qwen2 --dtype bfloat16 --quantization fp8 --kv-cache-dtype fp8 "
    "--enable-prefix-caching --api-key sk-local --uvicorn-log-level warning",
    "/models/m --disable-log-stats --enable-chunked-prefill --max-num-queued-reqs 64 "
    "--download-dir /data --swap-space 4 --pipeline-parallel-size 1 --data-parallel-size 1",
    "/models/m --generation-config auto --override-generation-config '{\"temperature\": 0.3}' "
    "--load-format safetensors --distributed-executor-backend mp --scheduling-policy fcfs",
    "/models/m --allowed-origins '[\"*\"]' --disable-fastapi-docs --disable-uvicorn-access-log "
    "--root-path /v --shutdown-timeout 10 --max-logprobs 20 --seed 7 --block-size 16",
    "/models/m --tensor-parallel-size 2 --no-enable-prefix-caching --revision main "
    "--tokenizer-mode auto --max-seq-len-to-capture 8192 --compilation-config '{\"level\": 3}'",
]


@pytest.mark.parametrize("line", VLLM_COMMAND_LINES)
def test_real_vllm_command_lines_parse(line: str) -> None:
    ns = make_serve_parser(prog="api_server").parse_args(shlex.split(line))
    engine_args, server = serve_args_from(ns)
    assert engine_args.model is not None and engine_args.model.startswith("/models/")
    _, warnings = apply_vllm_compat(ns)
    assert all(w.startswith("warning: --") and "\n" not in w for w in warnings)


def test_flags_map_onto_infer8_options() -> None:
    parser = make_serve_parser()
    ns = parser.parse_args(shlex.split(VLLM_COMMAND_LINES[3]))
    _, server = serve_args_from(ns)
    assert server.max_waiting_requests == 64
    ns = parser.parse_args(shlex.split(VLLM_COMMAND_LINES[5]))
    _, server = serve_args_from(ns)
    assert server.shutdown_grace_period_s == 10.0 and server.disable_fastapi_docs
    assert server.allowed_origins == '["*"]' and server.root_path == "/v"
    ns = parser.parse_args(shlex.split(VLLM_COMMAND_LINES[1]))
    engine_args, _ = serve_args_from(ns)
    assert engine_args.tensor_parallel_size == 1 and engine_args.served_model_name == "llama3"
    _, warnings = apply_vllm_compat(ns)
    assert len(warnings) == 2  # --trust-remote-code and --disable-log-requests


@pytest.mark.parametrize(
    "flags, words",
    [
        ("--pipeline-parallel-size 2", "pipeline parallelism"),
        ("--data-parallel-size 4", "replicas"),
        ("--lora-modules a=/x", "needs --enable-lora"),
        ("""--speculative-config '{"method": "eagle"}'""", "needs a draft model"),
        ("--no-enable-chunked-prefill", "always on"),
        ("--tokenizer /other", "tokenizer"),
        ("--quantization awq", "quantization"),
        ("--max-logprobs 50", "20"),
    ],
)
def test_refused_flags_stop_with_one_line(
    flags: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        make_serve_parser().parse_args(["/models/m", *shlex.split(flags)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert words in error and "Traceback" not in error


def test_docs_table_is_current() -> None:
    assert flags_table_markdown() in DOCS.read_text(), (
        "regenerate: python -c 'from infer8.entrypoints.openai.vllm_compat import "
        "flags_table_markdown as t; print(t())'"
    )


def test_every_flag_has_help_text_and_version() -> None:
    parser = make_serve_parser()
    for action in parser._actions:
        if action.dest in ("help", "version"):
            continue
        assert action.help and action.help.strip(), action.option_strings
    assert "--model MODEL" in parser.format_help() and "MODEL_FLAG" not in parser.format_help()
