"""Publish the prefix cache's events over ZeroMQ in vLLM's wire format, off the engine's thread.

KV-aware routers (llm-d's endpoint picker behind the Gateway API Inference Extension, Dynamo's
router) subscribe to what vLLM publishes with `--kv-events-config`; this module sends the same
bytes. Wire format (vLLM's `vllm/distributed/kv_events.py`, read from its source):

- one ZeroMQ multipart message per engine step that changed the cache:
  `[topic, seq (8 bytes, big-endian, from 0), payload]` on a PUB socket;
- payload: msgpack of `KVEventBatch` = the array `[ts, events, data_parallel_rank]`
  (msgspec `array_like`), each event a map tagged by its class name under "type"
  (`{"type": "BlockStored", "block_hashes": [...], ...}`), as vLLM encodes events since it
  dropped `array_like` from them (vllm-project/vllm#42892);
- block hashes: infer8's are sha256 chains (infer8/core/block_pool.py); like vLLM by default
  (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`) each is sent as the unsigned int of its digest's low
  64 bits (the last 8 bytes, big-endian); with that variable set to 0, as the 32 digest bytes;
- replay: with `replay_endpoint`, a ROUTER socket answers a request `[start_seq (8 bytes)]`
  (from a REQ or DEALER socket) with `[seq, payload]` for each buffered batch from start_seq
  on, then `[-1 (8 bytes, signed), b""]`.

The stream carries every request's prompt token ids, whichever API key sent it. So vLLM's
default endpoint (`tcp://*:5557`) is bound on loopback only, unless subscribers must
authenticate with ZeroMQ's CURVE (`CurveKeys`: the publisher's certificate and the public keys of
the subscribers allowed, ZeroMQ's "ironhouse" pattern); any other endpoint is opened as given.

pyzmq and msgspec are imported only when a publisher is built.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from infer8.config import KVEventsConfig
from infer8.core import kv_events as records

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
# vLLM's default endpoint, and where infer8 binds it without CURVE: KVEventsConfig cannot tell
# the default from the same value typed, so both mean loopback (`tcp://0.0.0.0:5557` binds every
# address).
VLLM_DEFAULT_ENDPOINT = "tcp://*:5557"
LOOPBACK_ENDPOINT = "tcp://127.0.0.1:5557"
# infer8's own settings (vLLM has no authenticated transport for its events).
CURVE_SECRET_KEY_FILE_ENV = "INFER8_KV_EVENTS_CURVE_SECRET_KEY_FILE"
CURVE_PUBLIC_KEYS_DIR_ENV = "INFER8_KV_EVENTS_CURVE_PUBLIC_KEYS_DIR"
_LOOPBACK_HOSTS = ("127.", "[::1]", "localhost")


class EventPublisher(Protocol):
    """Takes one engine step's events; never blocks the step on the network."""

    def publish(self, events: Sequence[records.KVCacheEvent], ts: float) -> None: ...

    def shutdown(self) -> None: ...


class NullEventPublisher:
    """Drops every event (events off)."""

    def publish(self, events: Sequence[records.KVCacheEvent], ts: float) -> None:
        """Drop the events."""

    def shutdown(self) -> None:
        """Nothing to stop."""


def _wire_types() -> dict[str, Any]:
    """Return vLLM's event structs, declared with msgspec (field order and options matter)."""
    import msgspec

    class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int | bytes]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return {
        "KVEventBatch": KVEventBatch,
        "BlockStored": BlockStored,
        "BlockRemoved": BlockRemoved,
        "AllBlocksCleared": AllBlocksCleared,
        "encoder": msgspec.msgpack.Encoder(),
    }


class KVEventEncoder:
    """Turns infer8's event records into vLLM's msgpack payload."""

    def __init__(self, use_int_block_hashes: bool = True, data_parallel_rank: int = 0) -> None:
        self.use_int_block_hashes = use_int_block_hashes
        self.data_parallel_rank = data_parallel_rank
        self._types = _wire_types()

    def external_hash(self, block_hash: records.BlockHash) -> int | bytes:
        """Return the hash as vLLM sends it: the digest's low 64 bits, or its bytes."""
        if not self.use_int_block_hashes:
            return block_hash
        return int.from_bytes(block_hash[-8:], "big")

    def encode(self, events: Sequence[records.KVCacheEvent], ts: float) -> bytes:
        """Return the msgpack bytes of one KVEventBatch."""
        t, h = self._types, self.external_hash
        wire: list[Any] = []
        for event in events:
            if isinstance(event, records.BlockStored):
                parent = event.parent_block_hash
                wire.append(
                    t["BlockStored"](
                        block_hashes=[h(x) for x in event.block_hashes],
                        parent_block_hash=None if parent is None else h(parent),
                        token_ids=event.token_ids,
                        block_size=event.block_size,
                        lora_id=event.lora_id,
                        medium=event.medium,
                        lora_name=event.lora_name,
                        extra_keys=event.extra_keys,
                        group_idx=0,
                        kv_cache_spec_kind="full_attention",
                    )
                )
            elif isinstance(event, records.BlockRemoved):
                wire.append(
                    t["BlockRemoved"](
                        block_hashes=[h(x) for x in event.block_hashes],
                        medium=event.medium,
                        group_idx=0,
                    )
                )
            else:
                wire.append(t["AllBlocksCleared"]())
        batch = t["KVEventBatch"](ts=ts, events=wire, data_parallel_rank=self.data_parallel_rank)
        return t["encoder"].encode(batch)


