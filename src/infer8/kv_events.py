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
from collections.abc import Sequence
from typing import Any, Protocol

from infer8.config import KVEventsConfig
from infer8.core import kv_events as records

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


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
                        lora_id=None,
                        medium=event.medium,
                        lora_name=None,
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
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


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
    ) -> None:
        import zmq

        self._zmq = zmq
        self.encoder = KVEventEncoder(use_int_block_hashes, data_parallel_rank)
        self._topic = config.topic.encode("utf-8")
        self._queue: queue.Queue[_Batch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: Any = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            if _should_bind(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"--kv-events-config: cannot open {config.endpoint}: {e}") from e
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (
            None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        )
        self._is_closed = False
        self._thread = threading.Thread(target=self._run, name="infer8-kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV cache events on %s", self.endpoint)

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


def create_event_publisher(config: KVEventsConfig) -> EventPublisher:
    """Return the publisher `config` asks for (a no-op one unless events are enabled)."""
    if not config.is_enabled:
        return NullEventPublisher()
    return ZmqEventPublisher(config, use_int_block_hashes=use_int_block_hashes_from_env())
