"""The loading thread's OpenMP workers are freed before the engine thread computes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from infer8.cpu_threads import loaded_openmp_library, release_openmp_workers
from infer8.entrypoints import async_engine

# Run in a fresh interpreter: the test process's other threads would blur the thread counts.
_SCRIPT = textwrap.dedent(
    """
    import os, time, torch
    from infer8.cpu_threads import release_openmp_workers

    def num_threads():
        return len(os.listdir("/proc/self/task"))

    def settle(expected):
        deadline = time.monotonic() + 10
        while num_threads() != expected and time.monotonic() < deadline:
            time.sleep(0.01)
        return num_threads()

    torch.set_num_threads(3)
    alone = num_threads()
    x = torch.ones(1 << 22)
    assert float((x * 2).sum()) == 2 * (1 << 22)  # a parallel region: this thread's pool
    with_pool = settle(alone + 2)
    assert release_openmp_workers()
    released = settle(alone)
    assert float((x * 3).sum()) == 3 * (1 << 22)  # still computes, with a new pool
    print(alone, with_pool, released, settle(alone + 2))
    """
)


def test_release_frees_the_calling_threads_openmp_workers() -> None:
    assert loaded_openmp_library() is not None  # torch's CPU build brings libgomp
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    alone, with_pool, released, again = map(int, done.stdout.split())
    assert with_pool == alone + 2  # three OpenMP threads: this one and two workers
    assert released == alone  # the two workers exited
    assert again == alone + 2


def test_engine_thread_starts_after_the_release(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def record() -> bool:
        calls.append([t.name for t in threading.enumerate()])
        return True

    monkeypatch.setattr(async_engine, "release_openmp_workers", record)

    class IdleEngine:  # what the engine thread touches while it has nothing to do
        def has_unfinished_requests(self) -> bool:
            return False

    client = async_engine.AsyncLLMEngine(IdleEngine())  # type: ignore[arg-type]
    client.start()
    try:
        assert len(calls) == 1
        assert "infer8-engine" not in calls[0]
        assert any(t.name == "infer8-engine" for t in threading.enumerate())
    finally:
        client.shutdown(timeout_s=5)


def test_release_without_openmp_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("infer8.cpu_threads.loaded_openmp_library", lambda: None)
    assert release_openmp_workers() is False