def _should_bind(endpoint: str) -> bool:
    """Return whether to bind (a wildcard address or a local transport) rather than connect."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("tcp://0.0.0.0:")
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


def resolve_endpoint(endpoint: str, is_authenticated: bool) -> tuple[str, bool]:
    """Return the endpoint to open and whether to bind it (else connect).

    vLLM's default is bound on loopback unless subscribers must authenticate; any other endpoint
    is opened as given (bound when it holds a wildcard or is a local transport, as vLLM does).
    """
    if endpoint == VLLM_DEFAULT_ENDPOINT and not is_authenticated:
        return LOOPBACK_ENDPOINT, True
    return endpoint, _should_bind(endpoint)


def _is_local(endpoint: str) -> bool:
    """Return whether only this host can reach the endpoint (loopback TCP, ipc, inproc)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    return endpoint.startswith("tcp://") and endpoint[6:].startswith(_LOOPBACK_HOSTS)


@dataclass(frozen=True)
class CurveKeys:
    """ZeroMQ CURVE for the event sockets: the publisher's certificate, the subscribers allowed.

    `secret_key_file` is a certificate as `zmq.auth.create_certificates` writes it (the
    `.key_secret` file: public and secret key); `public_keys_dir` holds the `.key` certificate
    of each subscriber allowed to connect. A peer without CURVE, or with a key not in the
    directory, completes no handshake and receives nothing.
    """

    secret_key_file: str
    public_keys_dir: str

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> CurveKeys | None:
        """Return the keys named by the INFER8_KV_EVENTS_CURVE_* variables (None: no CURVE)."""
        secret = environ.get(CURVE_SECRET_KEY_FILE_ENV, "")
        public = environ.get(CURVE_PUBLIC_KEYS_DIR_ENV, "")
        if not secret and not public:
            return None
        if not secret or not public:
            raise ValueError(
                f"KV events over CURVE need both {CURVE_SECRET_KEY_FILE_ENV} (the publisher's "
                f"certificate) and {CURVE_PUBLIC_KEYS_DIR_ENV} (the subscribers' public keys)"
            )
        return cls(secret, public)

    def load(self) -> tuple[bytes, bytes]:
        """Return the publisher's (public, secret) key; ValueError if either place is unusable."""
        import zmq
        import zmq.auth

        if not zmq.has("curve"):
            raise ValueError("KV events over CURVE: this libzmq was built without CURVE")
        try:
            public, secret = zmq.auth.load_certificate(self.secret_key_file)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"{CURVE_SECRET_KEY_FILE_ENV}: cannot read {self.secret_key_file}: {e}"
            ) from None
        if secret is None:
            raise ValueError(
                f"{CURVE_SECRET_KEY_FILE_ENV}: {self.secret_key_file} holds no secret key "
                "(give the .key_secret file)"
            )
        keys_dir = Path(self.public_keys_dir)
        if not keys_dir.is_dir() or not any(keys_dir.glob("*.key")):
            raise ValueError(
                f"{CURVE_PUBLIC_KEYS_DIR_ENV}: {self.public_keys_dir} holds no subscriber's "
                "public key (*.key)"
            )
        return public, secret


_Batch = tuple[Sequence[records.KVCacheEvent], float]


