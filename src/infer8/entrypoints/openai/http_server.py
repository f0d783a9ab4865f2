"""uvicorn as infer8 runs it: a deadline on each request's head, keep-alive and connection
limits from the flags, and a SIGTERM drain that keeps answering 503 until the grace ends."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from infer8.entrypoints.openai.cli_args import ServerConfig

logger = logging.getLogger(__name__)


class HeadTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for every request's head.

    The deadline runs from the connection's start and from the end of each response until the
    request line and headers are in: a socket that sends nothing, or a header byte a second
    (slowloris), is closed instead of holding a connection for ever. Set by `make_config`.
    """

    timeout_request_header_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._arm_head_deadline()

    def _arm_head_deadline(self) -> None:
        self._disarm_head_deadline()
        self._head_deadline = self.loop.call_later(
            self.timeout_request_header_s, self._on_head_timeout
        )

    def _disarm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _on_head_timeout(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            logger.debug("closing a connection that sent no complete request head in time")
            self.transport.close()

    def on_headers_complete(self) -> None:
        self._disarm_head_deadline()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self.pipeline:
            self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        super().connection_lost(exc)


def make_config(app: Any, server_config: ServerConfig, **kwargs: Any) -> uvicorn.Config:
    """Return uvicorn's Config for an app under the server flags (kwargs override)."""
    protocol = type(
        "HeadTimeoutProtocol",
        (HeadTimeoutProtocol,),
        {"timeout_request_header_s": server_config.timeout_request_header_s},
    )
    options: dict[str, Any] = dict(
        host=server_config.host,
        port=server_config.port,
        http=protocol,
        log_level=server_config.uvicorn_log_level,
        timeout_keep_alive=server_config.timeout_keep_alive_s,
        limit_concurrency=server_config.limit_concurrency,
        access_log=not server_config.disable_uvicorn_access_log,
        root_path=server_config.root_path or "",
        ssl_keyfile=server_config.ssl_keyfile,
        ssl_certfile=server_config.ssl_certfile,
        # The drain below has already waited; this bounds the wait for connections after it.
        timeout_graceful_shutdown=5,
    )
    options.update(kwargs)
    return uvicorn.Config(app, **options)


class DrainingServer(uvicorn.Server):
    """A uvicorn server that drains on SIGTERM and stops at once on a second signal.

    SIGTERM: the engine refuses new work (503 + `Connection: close` from a listener that stays
    open, so a load balancer that has not yet seen the pod leave gets an answer, not a refused
    connection), requests still running a second before the grace period ends are aborted
    with a final event, and the server exits when the grace period ends. SIGINT (Ctrl-C) does
    the same without waiting out the grace period once nothing is in flight.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        grace_s: float,
        on_drain: Callable[[float], None],
        is_idle: Callable[[], bool],
    ) -> None:
        super().__init__(config)
        self.grace_s = grace_s
        self.on_drain = on_drain
        self.is_idle = is_idle
        self.is_draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.is_draining:  # a second signal: stop now
            self.force_exit = True
            self.should_exit = True
            return
        self.is_draining = True
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else sig
        if sig == signal.SIGINT:
            logger.info("%s: stopping once the requests in flight end (another signal: now)", name)
        else:
            logger.info(
                "%s: draining: new requests get 503 for %.0f s (--shutdown-grace-period-s) so "
                "load balancers see this server leave; requests in flight run until then "
                "(another signal: stop now)", name, self.grace_s,
            )  # fmt: skip
        self.on_drain(max(0.0, self.grace_s - 1.0))
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            super().handle_exit(sig, frame)
            return
        loop.call_soon_threadsafe(
            lambda: loop.create_task(self._stop_after_grace(sig == signal.SIGINT))
        )

    async def _stop_after_grace(self, stop_when_idle: bool) -> None:
        deadline = asyncio.get_running_loop().time() + self.grace_s
        while asyncio.get_running_loop().time() < deadline:
            if stop_when_idle and self.is_idle():
                break
            await asyncio.sleep(0.05)
        self.should_exit = True
