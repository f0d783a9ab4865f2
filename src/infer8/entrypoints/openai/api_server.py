"""`python -m infer8.entrypoints.openai.api_server --model=MODEL [flags]`: vLLM's entry point."""

from __future__ import annotations

import gc
import logging
import signal
import socket
import sys
from types import FrameType
from typing import Any

from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.entrypoints.openai.cli_args import (
    ServerConfig,
    make_serve_parser,
    print_compat_warnings,
    serve_args_from,
)
from infer8.entrypoints.openai.http_server import DrainingServer, make_config
from infer8.entrypoints.openai.server import create_app
from infer8.entrypoints.preflight import check_port, preflight
from infer8.executor.launch import launched_env, run_launched_worker
from infer8.logging_setup import configure_logging

logger = logging.getLogger(__name__)


def _note_signal(signum: int, frame: FrameType | None) -> None:
    logger.info("received signal %d after shutdown", signum)


_GIL_SWITCH_INTERVAL_S = 0.001


def _drain(app: Any, abort_after_s: float) -> None:
    """Refuse new work, abort what still runs after abort_after_s, end the console's streams."""
    app.state.engine_client.start_drain(abort_after_s)
    app.state.console_recorder.close()


def listen_urls(sock: socket.socket, has_api_key: bool) -> str:
    """Return the line that says where the server listens: the API, the console, the view."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    base = f"http://{shown}:{port}"
    key = " (with --api-key: the pages ask for the key)" if has_api_key else ""
    everywhere = " on every address of this host" if host in ("0.0.0.0", "::") else ""
    return (
        f"Serving the OpenAI API at {base}/v1{everywhere}; chat console {base}/, "
        f"engine view {base}/engine{key}"
    )


def run_server(engine_args: EngineArgs, server_config: ServerConfig) -> int:
    """Load the engine, serve until SIGTERM / SIGINT, drain in-flight requests.

    Returns 0 after a drained shutdown, 1 when the engine died for good (a wedged step, or
    too many failures in a row) so that the orchestrator restarts the process.

    Launched as rank > 0 of a tensor-parallel group (torchrun), run that rank's worker instead.
    """
    env = launched_env(engine_args.tensor_parallel_size)
    if env is not None and env.rank > 0:
        return run_launched_worker(engine_args, env)
    # The event loop shares the GIL with the engine thread: hand it over every 1 ms instead
    # of 5 so admission, 503s and /health wait less behind a step's Python (benchmarks/
    # frontend.py: time to a 503 in a 400-request burst, p99 124 -> 94 ms).
    sys.setswitchinterval(_GIL_SWITCH_INTERVAL_S)
    # Everything checkable without the model, first; the socket is bound now so that a port in
    # use is reported in a second and nobody can take it while the model loads.
    preflight(engine_args)
    sock = check_port(server_config.host, server_config.port)
    engine = LLMEngine(engine_args)
    app = create_app(engine, server_config)
    engine_client = app.state.engine_client
    config = make_config(app, server_config)
    # New requests get 503 at once; those still running a second before the grace period ends
    # are aborted, so every stream gets its final event before the connections close.
    server = DrainingServer(
        config,
        server_config.shutdown_grace_period_s,
        on_drain=lambda abort_after_s: _drain(app, abort_after_s),
        is_idle=lambda: engine_client.is_idle,
    )
    fatal_reasons: list[str] = []

    def on_fatal(reason: str) -> None:
        fatal_reasons.append(reason)
        engine_client.start_drain(0.0)
        app.state.console_recorder.close()
        server.should_exit = True

    engine_client.on_fatal = on_fatal
    # uvicorn re-raises the signal that stopped it with the handler found at start; make that
    # a no-op so a drained shutdown exits 0 instead of dying by the signal.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _note_signal)
    # The model, tokenizer and app are ~350,000 objects that live as long as the process: a
    # full collection traversed them all, ~180-200 ms holding the GIL (and /health) whenever
    # parsing request bodies set one off. Frozen, collections see only what requests allocate.
    gc.collect()
    gc.freeze()
    logger.info("%s", listen_urls(sock, bool(server_config.api_keys())))
    server.run(sockets=[sock])
    if fatal_reasons:
        print(f"infer8: error: {fatal_reasons[0]}", file=sys.stderr, flush=True)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse vLLM-style flags (exit 2 before loading anything if bad) and serve."""
    parser = make_serve_parser(prog="python -m infer8.entrypoints.openai.api_server")
    ns = parser.parse_args(argv)
    configure_logging()
    engine_args, server_config = serve_args_from(ns)
    print_compat_warnings(ns)
    try:
        return run_server(engine_args, server_config)
    except (ValueError, RuntimeError) as e:
        print(f"infer8: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
