"""GrammarCompilePool: grammars compile in child processes, where a compile past its time limit
is killed (xgrammar's compile cannot be interrupted in a thread, and size alone does not bound
its time: `.{0,1000}` costs seconds in 9 characters). Run as a module, this file is the child.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)

# Importing xgrammar (and torch under it) takes a child 2.5-4 s on 2 cores.
STARTUP_TIMEOUT_S = 300.0
# Compiles yield the CPU to the server's event loop and engine on a loaded machine.
_CHILD_NICENESS = 5


class GrammarTimeoutError(ValueError):
    """A grammar that did not compile within the time limit (its compile was killed)."""


class GrammarWorkerError(RuntimeError):
    """A compile process that failed to start or died (not the grammar's fault)."""


@dataclass(frozen=True)
class CompileJob:
    """What to compile: kind is regex, grammar (EBNF) or json (a schema as JSON text)."""

    kind: str
    source: str
    any_whitespace: bool = True
    max_whitespace_cnt: int | None = None


class _Worker:
    """One child process and the connection to it."""

    def __init__(self, tokenizer_info_json: str, max_threads: int) -> None:
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        # The child imports this package from where the parent did (a checkout or site-packages).
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(child_sock.fileno())],
            pass_fds=(child_sock.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C for the server is not sent to its compiles
        )
        child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self.conn.send((tokenizer_info_json, max_threads))
        self.is_ready = False

    def run(self, job: CompileJob, timeout_s: float) -> tuple[str, str]:
        """Return ("ok", serialized grammar) or ("error", message); kill the child on timeout."""
        if not self.is_ready:
            self._wait_ready()
        try:
            self.conn.send(job)
            if not self.conn.poll(timeout_s):
                self.kill()
                raise GrammarTimeoutError(f"the grammar did not compile within {timeout_s:g} s")
            status, payload = self.conn.recv()
        except (OSError, EOFError) as e:
            self.kill()
            raise GrammarWorkerError(f"the grammar compile process died: {e!r}") from None
        return status, payload

    def _wait_ready(self) -> None:
        t0 = time.perf_counter()
        try:
            is_ready = self.conn.poll(STARTUP_TIMEOUT_S) and self.conn.recv() == ("ready", None)
        except (OSError, EOFError):
            is_ready = False
        if not is_ready:
            self.kill()
            raise GrammarWorkerError("the grammar compile process did not start")
        self.is_ready = True
        elapsed_s = time.perf_counter() - t0
        logger.info("grammar compile process %d started in %.1f s", self.process.pid, elapsed_s)

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """Stop the child at once (a runaway compile cannot be asked to stop)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.conn.close()


class GrammarCompilePool:
    """Owns up to `num_workers` compile processes, started on first use and after a kill.

    `compile` may run on any thread; it blocks while every process is busy, so callers bound
    how many wait (StructuredOutputManager refuses compiles past its limit).
    """

    def __init__(
        self, tokenizer_info: xgr.TokenizerInfo, num_workers: int = 1, max_threads: int = 2
    ) -> None:
        self.tokenizer_info = tokenizer_info
        self.max_threads = max_threads
        self._info_json: str | None = None
        self._workers: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        for _ in range(num_workers):
            self._workers.put(None)  # a slot whose process starts when first needed
        self.num_kills = 0

    def compile(self, job: CompileJob, timeout_s: float) -> xgr.CompiledGrammar:
        """Return the compiled grammar; ValueError if invalid, GrammarTimeoutError past timeout_s."""
        import xgrammar as xgr

        worker = self._workers.get()
        try:
            if worker is None or not worker.is_alive():
                if self._info_json is None:
                    self._info_json = self.tokenizer_info.serialize_json()
                worker = _Worker(self._info_json, self.max_threads)
            try:
                status, payload = worker.run(job, timeout_s)
            except (GrammarTimeoutError, GrammarWorkerError):
                # The replacement starts now (its imports take seconds), not at the next compile.
                assert self._info_json is not None
                worker = _Worker(self._info_json, self.max_threads)
                self.num_kills += 1
                raise
        finally:
            self._workers.put(worker)
        if status != "ok":
            raise ValueError(payload)
        # Deserializing releases the GIL (as compiling does): the event loop runs on meanwhile.
        return xgr.CompiledGrammar.deserialize_json(payload, self.tokenizer_info)

    def close(self) -> None:
        """Stop every idle compile process (a busy one stops when its caller returns)."""
        while True:
            try:
                worker = self._workers.get_nowait()
            except queue.Empty:
                return
            if worker is not None:
                worker.kill()


def compile_with(compiler: xgr.GrammarCompiler, job: CompileJob) -> xgr.CompiledGrammar:
    """Compile one job with an xgrammar compiler (in the child, or in-thread without a pool)."""
    if job.kind == "regex":
        return compiler.compile_regex(job.source)
    if job.kind == "grammar":
        return compiler.compile_grammar(job.source)
    assert job.kind == "json", job.kind
    kwargs: dict[str, Any] = {"any_whitespace": job.any_whitespace}
    if job.max_whitespace_cnt is not None:
        kwargs["max_whitespace_cnt"] = job.max_whitespace_cnt
    return compiler.compile_json_schema(job.source, **kwargs)


def _serve(conn: Connection) -> None:
    """The child: build a compiler, then compile jobs until the parent closes the connection."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(_CHILD_NICENESS)
    info_json, max_threads = conn.recv()
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = ("ok", compile_with(compiler, job).serialize_json())
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for bad input
            reply = ("error", str(e))
        conn.send(reply)


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