class ZmqEventPublisher:
    """Owns the PUB (and replay ROUTER) sockets and the thread that encodes and sends batches.

    The engine's `publish` only enqueues (a bounded queue: when the thread falls
    `max_queue_size` batches behind, the engine waits rather than drop events silently). The
    sockets are made and bound here, so a bad endpoint fails at start-up, and are used only by
    the thread afterwards. Sequence numbers count sent batches from 0; the last
    `buffer_steps` payloads are kept for replay.
    """

    POLL_S = 0.05

    def __init__(
        self,
        config: KVEventsConfig,
        use_int_block_hashes: bool = True,
        data_parallel_rank: int = 0,
        curve: CurveKeys | None = None,
    ) -> None:
        import zmq

        self._zmq = zmq
        self.encoder = KVEventEncoder(use_int_block_hashes, data_parallel_rank)
        self._topic = config.topic.encode("utf-8")
        self._queue: queue.Queue[_Batch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        server_keys = None if curve is None else curve.load()  # before any socket or thread
        endpoint, should_bind = resolve_endpoint(config.endpoint, curve is not None)
        self._ctx = zmq.Context()
        self._auth: Any = None
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: Any = None
        try:
            if curve is not None:
                self._start_authenticator(curve.public_keys_dir)
            _make_curve_server(self._pub, server_keys)
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            if should_bind:
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                _make_curve_server(self._replay, server_keys)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"--kv-events-config: cannot open {endpoint}: {e}") from e
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (
            None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        )
        self._is_closed = False
        self._thread = threading.Thread(target=self._run, name="infer8-kv-events", daemon=True)
        self._thread.start()
        self._log_exposure(config.endpoint, curve is not None, should_bind)

    def _start_authenticator(self, public_keys_dir: str) -> None:
        """Start ZeroMQ's authenticator: only CURVE peers whose key is in the directory pass."""
        from zmq.auth.thread import ThreadAuthenticator

        self._auth = ThreadAuthenticator(self._ctx)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=public_keys_dir)

    def _log_exposure(self, configured: str, is_authenticated: bool, is_bound: bool) -> None:
        """Say where events go and, when anyone who reaches a socket may read them, so."""
        opened = [self.endpoint] + ([self.replay_endpoint] if self.replay_endpoint else [])
        how = "CURVE-authenticated subscribers only" if is_authenticated else "no authentication"
        logger.info("publishing KV cache events on %s (%s)", ", ".join(opened), how)
        if configured == VLLM_DEFAULT_ENDPOINT and not is_authenticated:
            logger.info(
                "KV events: %s (vLLM's default) is bound on loopback only, since the events carry "
                "every prompt's token ids; to publish beyond this host set %s and %s, or name "
                "the address (e.g. tcp://0.0.0.0:5557)",
                VLLM_DEFAULT_ENDPOINT, CURVE_SECRET_KEY_FILE_ENV, CURVE_PUBLIC_KEYS_DIR_ENV,
            )  # fmt: skip
        listening = opened if is_bound else opened[1:]  # a connected socket sends to one peer
        exposed = [e for e in listening if not _is_local(e)]
        if exposed and not is_authenticated:
            logger.warning(
                "KV events on %s are unauthenticated: whoever reaches it reads every request's "
                "prompt token ids; set %s and %s to require CURVE keys",
                ", ".join(exposed), CURVE_SECRET_KEY_FILE_ENV, CURVE_PUBLIC_KEYS_DIR_ENV,
            )  # fmt: skip

    def publish(self, events: Sequence[records.KVCacheEvent], ts: float) -> None:
        """Queue one step's events for the thread (waits only if it is far behind)."""
        if self._is_closed:
            return
        self._queue.put((events, ts))

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Send what is queued, stop the thread and close the sockets."""
        if self._is_closed:
            return
        self._is_closed = True
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("the KV events thread did not stop within %.1f s", timeout_s)
            return  # it still uses the sockets; it is a daemon thread
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    def _run(self) -> None:
        seq = itertools.count()
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except Exception:  # noqa: BLE001 - a bad replay request must not stop events
                    logger.exception("KV events replay failed")
            try:
                item = self._queue.get(timeout=self.POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            try:
                payload = self.encoder.encode(*item)
                n = next(seq)
                self._pub.send_multipart((self._topic, n.to_bytes(8, "big"), payload))
                self._buffer.append((n, payload))
            except Exception:  # noqa: BLE001 - keep publishing later steps
                logger.exception("publishing KV cache events failed")
                time.sleep(self.POLL_S)

    def _serve_replay(self) -> None:
        """Answer one replay request with the buffered batches from its start_seq on."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignoring a malformed KV events replay request (%d frames)", len(frames))
            return
        client_id, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for n, payload in list(self._buffer):
            if n >= start_seq:
                self._replay.send_multipart((client_id, b"", n.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client_id, b"", END_SEQ, b""))


def use_int_block_hashes_from_env() -> bool:
    """Return vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES setting (default on: ints)."""
    return bool(int(os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")))


def _make_curve_server(sock: Any, keys: tuple[bytes, bytes] | None) -> None:
    """Make a socket the CURVE server side with (public, secret) keys; None: no CURVE."""
    if keys is not None:  # set before the socket binds or connects
        sock.curve_publickey, sock.curve_secretkey = keys
        sock.curve_server = True


def create_event_publisher(config: KVEventsConfig) -> EventPublisher:
    """Return the publisher `config` asks for (a no-op one unless events are enabled)."""
    if not config.is_enabled:
        return NullEventPublisher()
    return ZmqEventPublisher(
        config, use_int_block_hashes=use_int_block_hashes_from_env(), curve=CurveKeys.from_env()
    )
