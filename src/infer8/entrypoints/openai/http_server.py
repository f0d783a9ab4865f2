"""uvicorn as infer8 runs it: deadlines on each request's head and body, keep-alive and
connection limits from the flags with a reserve for probes, and a SIGTERM drain that keeps
answering 503 until the grace ends."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from infer8.entrypoints.openai.cli_args import ServerConfig
from infer8.entrypoints.openai.request_limits import BODY_TIMED_OUT
from infer8.logging_setup import RateLimitedLog

logger = logging.getLogger(__name__)


# Least upload rate once a body's grace (--timeout-request-header-s) has passed: a body of
# N bytes gets the grace plus N / this many seconds (a 4.5 MiB body: 10 + 288 s). Holding all
# 4,096 default connections at this rate costs a client 64 MiB/s of upload.
MIN_REQUEST_BODY_BYTES_PER_S = 16 << 10
# Probes answered past --limit-concurrency, at most this many at once: a liveness probe must
# not fail because the API's connections are all taken.
NUM_RESERVED_PROBE_SLOTS = 8
PROBE_PATHS = frozenset({b"/health", b"/ready", b"/metrics"})
_TIMEOUT_BODY = json.dumps(
    {
        "error": {
            "message": "the request body did not arrive in time; closing the connection",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_timeout",
        }
    }
).encode()
_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_TIMEOUT_BODY), _TIMEOUT_BODY)
)


@dataclass
class ProbeSlots:
    """The connection slots only probes may use once --limit-concurrency is reached."""

    num_slots: int
    num_in_use: int = 0

    def take(self) -> bool:
        """Take a slot; False when all are in use."""
        if self.num_in_use >= self.num_slots:
            return False
        self.num_in_use += 1
        return True

    def give_back(self) -> None:
        assert self.num_in_use > 0
        self.num_in_use -= 1


class DeadlineProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol with deadlines on each request's head and body, and a
    reserve of connection slots for probes.

    Head: the deadline runs from the connection's start and from the end of each response
    until the request line and headers are in: a socket that sends nothing, or a header byte a
    second (slowloris), is closed. Body: from the end of the head the body gets the same time
    plus 1 s per MIN_REQUEST_BODY_BYTES_PER_S received; a slower body gets 408 and the
    connection closes (the clock stops while the app has not read what came). Past
    --limit-concurrency a GET of a probe path is still served, from `probe_slots`. Set by
    `make_config`.
    """

    timeout_request_header_s: float = 10.0
    min_request_body_bytes_per_s: float = MIN_REQUEST_BODY_BYTES_PER_S
    probe_slots: ProbeSlots | None = None
    slow_body_log: RateLimitedLog | None = None  # this server's, shared by its connections

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._body_deadline: asyncio.TimerHandle | None = None
        self._body_started_at = 0.0
        self._num_body_bytes = 0
        self._holds_probe_slot = False
        self._arm_head_deadline()

    # -- the head ------------------------------------------------------------------------------
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
        if self._is_probe_past_the_limit() and self.probe_slots and self.probe_slots.take():
            self._holds_probe_slot = True
            limit, self.limit_concurrency = self.limit_concurrency, None  # this request only
            try:
                super().on_headers_complete()
            finally:
                self.limit_concurrency = limit
        else:
            super().on_headers_complete()
        # A request without a body completes in the same feed of data, disarming this.
        self._body_started_at = self.loop.time()
        self._num_body_bytes = 0
        self._arm_body_deadline(self.timeout_request_header_s)

    def _is_probe_past_the_limit(self) -> bool:
        limit = self.limit_concurrency
        return (
            limit is not None
            and (len(self.connections) >= limit or len(self.tasks) >= limit)
            and self.parser.get_method() in (b"GET", b"HEAD")
            and self.url.split(b"?", 1)[0] in PROBE_PATHS
        )

    # -- the body ------------------------------------------------------------------------------
    def _arm_body_deadline(self, delay_s: float) -> None:
        self._disarm_body_deadline()
        self._body_deadline = self.loop.call_later(delay_s, self._on_body_deadline)

    def _disarm_body_deadline(self) -> None:
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None

    def on_body(self, body: bytes) -> None:
        self._num_body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm_body_deadline()
        super().on_message_complete()

    def _on_body_deadline(self) -> None:
        self._body_deadline = None
        if self.transport.is_closing() or self.cycle is None or self.cycle.response_complete:
            return
        now = self.loop.time()
        if self.flow.read_paused:  # the app has not read what came: the wait is the server's
            self._body_started_at, self._num_body_bytes = now, 0
            self._arm_body_deadline(self.timeout_request_header_s)
            return
        allowed_s = (
            self.timeout_request_header_s + self._num_body_bytes / self.min_request_body_bytes_per_s
        )
        elapsed_s = now - self._body_started_at
        if elapsed_s < allowed_s:
            self._arm_body_deadline(allowed_s - elapsed_s)
            return
        self._close_slow_body(elapsed_s)

    def _close_slow_body(self, elapsed_s: float) -> None:
        """Answer 408 (unless a response has begun), close, and tell the app the client left."""
        cycle = self.cycle
        declared = dict(self.headers).get(b"content-length", b"chunked").decode("latin-1")
        peer = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        method, path = cycle.scope["method"], cycle.scope["path"]
        log = self.slow_body_log or RateLimitedLog(logger, "slow request bodies closed")
        log.info(
            self.loop.time(),
            "closed %s: %d of %s body bytes of %s %s in %.1f s (408)",
            peer, self._num_body_bytes, declared, method, path, elapsed_s,
        )  # fmt: skip
        cycle.scope.setdefault("state", {})[BODY_TIMED_OUT] = True
        if not cycle.response_started:
            self.transport.write(_TIMEOUT_RESPONSE)
        cycle.disconnected = True  # the app's next receive() is http.disconnect, sends are dropped
        cycle.message_event.set()
        self.transport.close()

    # -- responses and the connection ----------------------------------------------------------
    def on_response_complete(self) -> None:
        self._disarm_body_deadline()  # an early answer (413, 503): what is left is discarded
        self._give_back_probe_slot()
        super().on_response_complete()
        if not self.transport.is_closing() and not self.pipeline:
            self._arm_head_deadline()

    def _give_back_probe_slot(self) -> None:
        if self._holds_probe_slot:
            self._holds_probe_slot = False
            assert self.probe_slots is not None
            self.probe_slots.give_back()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        self._disarm_body_deadline()
        self._give_back_probe_slot()
        super().connection_lost(exc)


def make_config(app: Any, server_config: ServerConfig, **kwargs: Any) -> uvicorn.Config:
    """Return uvicorn's Config for an app under the server flags (kwargs override)."""
    protocol = type(
        "DeadlineProtocol",
        (DeadlineProtocol,),
        {
            "timeout_request_header_s": server_config.timeout_request_header_s,
            "probe_slots": ProbeSlots(NUM_RESERVED_PROBE_SLOTS),  # this server's own
            "slow_body_log": RateLimitedLog(logger, "slow request bodies closed"),
        },
    )
    options: dict[str, Any] = dict(
        host=server_config.host,
        port=server_config.port,
        http=protocol,
        log_level=server_config.uvicorn_log_level,
        timeout_keep_alive=server_config.timeout_keep_alive_s,
        limit_concurrency=server_config.limit_concurrency,
        # Room in the accept queue for a burst of every allowed connection at once (the kernel
        # caps it at net.core.somaxconn): past it a probe's SYN is dropped and retried in 1-3 s.
        backlog=max(2048, (server_config.limit_concurrency or 0) + NUM_RESERVED_PROBE_SLOTS),
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
