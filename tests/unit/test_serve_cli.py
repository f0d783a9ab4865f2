"""`infer8 serve` / api_server flags: vLLM's seed command line, bad flags, no drift, protocol."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from infer8 import cli
from infer8.cli import build_parser
from infer8.config import EngineArgs
from infer8.entrypoints.openai import api_server
from infer8.entrypoints.openai.cli_args import ServerConfig, make_serve_parser, serve_args_from
from infer8.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

SEED_ARGS = [
    "--model=/models/llama",
    "--kv-cache-dtype=fp8_e4m3",
    "--gpu-memory-utilization=0.94",
    "--max-num-seqs=512",
    "--max-num-batched-tokens=16384",
    "--enforce-eager",
]


def test_seed_command_line_parses_with_vllm_meaning() -> None:
    engine_args, server = serve_args_from(make_serve_parser().parse_args(SEED_ARGS))
    assert engine_args.model == "/models/llama"
    assert engine_args.kv_cache_dtype == "fp8_e4m3"
    assert engine_args.gpu_memory_utilization == 0.94
    assert (engine_args.max_num_seqs, engine_args.max_num_batched_tokens) == (512, 16384)
    assert engine_args.enforce_eager is True
    assert (server.host, server.port) == ("0.0.0.0", 8000)


def test_serve_subcommand_takes_a_positional_model_and_server_flags() -> None:
    ns = build_parser().parse_args(
        [
            "serve",
            "/models/x",
            "--port",
            "9001",
            "--api-key",
            "k",
            "--max-model-len",
            "2048",
            "--served-model-name",
            "m",
            "--scheduler",
            "static",
            "--block-size",
            "32",
            "--dtype",
            "bfloat16",
            "--kv-cache-memory-bytes",
            "1000000",
            "--host",
            "127.0.0.1",
        ]
    )
    engine_args, server = serve_args_from(ns)
    assert engine_args.model == "/models/x" and engine_args.max_model_len == 2048
    assert (engine_args.served_model_name, engine_args.scheduler) == ("m", "static")
    assert (engine_args.block_size, engine_args.kv_cache_memory_bytes) == (32, 1000000)
    assert (server.port, server.api_key, server.host) == (9001, "k", "127.0.0.1")
    assert ns.func.__name__ == "_cmd_serve"


def test_flags_and_dataclasses_do_not_drift() -> None:
    parser = make_serve_parser()
    ns = parser.parse_args([])
    dests = {a.dest for a in parser._actions} - {"help", "model_flag", "version"}
    dests = {d for d in dests if not d.startswith("vllm_")}  # vLLM flags: vllm_compat.py
    fields = {f.name for f in dataclasses.fields(EngineArgs)} | {
        f.name for f in dataclasses.fields(ServerConfig)
    }
    assert dests == fields
    engine_args, server = serve_args_from(ns)
    assert engine_args == EngineArgs() and server == ServerConfig()


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--kv-cache-dtype=fp9"], ["fp8_e4m3", "fp8_e5m2"]),  # lists the valid choices
        (["--scheduler=fifo"], ["continuous", "static"]),
        (["--no-such-flag"], ["--no-such-flag"]),
        (["--max-num-seqs=many"], ["--max-num-seqs"]),
        (["--block-size=7"], ["block_size"]),
        (["--gpu-memory-utilization=1.5"], ["gpu_memory_utilization"]),
        (["--port=70000"], ["port"]),
        (["--max-waiting-requests=-1"], ["max_waiting_requests"]),
        (["--uvicorn-log-level=loud"], ["debug", "info"]),
    ],
)
def test_bad_flags_exit_2_before_loading(
    argv: list[str], words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        api_server.main(["--model=/does/not/matter", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_missing_model_path_fails_without_loading(capsys: pytest.CaptureFixture[str]) -> None:
    assert api_server.main(["--model=/no/such/model"]) == 2
    assert "not a local path" in capsys.readouterr().err


def test_request_fields_map_to_sampling_params() -> None:
    request = CompletionRequest.model_validate(
        {
            "prompt": "x",
            "temperature": 0,
            "top_k": -1,
            "min_p": 0.1,
            "repetition_penalty": 1.2,
            "stop": "END",
            "stop_token_ids": [3],
            "ignore_eos": True,
            "min_tokens": 2,
            "seed": 2**63 - 1,
        }
    )
    params = request.sampling_params(max_tokens=10, logprobs=3, seed_offset=1)
    assert (params.temperature, params.top_k, params.min_p) == (0.0, 0, 0.1)
    assert (params.repetition_penalty, params.stop, params.stop_token_ids) == (1.2, ["END"], [3])
    assert (params.ignore_eos, params.min_tokens, params.max_tokens) == (True, 2, 10)
    assert params.logprobs == 3 and params.seed == -(2**63)  # seed + choice wraps in int64
    chat = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
            "max_tokens": 5,
            "max_completion_tokens": 7,
        }
    )
    assert chat.requested_max_tokens == 7
    assert chat.messages[0].to_template_dict() == {"role": "user", "content": "a"}


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["serve", "--kv-cache-dtype", "fp9"],
            "infer8 serve: error: argument --kv-cache-dtype: invalid choice 'fp9' "
            "(did you mean fp8?)",
        ),
        (
            ["serve", "--max-num-sqes", "8"],
            "infer8 serve: error: unrecognized argument: --max-num-sqes "
            "(did you mean --max-num-seqs?)",
        ),
        (
            ["generate", "--promt", "hi"],
            "infer8 generate: error: the following arguments are required: --prompt "
            "(--promt was given: a typo of --prompt?)",
        ),
        (["serv"], "infer8: error: unknown command 'serv' (did you mean serve?)"),
        (
            ["plan", "--max-num-sqes", "64"],
            "infer8 plan: error: unrecognized argument: --max-num-sqes (did you mean --max-num-seqs?)",
        ),
        (
            ["bench", "throughput", "--num-promts", "8", "--bogus"],
            "infer8 bench throughput: error: unrecognized arguments: --num-promts "
            "(did you mean --num-prompts?), --bogus;",
        ),
    ],
)
def test_argument_errors_are_one_line_with_a_suggestion(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Check a mistyped flag, choice or command answers one line naming the fix, exit 2."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1, captured.err  # no usage block
    assert captured.err.startswith(expected), captured.err


def test_api_server_module_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Check `python -m ...api_server` answers a bad choice as `infer8 serve` does."""
    with pytest.raises(SystemExit) as exit_info:
        api_server.main(["--model=/m", "--kv-cache-dtype=fp9"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "(did you mean fp8?)" in err, err


def test_help_still_prints_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    """Check the usage is not lost: `--help` prints it and exits 0."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: infer8 serve")


def test_a_model_directory_after_api_key_is_refused_not_taken_as_a_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`serve --api-key K1 <model-dir>`: nargs takes the directory as a second key."""
    assert cli.main(["serve", "--api-key", "K1", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "an existing path: give the model first" in err and len(err.splitlines()) == 1
    # two real keys still work, and the model first
    _, server = serve_args_from(cli.build_parser().parse_args(
        ["serve", str(tmp_path), "--api-key", "K1", "K2"]
    ))  # fmt: skip
    assert server.api_keys() == ["K1", "K2"]


def test_top_level_help_describes_the_product_and_its_commands(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "OpenAI-compatible server" in out and "imports" not in out
    for command in ("serve", "pull", "plan", "bench", "demo"):
        assert f"    {command}" in out


def test_serve_help_is_grouped_as_vllms_and_loads_no_torch() -> None:
    """`infer8 serve --help` in a fresh interpreter: vLLM's sections, each default said once,
    metavars named by the flag, and torch never imported (it took 13-16 s on a loaded machine)."""
    code = (
        "import sys\nfrom infer8.cli import main\n"
        "try:\n    main(['serve', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO TORCH')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    assert out.rstrip().endswith("NO TORCH")
    assert out.startswith("usage: infer8 serve [MODEL] [options]\n")
    sections = [line for line in out.splitlines() if line and not line[0].isspace()]
    assert [s for s in sections if s.endswith(":")][-8:] == [
        "Model:",
        "Cache (KV blocks, FP8, prefix caching):",
        "Scheduler:",
        "Speculative decoding:",
        "LoRA:",
        "Parallel:",
        "Frontend (HTTP server, API keys, limits):",
        "vLLM's other flags (accepted as vLLM's, with a warning, or refused with the reason):",
    ]
    env_flags = ("VLLM_SERVER_DEV_MODE", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    assert "VLLM_" not in out.replace(env_flags[0], "").replace(env_flags[1], "")
    text = " ".join(out.split())
    assert "(default: None)" not in text
    assert not re.search(r"\(default: [^)]*\)[^(]{0,3}\(default:", text)
    assert "--max-num-seqs MAX_NUM_SEQS most requests in one batch (default: 256)" in text
