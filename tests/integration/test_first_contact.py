"""A newcomer's first steps (issue #14): the README as written, mistakes caught before loading."""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from tests.utils import build_tiny_model, free_port, infer8_log_messages, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DEFAULT_NAME = "SmolLM2-135M-Instruct"


def _serve(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "infer8.cli", "serve", *argv]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env or os.environ
    )


def _stop(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.stdout.read() if proc.stdout else ""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("first"), "llama")


# -- the README, executed -------------------------------------------------------------------
@pytest.mark.real_model
def test_readme_python_snippet_prints_a_sensible_answer() -> None:
    snippet = re.search(r"## Use\n\n```python\n(.*?)```", README, re.S)
    assert snippet is not None, "README has no Python snippet under ## Use"
    run = subprocess.run(
        [sys.executable, "-c", snippet.group(1)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Paris" in run.stdout


@pytest.fixture(scope="module")
def default_server() -> Iterator[str]:
    port = free_port()
    proc = _serve(["--port", str(port), "--host", "127.0.0.1", "--max-num-seqs", "8",
                   "--shutdown-grace-period-s", "1"])  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        yield url
    finally:
        _stop(proc)


@pytest.mark.real_model
def test_readme_curl_and_the_openai_client(default_server: str) -> None:
    curl = re.search(r"^curl localhost:8000/v1/chat/completions.*?}'$", README, re.S | re.M)
    assert curl is not None, "README has no curl example"
    port = default_server.rsplit(":", 1)[1]
    command = curl.group(0).replace("localhost:8000", f"127.0.0.1:{port}").replace("\\\n", " ")
    run = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=120)
    reply = json.loads(run.stdout)
    assert reply["model"] == DEFAULT_NAME and reply["choices"][0]["message"]["content"]

    # the README's openai client snippet, as written but for the port
    snippet = re.search(r"```python\n(from openai import OpenAI\n.*?)```", README, re.S)
    assert snippet is not None, "README shows no openai client"
    code = snippet.group(1).replace("localhost:8000", f"127.0.0.1:{port}")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Paris" in run.stdout

    client = openai.OpenAI(base_url=f"{default_server}/v1", api_key="none", max_retries=0)
    models = client.models.list().data
    assert [m.id for m in models] == [DEFAULT_NAME]
    assert "/" not in json.dumps([m.model_dump() for m in models])  # no filesystem path
    answer = client.chat.completions.create(
        model=DEFAULT_NAME,
        messages=[
            {"role": "user", "content": "What is the capital of France? Answer in one sentence."}
        ],  # fmt: skip
        max_tokens=24,
    )
    assert "Paris" in (answer.choices[0].message.content or "")


def test_keep_alive_requests_answer_without_a_nagle_stall(default_server: str) -> None:
    # The pre-bound listening socket must say TCP, or asyncio never sets TCP_NODELAY and every
    # response on a kept-alive connection waits ~40 ms for the client's delayed ACK.
    with httpx.Client(base_url=default_server) as client:
        client.get("/health")
        times_ms = []
        for _ in range(15):
            start = time.perf_counter()
            assert client.get("/health").status_code == 200
            times_ms.append(1e3 * (time.perf_counter() - start))
    assert sorted(times_ms)[7] < 25, times_ms  # the stall made every one ~44 ms


# -- mistakes: one line and a non-zero exit before any model is loaded -----------------------
def _serve_error(argv: list[str], env: dict[str, str] | None = None) -> tuple[int, str, float]:
    start = time.monotonic()
    proc = _serve(argv, env)
    out = _stop(proc) if proc.wait(timeout=60) is None else proc.stdout.read()  # type: ignore[union-attr]
    return proc.returncode, out, time.monotonic() - start


def test_port_in_use_is_one_line_before_loading(tiny_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, _ = _serve_error([str(tiny_dir), "--host", "127.0.0.1", "--port", str(port)])
    assert code != 0
    assert f"cannot listen on 127.0.0.1:{port}" in out
    assert "Traceback" not in out and "KV cache" not in out  # nothing was loaded


def test_impossible_tp_size_and_missing_cuda_fail_before_any_download(tmp_path: Path) -> None:
    env = {**os.environ, "INFER8_CACHE": str(tmp_path / "cache")}
    code, out, _ = _serve_error(["--tensor-parallel-size", "2"], env)  # the default model: 9 heads
    assert code != 0 and "tensor_parallel_size 2" in out and "choose one of [1, 3" in out
    assert "Traceback" not in out and not (tmp_path / "cache").exists()  # nothing fetched
    code, out, _ = _serve_error(["--device", "cuda"], env)
    assert code != 0 and "--device cuda" in out and "Traceback" not in out
    assert len(out.strip().splitlines()) == 1


def test_version_and_a_closed_pipe() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "infer8.cli", "--version"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0 and run.stdout.startswith("infer8 ")
    piped = subprocess.run(
        f"{shlex.quote(sys.executable)} -m infer8.cli plan | head -1",
        shell=True,
        capture_output=True,
        text=True,
    )
    assert piped.stdout.strip() and "Traceback" not in piped.stderr
    assert "BrokenPipe" not in piped.stderr


# -- things that must just work ---------------------------------------------------------------
def test_fp8_kv_cache_serves_without_a_compiler(tiny_dir: Path, tmp_path: Path) -> None:
    no_tools = tmp_path / "bin"
    no_tools.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX", "TORCHINDUCTOR_CACHE_DIR")}
    env.update(
        PATH=str(no_tools),  # no gcc, cc, g++ or c++
        INFER8_CACHE=str(tmp_path / "cache"),  # no native kernel built earlier
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),  # no compiled kernel cached
    )
    port = free_port()
    argv = [str(tiny_dir), "--dtype", "bfloat16", "--kv-cache-dtype", "fp8", "--port", str(port)]
    proc = _serve([*argv, "--host", "127.0.0.1", "--kv-cache-memory-bytes", str(8 << 20)], env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        for _ in range(2):
            body = {"prompt": "hello there", "max_tokens": 8, "ignore_eos": True}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 8
        assert httpx.get(f"{url}/health").status_code == 200
    finally:
        out = _stop(proc)
    assert "attention runs in the torch reference" in out  # the log says which path it took


def test_kv_budget_is_sized_to_need_and_reported(tiny_dir: Path) -> None:
    with infer8_log_messages() as logged:
        engine = LLMEngine(
            EngineArgs(model=str(tiny_dir), dtype="float32", max_num_seqs=2, max_model_len=128)
        )
    assert engine.num_blocks == 2 * 128 // 16  # 2 sequences x 128 tokens, not the 4 GiB cap
    out = "\n".join(logged)
    assert "what --max-num-seqs x max-model-len can fill" in out
    assert "room for 256 tokens = 2.00 requests of 128 tokens (the longest allowed)" in out


def test_a_checkout_named_infer8_does_not_shadow_the_installed_package(tmp_path: Path) -> None:
    """Python started beside a checkout named `infer8` still imports the package (src/ layout)."""
    (tmp_path / "infer8").symlink_to(ROOT, target_is_directory=True)
    run = subprocess.run(
        [sys.executable, "-c", "from infer8 import LLM, SamplingParams; print(LLM.__module__)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "infer8.entrypoints.llm"


class _Output:
    """The server's merged output, read on a thread, so a test can wait for a line with a limit."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc, self.lines, self.queue = proc, [], queue.Queue()  # type: ignore[var-annotated]
        threading.Thread(
            target=lambda: [self.queue.put(x) for x in proc.stdout], daemon=True
        ).start()  # type: ignore[union-attr]  # noqa: E501

    def expect(self, pattern: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.queue.get(timeout=0.5)
            except queue.Empty:
                continue
            self.lines.append(line)
            if match := re.search(pattern, line):
                return match
        raise AssertionError(f"no line matched {pattern!r} in:\n{''.join(self.lines)}")


def test_serve_logs_where_it_listens_and_what_sigterm_waits_for(tiny_dir: Path) -> None:
    proc = _serve([str(tiny_dir), "--host", "127.0.0.1", "--port", "0",
                   "--shutdown-grace-period-s", "2"])  # fmt: skip
    try:
        output = _Output(proc)
        match = output.expect(
            r"^INFO \S+ \S+ \[[\w.]+\] Serving the OpenAI API at (http://127\.0\.0\.1:(\d+))/v1;"
            r" chat console \1/, engine view \1/engine", 120,
        )  # fmt: skip
        url = match.group(1)
        assert int(match.group(2)) > 0  # the port --port 0 got
        wait_healthy(proc, url)
        assert httpx.get(f"{url}/engine").status_code == 200
        proc.send_signal(signal.SIGTERM)
        output.expect(r"SIGTERM: draining: new requests get 503 for 2 s", 30)
        assert proc.wait(timeout=30) == 0
    finally:
        _stop(proc)
