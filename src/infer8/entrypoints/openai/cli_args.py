"""Flags of `infer8 serve` and `python -m infer8.entrypoints.openai.api_server` (vLLM's names)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infer8.config import EngineArgs
from infer8.entrypoints.arg_parser import ArgumentParser
from infer8.entrypoints.args import add_engine_args, engine_args_from, with_default
from infer8.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS
from infer8.entrypoints.openai.vllm_compat import (
    add_vllm_compat_args,
    apply_vllm_compat,
    parse_json_list,
)
from infer8.lora.config import LoRAModulePath
from infer8.version import __version__

UVICORN_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server's options; each field is one --flag of `infer8 serve`."""

    host: str = "0.0.0.0"
    port: int = 8000
    # One or more keys (`--api-key K1 K2`), and/or a file of keys (one a line); each key is a
    # tenant whose prefix-cache blocks no other key's requests can hit.
    api_key: str | tuple[str, ...] | None = None
    api_key_file: str | None = None
    share_prefix_cache_across_api_keys: bool = False
    # With keys, /metrics needs one too (its counters move with every tenant's requests);
    # --no-metrics-require-api-key opens it for scrapers that send no key.
    metrics_require_api_key: bool = True
    # Requests accepted but not yet running; beyond it new requests get 503. None: unbounded.
    max_waiting_requests: int | None = None
    # None: 4 MiB + 64 bytes per token of context (request_limits.default_max_body_bytes)
    max_request_body_bytes: int | None = None
    # Request heads beyond these get 431 (names and values summed; the count of header lines).
    max_request_header_bytes: int = 64 * 1024
    max_num_request_headers: int = 100
    shutdown_grace_period_s: float = 25.0
    # A connection must send a request's whole head within this (slow or idle sockets close);
    # an idle keep-alive connection closes after timeout_keep_alive_s (uvicorn's setting).
    timeout_request_header_s: float = 10.0
    timeout_keep_alive_s: float = 5.0
    # Open connections plus requests in flight; past it uvicorn answers 503. None: no limit.
    limit_concurrency: int | None = 4096
    uvicorn_log_level: str = "info"
    # A step running longer than this marks the engine wedged; None: derived from the batch.
    engine_step_timeout_s: float | None = None
    max_engine_restarts: int = 3
    # Admin endpoints such as /reset_prefix_cache (vLLM's VLLM_SERVER_DEV_MODE=1 also works).
    enable_server_dev_mode: bool = False
    disable_fastapi_docs: bool = False
    disable_uvicorn_access_log: bool = False
    root_path: str | None = None
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    # CORS, as vLLM's flags: JSON lists (a bare word is one item); no origins: no CORS headers.
    allowed_origins: str | None = None
    allowed_methods: str = '["*"]'
    allowed_headers: str = '["*"]'
    allow_credentials: bool = False
    # Host header names served (JSON list; "*" any, "*.example.com" its subdomains); loopback
    # names always. None: any Host, or loopback names only when `host` is a loopback address.
    allowed_hosts: str | None = None
    # Tool calling (vLLM's flags): "auto" tool choice parses the model's calls with this parser.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # LoRA adapters served from start-up (`name=path` or vLLM's JSON form; needs --enable-lora),
    # and /v1/load_lora_adapter + /v1/unload_lora_adapter (vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING=True also turns them on).
    lora_modules: tuple[str, ...] | None = None
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if isinstance(self.api_key, list):
            object.__setattr__(self, "api_key", tuple(self.api_key))
        if isinstance(self.lora_modules, list | str):
            modules = (
                [self.lora_modules] if isinstance(self.lora_modules, str) else self.lora_modules
            )
            object.__setattr__(self, "lora_modules", tuple(modules))
        names = [LoRAModulePath.parse(text).name for text in self.lora_modules or ()]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules: an adapter name appears twice in {names}")
        keys = (self.api_key,) if isinstance(self.api_key, str) else self.api_key or ()
        if any(not key for key in keys):
            raise ValueError("api_key must not be empty")
        for name in ("timeout_request_header_s", "timeout_keep_alive_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError(f"limit_concurrency must be >= 1, got {self.limit_concurrency}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        for name in ("max_request_header_bytes", "max_num_request_headers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_request_body_bytes is not None and self.max_request_body_bytes < 1:
            raise ValueError(
                f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}"
            )
        if self.shutdown_grace_period_s < 0:
            raise ValueError(
                f"shutdown_grace_period_s must be >= 0, got {self.shutdown_grace_period_s}"
            )
        if self.engine_step_timeout_s is not None and self.engine_step_timeout_s <= 0:
            raise ValueError(f"engine_step_timeout_s must be > 0, got {self.engine_step_timeout_s}")
        if self.max_engine_restarts < 0:
            raise ValueError(f"max_engine_restarts must be >= 0, got {self.max_engine_restarts}")
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
        if self.allowed_hosts is not None:
            parse_json_list(self.allowed_hosts, "--allowed-hosts")
        origins = parse_json_list(self.allowed_origins or "[]", "--allowed-origins")
        if self.allow_credentials and "*" in origins:
            # Starlette then echoes any page's origin with credentials allowed: every web page
            # could call the API as the browser's user and read the answers.
            raise ValueError(
                "--allowed-origins '[\"*\"]' with --allow-credentials would let any web page "
                "send the browser's credentials and read the answers; name the origins instead"
            )

    def api_keys(self) -> list[str]:
        """Return the accepted API keys: --api-key's, then one per non-blank line of the file."""
        keys = [self.api_key] if isinstance(self.api_key, str) else list(self.api_key or ())
        if self.api_key_file is not None:
            try:
                lines = Path(self.api_key_file).read_text().splitlines()
            except OSError as e:
                raise ValueError(f"--api-key-file {self.api_key_file}: {e.strerror}") from None
            file_keys = [line.strip() for line in lines if line.strip()]
            if not file_keys:
                raise ValueError(f"--api-key-file {self.api_key_file} holds no key")
            keys += file_keys
        return keys


_SERVER_CHOICES: dict[str, list[str]] = {
    "uvicorn_log_level": UVICORN_LOG_LEVELS,
    "tool_call_parser": list(TOOL_CALL_PARSERS),
}
_SERVER_HELP: dict[str, str] = {
    "host": "address to bind",
    "port": "port to bind (0: any free port)",
    "api_key": "require `Authorization: Bearer KEY` on the API (not on /health); several keys "
    "allowed, each a tenant with its own prefix cache",
    "api_key_file": "a file of API keys, one a line (added to --api-key's)",
    "share_prefix_cache_across_api_keys": "let requests under different API keys hit each "
    "other's prefix-cache blocks (a shared cache reveals, by timing, which prompts others sent)",
    "metrics_require_api_key": "with --api-key, require a key on /metrics too (its counters "
    "move with every key's requests); --no-metrics-require-api-key opens it for Prometheus "
    "scrapers, which usually send no key",
    "timeout_request_header_s": "close a connection that has not sent a whole request head "
    "within this many seconds (slow or idle clients)",
    "timeout_keep_alive_s": "close an idle keep-alive connection after this many seconds",
    "limit_concurrency": "open connections plus requests in flight; past it: 503",
    "max_waiting_requests": "bound on accepted requests not yet running; beyond it: 503",
    "max_request_body_bytes": "larger request bodies are refused with 413 (default: 4 MiB plus "
    "64 bytes per token of max_model_len)",
    "max_request_header_bytes": "requests whose header names and values add up to more bytes "
    "are refused with 431",
    "max_num_request_headers": "requests with more header lines are refused with 431",
    "shutdown_grace_period_s": "on SIGTERM, how long in-flight requests may run before abort",
    "uvicorn_log_level": "log level of the HTTP server",
    "engine_step_timeout_s": "an engine step running longer than this makes /health 503, fails "
    "the requests in flight and exits non-zero (default: derived from the model and "
    "--max-num-batched-tokens, at least 120 s)",
    "max_engine_restarts": "in-process engine restarts allowed within 5 minutes after a failed "
    "step; one more and the process exits non-zero",
    "enable_server_dev_mode": "serve admin endpoints (/reset_prefix_cache); also enabled by "
    "VLLM_SERVER_DEV_MODE=1; always behind --api-key when one is set",
    "disable_fastapi_docs": "do not serve /docs and /openapi.json",
    "disable_uvicorn_access_log": "do not log each HTTP request",
    "root_path": "path prefix when served behind a proxy (ASGI root_path)",
    "ssl_keyfile": "serve HTTPS with this private key",
    "ssl_certfile": "serve HTTPS with this certificate",
    "allowed_origins": "CORS: JSON list of allowed origins, e.g. '[\"*\"]'",
    "allowed_methods": "CORS: JSON list of allowed methods",
    "allowed_headers": "CORS: JSON list of allowed headers",
    "allow_credentials": "CORS: allow credentials (refused with '[\"*\"]' origins)",
    "allowed_hosts": "JSON list of Host header names served, e.g. '[\"api.example.com\"]' "
    '("*": any; "*.example.com": its subdomains); others get 421. Loopback names are '
    "always served; by default any Host is, or loopback names only when --host is a loopback "
    "address (no DNS rebinding)",
    "enable_auto_tool_choice": 'let the model choose to call tools (tool_choice "auto")',
    "tool_call_parser": "how to read the model's tool calls: hermes or llama3_json",
    "lora_modules": "LoRA adapters to serve (needs --enable-lora): name=path, or "
    '\'{"name": "sql", "path": "/adapters/sql", "base_model_name": "base"}\'; '
    "a request picks one by its name in `model`",
    "allow_runtime_lora_updating": "serve /v1/load_lora_adapter and /v1/unload_lora_adapter "
    "(behind --api-key when one is set); also enabled by VLLM_ALLOW_RUNTIME_LORA_UPDATING=True",
}


def _field_type(cls: type, name: str) -> type:
    """Return int/float/str/bool from a dataclass field annotation such as 'int | None'."""
    hint = typing.get_type_hints(cls)[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


# flags that take one or more values, and their metavar
_LIST_FLAGS = {"api_key": "KEY", "lora_modules": "NAME=PATH"}


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    """Add one --flag per ServerConfig field (the Frontend section of --help)."""
    defaults = ServerConfig()
    group = parser.add_argument_group("Frontend (HTTP server, API keys, limits)")
    for f in dataclasses.fields(ServerConfig):
        default = getattr(defaults, f.name)
        help_ = with_default(_SERVER_HELP[f.name], default)
        if isinstance(default, bool):
            group.add_argument(
                "--" + f.name.replace("_", "-"),
                action=argparse.BooleanOptionalAction,
                default=default,
                help=help_,
            )
            continue
        choices = _SERVER_CHOICES.get(f.name)
        group.add_argument(
            "--" + f.name.replace("_", "-"),
            type=str if f.name in _LIST_FLAGS else _field_type(ServerConfig, f.name),
            nargs="+" if f.name in _LIST_FLAGS else None,
            default=default,
            choices=choices,
            metavar=_LIST_FLAGS.get(f.name, f.name.upper()) if choices is None else None,
            help=help_,
        )


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Add the engine flags, the server flags, vLLM's other flags and the positional MODEL."""
    add_engine_args(parser, positional_model=True)
    _add_server_args(parser)
    add_vllm_compat_args(parser)
    parser.add_argument("--version", action="version", version=f"infer8 {__version__}")


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
    aliases, _ = apply_vllm_compat(ns)
    values.update(aliases)
    for name in ("max_waiting_requests",):
        if values[name] is not None:
            values[name] = int(values[name])
    for name in ("shutdown_grace_period_s", "timeout_request_header_s", "timeout_keep_alive_s"):
        values[name] = float(values[name])
    if isinstance(values["api_key"], list):
        for key in values["api_key"][1:]:
            if os.path.exists(key):  # `serve --api-key K <model-dir>`: the model taken as a key
                raise ValueError(
                    f"--api-key got {key!r}, an existing path: give the model first "
                    f"(`infer8 serve {key} --api-key KEY`) or end the keys with `--`"
                )
        values["api_key"] = (
            values["api_key"][0] if len(values["api_key"]) == 1 else tuple(values["api_key"])
        )
    for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
        if values[name] is not None:
            parse_json_list(values[name], "--" + name.replace("_", "-"))
    if os.environ.get("VLLM_SERVER_DEV_MODE", "0") not in ("", "0", "false", "False"):
        values["enable_server_dev_mode"] = True
    if os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "") in ("1", "true", "True"):
        values["allow_runtime_lora_updating"] = True
    if (
        values["lora_modules"] or values["allow_runtime_lora_updating"]
    ) and not engine_args.enable_lora:
        flag = "--lora-modules" if values["lora_modules"] else "runtime LoRA updating"
        raise ValueError(f"{flag} needs --enable-lora")
    server_config = ServerConfig(**values)
    server_config.api_keys()  # a missing or empty key file: refused before anything loads
    return engine_args, server_config


class _ServeArgumentParser(ArgumentParser):
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
        prog=prog,
        usage=f"{prog} [MODEL] [options]",
        description="Serve a model over an OpenAI-compatible HTTP API.",
    )
    add_serve_args(parser)
    return parser


def _cmd_serve(ns: argparse.Namespace) -> int:
    from infer8.entrypoints.openai.api_server import run_server

    engine_args, server_config = serve_args_from(ns)
    print_compat_warnings(ns)
    return run_server(engine_args, server_config)


def print_compat_warnings(ns: argparse.Namespace) -> None:
    """Log one warning for each vLLM flag that was accepted but has no effect here."""
    for line in apply_vllm_compat(ns)[1]:
        logger.warning("%s", line)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `serve` subcommand on the `infer8` command's subparsers."""
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (vLLM's flags)",
        usage="infer8 serve [MODEL] [options]",
        description="Serve a model over an OpenAI-compatible HTTP API; vLLM's flags, in its "
        "sections.",
    )
    add_serve_args(parser)
    parser.set_defaults(func=_cmd_serve)
    return parser
