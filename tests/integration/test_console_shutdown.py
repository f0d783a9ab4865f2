"""An open engine view must not hold `infer8 serve` up on SIGTERM: its endless stream ends."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.utils import wait_healthy


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_sigterm_ends_open_console_streams_at_once(
    llama_dir: Path,
) -> None:
    port = _free_port()
    argv = [
        sys.executable,
        "-m",
        "infer8.entrypoints.openai.api_server",
        f"--model={llama_dir}",
        f"--port={port}",
        "--host=127.0.0.1",
        f"--kv-cache-memory-bytes={8 << 20}",
        "--shutdown-grace-period-s=6",
        "--uvicorn-log-level=warning",
    ]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ)
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, timeout_s=60)
        with httpx.stream("GET", f"{url}/console/api/events", timeout=30) as response:
            lines = response.iter_lines()
            assert next(lines) == "event: info"
            start = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            for _ in lines:  # the stream ends at once, not when the grace period does
                pass
            assert time.monotonic() - start < 3
        assert proc.wait(timeout=15) == 0  # after the grace period, in which 503s answer
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
