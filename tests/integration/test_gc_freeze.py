"""The served process freezes what start-up allocated, so a garbage collection set off by
parsing request bodies does not traverse the model's objects while /health waits."""

from __future__ import annotations

import gc
import signal
import time
from pathlib import Path

import pytest

from infer8.config import EngineArgs
from infer8.entrypoints.openai import api_server
from infer8.entrypoints.openai.cli_args import ServerConfig
from infer8.entrypoints.openai.http_server import DrainingServer


def test_start_up_objects_are_frozen_before_serving(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, float] = {}

    def run(self: DrainingServer, sockets: list[object]) -> None:
        seen["num_frozen"] = gc.get_freeze_count()
        start = time.perf_counter()
        gc.collect()
        seen["collect_s"] = time.perf_counter() - start
        for sock in sockets:
            sock.close()  # type: ignore[attr-defined]

    monkeypatch.setattr(DrainingServer, "run", run)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    num_frozen_before = gc.get_freeze_count()
    try:
        args = EngineArgs(model=str(llama_dir), dtype="float32", kv_cache_memory_bytes=8 << 20)
        assert api_server.run_server(args, ServerConfig(host="127.0.0.1", port=0)) == 0
    finally:
        gc.unfreeze()
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    # Everything alive at start-up (torch, the engine, the app: 100,000s of objects) is out of
    # the collector's way, so a full collection while serving has only requests' objects.
    assert seen["num_frozen"] > num_frozen_before + 100_000, seen
