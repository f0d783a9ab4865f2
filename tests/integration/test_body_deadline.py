"""Request bodies that never arrive: a deadline and a least rate close them, probes answer past
the connection limit from their own reserve, and a client that leaves mid-upload is one log line.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.entrypoints.openai.cli_args import ServerConfig
from infer8.entrypoints.openai.http_server import make_config
from infer8.entrypoints.openai.server import create_app

TIMEOUT_S = 1.0  # --timeout-request-header-s: the head's deadline and the body's grace
LIMIT = 8  # --limit-concurrency
STALLED_HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: 100\r\n\r\n{"
)


@dataclass
class Server:
    url: str
    port: int


@pytest.fixture(scope="module")
def server(llama_dir: Path) -> Iterator[Server]:
    engine = LLMEngine(
        EngineArgs(model=str(llama_dir), dtype="float32", kv_cache_memory_bytes=8 << 20)
    )
    config = ServerConfig(
        host="127.0.0.1", port=0, timeout_request_header_s=TIMEOUT_S, limit_concurrency=LIMIT
    )
    # log_config=None: uvicorn's loggers propagate to the root logger, where caplog listens
    uvicorn_config = make_config(
        create_app(engine, config), config, log_level="info", log_config=None
    )
    running = uvicorn.Server(uvicorn_config)
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not running.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    port = running.servers[0].sockets[0].getsockname()[1]
    yield Server(f"http://127.0.0.1:{port}", port)
    running.should_exit = True
    thread.join(20)


@pytest.fixture
def stack() -> Iterator[contextlib.ExitStack]:
    """Closes the test's sockets however it ends (a socket left open holds a connection)."""
    with contextlib.ExitStack() as stack:
        yield stack


def _read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Return what the server sent before closing, and when it closed (monotonic)."""
    sock.settimeout(timeout_s)
    received = b""
    try:
        while chunk := sock.recv(4096):
            received += chunk
    except ConnectionResetError:
        pass
    return received, time.monotonic()


def test_a_stalled_body_is_closed_while_probes_answer_past_the_connection_limit(
    server: Server, stack: contextlib.ExitStack
) -> None:
    """Headers and 1 byte of a 100-byte body on every allowed connection: /health still answers,
    the API gets 503, and each stalled socket gets 408 and is closed after the grace."""
    # uvicorn counts the connection being admitted: LIMIT - 1 stalled ones fill the server
    stalled = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(LIMIT - 1)]
    stack.callback(lambda: [sock.close() for sock in stalled])
    for sock in stalled:
        sock.sendall(STALLED_HEAD)
    sent_at = time.monotonic()
    time.sleep(0.2)  # every stalled request is in the app, waiting for its body
    with httpx.Client(timeout=5) as client:
        for path in ("/health", "/ready", "/metrics"):
            assert client.get(f"{server.url}{path}").status_code == 200, path
        refused = client.post(f"{server.url}/v1/completions", json={"prompt": "hi"})
        assert refused.status_code == 503  # the limit still holds for the API
    for sock in stalled:
        received, closed_at = _read_until_closed(sock, timeout_s=5 * TIMEOUT_S)
        assert received.startswith(b"HTTP/1.1 408 "), received[:80]
        assert b"request_timeout" in received
        assert TIMEOUT_S - 0.1 <= closed_at - sent_at <= 3 * TIMEOUT_S
    completion = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30
    )
    assert completion.status_code == 200


def test_a_body_slower_than_the_least_rate_is_closed_and_a_steady_one_is_not(
    server: Server, stack: contextlib.ExitStack
) -> None:
    # a byte every 0.1 s: far under the least rate, so closed soon after the grace
    dribble = stack.enter_context(socket.create_connection(("127.0.0.1", server.port)))
    dribble.sendall(STALLED_HEAD)
    start = time.monotonic()
    dribble.settimeout(0.1)
    received = b""
    while time.monotonic() - start < 5 * TIMEOUT_S:
        try:
            dribble.sendall(b" ")
            chunk = dribble.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            break
        if not chunk:
            break
        received += chunk
    assert received.startswith(b"HTTP/1.1 408 "), received[:80]
    assert time.monotonic() - start <= 3 * TIMEOUT_S
    # 160 KiB over ~2 s (80 KiB/s, past the grace but above the least rate): served
    body = b'{"prompt": "hi", "max_tokens": 1}' + b" " * (160 << 10)
    steady = stack.enter_context(socket.create_connection(("127.0.0.1", server.port)))
    steady.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    )
    for offset in range(0, len(body), 8 << 10):
        steady.sendall(body[offset : offset + (8 << 10)])
        time.sleep(0.1)
    received, _ = _read_until_closed(steady, timeout_s=30)
    assert received.startswith(b"HTTP/1.1 200 "), received[:80]


def test_a_client_leaving_mid_body_is_one_log_line(
    server: Server, caplog: pytest.LogCaptureFixture, stack: contextlib.ExitStack
) -> None:
    caplog.set_level(logging.INFO)
    clients = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
    stack.callback(lambda: [sock.close() for sock in clients])
    for sock in clients:
        sock.sendall(STALLED_HEAD)
    time.sleep(0.3)  # the app is reading the body
    for sock in clients:
        sock.close()
    time.sleep(0.5)
    assert httpx.get(f"{server.url}/health").status_code == 200
    records = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert not [r for r in records if r.exc_info], [r.getMessage() for r in records]
    assert not [r for r in records if r.levelno >= logging.ERROR], [r.getMessage() for r in records]
    left = [r.getMessage() for r in records if "left during the request body" in r.getMessage()]
    assert len(left) == 3, [r.getMessage() for r in records]
    assert "POST /v1/completions" in left[0]
