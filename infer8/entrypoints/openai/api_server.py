"""`python -m infer8.entrypoints.openai.api_server --model=MODEL [flags]`: vLLM's entry point."""

from __future__ import annotations

import logging
import signal
import sys
from types import FrameType

import uvicorn

from infer8.config import EngineArgs
from infer8.distributed.launch import launched_env, run_launched_worker
from infer8.engine import LLMEngine
from infer8.entrypoints.openai.cli_args import ServerConfig, make_serve_parser, serve_args_from
from infer8.entrypoints.openai.server import create_app

logger = logging.getLogger(__name__)


def _note_signal(signum: int, frame: FrameType | None) -> None:
    logger.info("received signal %d after shutdown", signum)


class _Server(uvicorn.Server):
    """uvicorn's server that, on SIGTERM / SIGINT, also ends the web console's endless streams."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.config.app.state.console_recorder.close()  # else the drain waits for open viewers
        super().handle_exit(sig, frame)


def run_server(engine_args: EngineArgs, server_config: ServerConfig) -> int:
    """Load the engine, serve until SIGTERM / SIGINT, drain in-flight requests; return 0.

    Launched as rank > 0 of a tensor-parallel group (torchrun), run that rank's worker instead.
    """
    env = launched_env(engine_args.tensor_parallel_size)
    if env is not None and env.rank > 0:
        return run_launched_worker(engine_args, env)
    engine = LLMEngine(engine_args)
    app = create_app(engine, server_config)
    config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level=server_config.uvicorn_log_level,
        timeout_graceful_shutdown=server_config.shutdown_grace_period_s,  # type: ignore[arg-type]
    )
    server = _Server(config)
    # uvicorn re-raises the signal that stopped it with the handler found at start; make that
    # a no-op so a drained shutdown exits 0 instead of dying by the signal.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _note_signal)
    server.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse vLLM-style flags (exit 2 before loading anything if bad) and serve."""
    parser = make_serve_parser(prog="python -m infer8.entrypoints.openai.api_server")
    ns = parser.parse_args(argv)
    engine_args, server_config = serve_args_from(ns)
    try:
        return run_server(engine_args, server_config)
    except (ValueError, RuntimeError) as e:
        print(f"infer8: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
