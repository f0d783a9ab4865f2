"""Flags of `infer8 serve` and `python -m infer8.entrypoints.openai.api_server` (vLLM's names)."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any

from infer8.config import EngineArgs
from infer8.entrypoints.cli import add_engine_args, engine_args_from
from infer8.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS

UVICORN_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server's options; each field is one --flag of `infer8 serve`."""

    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None
    # Requests accepted but not yet running; beyond it new requests get 503. None: unbounded.
    max_waiting_requests: int | None = None
    max_request_body_bytes: int = 16 << 20
    shutdown_grace_period_s: float = 25.0
    uvicorn_log_level: str = "info"
    # Tool calling (vLLM's flags): "auto" tool choice parses the model's calls with this parser.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if self.max_request_body_bytes < 1:
            raise ValueError(
                f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}"
            )
        if self.shutdown_grace_period_s < 0:
            raise ValueError(
                f"shutdown_grace_period_s must be >= 0, got {self.shutdown_grace_period_s}"
            )
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {list(TOOL_CALL_PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(
                f"uvicorn_log_level must be one of {UVICORN_LOG_LEVELS}, "
                f"got {self.uvicorn_log_level!r}"
            )


_SERVER_CHOICES: dict[str, list[str]] = {
    "uvicorn_log_level": UVICORN_LOG_LEVELS,
    "tool_call_parser": list(TOOL_CALL_PARSERS),
}
_SERVER_HELP: dict[str, str] = {
    "host": "address to bind",
    "port": "port to bind (0: any free port)",
    "api_key": "require `Authorization: Bearer KEY` on the API (not on /health, /metrics)",
    "max_waiting_requests": "bound on accepted requests not yet running; beyond it: 503",
    "max_request_body_bytes": "larger request bodies are refused with 413",
    "shutdown_grace_period_s": "on SIGTERM, how long in-flight requests may run before abort",
    "uvicorn_log_level": "log level of the HTTP server",
    "enable_auto_tool_choice": 'let the model choose to call tools (tool_choice "auto")',
    "tool_call_parser": "how to read the model's tool calls: hermes or llama3_json",
}


def _field_type(cls: type, name: str) -> type:
    """Return int/float/str/bool from a dataclass field annotation such as 'int | None'."""
    hint = typing.get_type_hints(cls)[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    """Add one --flag per ServerConfig field."""
    defaults = ServerConfig()
    for f in dataclasses.fields(ServerConfig):
        default = getattr(defaults, f.name)
        if _field_type(ServerConfig, f.name) is bool:
            parser.add_argument(
                "--" + f.name.replace("_", "-"),
                action="store_true",
                help=f"{_SERVER_HELP[f.name]} (default: off)",
            )
            continue
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=_field_type(ServerConfig, f.name),
            default=default,
            choices=_SERVER_CHOICES.get(f.name),
            help=f"{_SERVER_HELP[f.name]} (default: {default})",
        )


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Add the engine flags, the server flags and the optional positional MODEL."""
    add_engine_args(parser, positional_model=True)
    _add_server_args(parser)


def serve_args_from(ns: argparse.Namespace) -> tuple[EngineArgs, ServerConfig]:
    """Build and validate the engine and server options; raise ValueError on bad values.

    Nothing is loaded and the model path is not checked, so manifests for other machines parse.
    """
    engine_args = engine_args_from(ns)
    # Validate every engine value except those that depend on this machine's device.
    dataclasses.replace(engine_args, device="cpu", dtype="float32").create_configs(
        engine_args.model or ""
    )
    values: dict[str, Any] = {f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerConfig)}
    return engine_args, ServerConfig(**values)


class _ServeArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that also validates the values (exit 2 with the reason)."""

    def parse_known_args(  # type: ignore[override]
        self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        ns, rest = super().parse_known_args(args, namespace)
        try:
            serve_args_from(ns)
        except ValueError as e:
            self.error(str(e))
        return ns, rest


def make_serve_parser(prog: str = "infer8 serve") -> argparse.ArgumentParser:
    """Return a parser of serve-style args ([MODEL] or --model=MODEL, engine and server flags)."""
    parser = _ServeArgumentParser(
        prog=prog, description="Serve a model over an OpenAI-compatible HTTP API."
    )
    add_serve_args(parser)
    return parser


def _cmd_serve(ns: argparse.Namespace) -> int:
    from infer8.entrypoints.openai.api_server import run_server

    engine_args, server_config = serve_args_from(ns)
    return run_server(engine_args, server_config)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `serve` subcommand on the `infer8` command's subparsers."""
    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API (vLLM's flags)"
    )
    add_serve_args(parser)
    parser.set_defaults(func=_cmd_serve)
    return parser
