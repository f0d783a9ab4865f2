"""Who can read the KV events: vLLM's default endpoint stays on loopback, and with CURVE keys only
the subscribers whose public key is allowed receive a batch (the events carry prompt token ids)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import zmq
import zmq.auth

from infer8.config import KVEventsConfig
from infer8.core import kv_events as records
from infer8.kv_events import (
    CURVE_PUBLIC_KEYS_DIR_ENV,
    CURVE_SECRET_KEY_FILE_ENV,
    END_SEQ,
    LOOPBACK_ENDPOINT,
    CurveKeys,
    ZmqEventPublisher,
    create_event_publisher,
    resolve_endpoint,
)
from tests.vllm_kv_events import DECODER

PROMPT = [101, 102, 103, 104]
needs_curve = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")


def test_vllms_default_endpoint_is_bound_on_loopback() -> None:
    config = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "zmq"}')
    assert config.endpoint == "tcp://*:5557"  # vLLM's default value, kept
    try:
        publisher = create_event_publisher(config)
    except ValueError as e:  # another process holds the port: nothing to inspect here
        pytest.skip(f"port 5557 is taken: {e}")
    try:
        assert isinstance(publisher, ZmqEventPublisher)
        assert publisher.endpoint == LOOPBACK_ENDPOINT == "tcp://127.0.0.1:5557"
    finally:
        publisher.shutdown()


@pytest.mark.parametrize(
    "endpoint, is_authenticated, expected",
    [
        ("tcp://*:5557", False, ("tcp://127.0.0.1:5557", True)),
        ("tcp://*:5557", True, ("tcp://*:5557", True)),  # subscribers must hold a key
        ("tcp://*:6000", False, ("tcp://*:6000", True)),  # named: opened as given
        ("tcp://0.0.0.0:5557", False, ("tcp://0.0.0.0:5557", True)),  # every address, bound
        ("tcp://epp.llm-d.svc:5557", False, ("tcp://epp.llm-d.svc:5557", False)),  # connected
        ("ipc:///run/kv", False, ("ipc:///run/kv", True)),
    ],
)
def test_only_vllms_default_is_moved_to_loopback(
    endpoint: str, is_authenticated: bool, expected: tuple[str, bool]
) -> None:
    assert resolve_endpoint(endpoint, is_authenticated) == expected


# -- CURVE ------------------------------------------------------------------------------------
def _keys(tmp_path: Path) -> tuple[CurveKeys, dict[str, Path]]:
    """Write the publisher's certificate and two subscribers' (one allowed); return the paths."""
    for name in ("publisher", "clients", "allowed"):
        (tmp_path / name).mkdir()
    zmq.auth.create_certificates(tmp_path / "publisher", "infer8")
    zmq.auth.create_certificates(tmp_path / "clients", "picker")
    zmq.auth.create_certificates(tmp_path / "clients", "stranger")
    shutil.copy(tmp_path / "clients" / "picker.key", tmp_path / "allowed" / "picker.key")
    paths = {
        "server_public": tmp_path / "publisher" / "infer8.key",
        "picker": tmp_path / "clients" / "picker.key_secret",
        "stranger": tmp_path / "clients" / "stranger.key_secret",
    }
    curve = CurveKeys(str(tmp_path / "publisher" / "infer8.key_secret"), str(tmp_path / "allowed"))
    return curve, paths


def _socket(ctx: zmq.Context, kind: int, server_public: Path, cert: Path | None) -> zmq.Socket:
    sock = ctx.socket(kind)
    if cert is not None:
        public, secret = zmq.auth.load_certificate(cert)
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = zmq.auth.load_certificate(server_public)[0]
    return sock


def _drain(sock: zmq.Socket, timeout_s: float) -> list[list[bytes]]:
    """Return what arrives within timeout_s (bounded: polls until quiet or the deadline)."""
    got = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and sock.poll(100):
        got.append(sock.recv_multipart())
    return got


@needs_curve
def test_with_curve_only_allowed_subscribers_receive_events(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    curve, paths = _keys(tmp_path)
    monkeypatch.setenv(CURVE_SECRET_KEY_FILE_ENV, curve.secret_key_file)
    monkeypatch.setenv(CURVE_PUBLIC_KEYS_DIR_ENV, curve.public_keys_dir)
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        topic="kv",
    )
    publisher = create_event_publisher(config)
    ctx = zmq.Context()
    subs = {
        name: _socket(ctx, zmq.SUB, paths["server_public"], cert)
        for name, cert in (("picker", paths["picker"]), ("stranger", paths["stranger"]))
    }
    subs["no key"] = _socket(ctx, zmq.SUB, paths["server_public"], None)
    try:
        for sub in subs.values():
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(config.endpoint)
        time.sleep(0.5)  # handshakes, then subscriptions (a PUB drops what precedes them)
        stored = records.BlockStored([bytes(32)], None, PROMPT, 4, [None])
        for _ in range(3):
            publisher.publish([stored], ts=1.0)
        got = {name: _drain(sub, 2.0 if name == "picker" else 0.5) for name, sub in subs.items()}
        assert len(got["picker"]) == 3
        (event,) = DECODER.decode(got["picker"][0][2]).events
        assert event.token_ids == PROMPT
        assert got["stranger"] == [] and got["no key"] == []
        # The replay socket is behind the same keys.
        for name, cert in (("picker", paths["picker"]), ("no key", None)):
            dealer = _socket(ctx, zmq.DEALER, paths["server_public"], cert)
            dealer.connect(config.replay_endpoint or "")
            dealer.send_multipart((b"", (0).to_bytes(8, "big")), flags=zmq.NOBLOCK)
            replies = _drain(dealer, 2.0 if name == "picker" else 0.5)
            dealer.close(linger=0)
            if name == "picker":
                assert [r[1] for r in replies] == [bytes(8), (1).to_bytes(8, "big"),
                                                   (2).to_bytes(8, "big"), END_SEQ]  # fmt: skip
            else:
                assert replies == []
    finally:
        publisher.shutdown()
        for sub in subs.values():
            sub.close(linger=0)
        ctx.term()


@needs_curve
def test_curve_settings_that_cannot_work_stop_start_up(tmp_path: Path) -> None:
    curve, _ = _keys(tmp_path)
    with pytest.raises(ValueError, match="need both"):
        CurveKeys.from_env({CURVE_SECRET_KEY_FILE_ENV: curve.secret_key_file})
    assert CurveKeys.from_env({}) is None
    public_only = str(tmp_path / "publisher" / "infer8.key")
    with pytest.raises(ValueError, match="no secret key"):
        CurveKeys(public_only, curve.public_keys_dir).load()
    with pytest.raises(ValueError, match="cannot read"):
        CurveKeys(str(tmp_path / "missing"), curve.public_keys_dir).load()
    (tmp_path / "empty").mkdir()
    for keys_dir in ("empty", "missing"):
        with pytest.raises(ValueError, match="no subscriber's public key"):
            CurveKeys(curve.secret_key_file, str(tmp_path / keys_dir)).load()
