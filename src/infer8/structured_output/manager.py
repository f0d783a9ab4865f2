"""StructuredOutputManager: compiled-grammar cache, per-request matchers, batched token bitmasks."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from infer8.structured_output.compile_pool import (
    CompileJob,
    GrammarCompilePool,
    GrammarTimeoutError,
    GrammarWorkerError,
    compile_with,
)
from infer8.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

    from infer8.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: "; the parser's message follows.
_ERROR_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")
# JSON grammars allow free whitespace between elements (vLLM's default), but at most this many
# characters in a row: enough for "\n" plus 4-space indentation three levels deep, and the
# bound that makes a schema with bounded strings and arrays a bounded output. Unbounded, a
# sampled model can spend its max_tokens on whitespace (one token may hold 81 spaces).
MAX_WHITESPACE_CHARS = 16
# A compile past this is killed (and refused, 400). Schemas, choices and regexes at the size
# limits compile in under 1 s on a 49k-token vocabulary; 10 s leaves room for 150k-token ones.
DEFAULT_COMPILE_TIMEOUT_S = 10.0
# Distinct grammars compiling (or queued for the compile process) at once; past it a 503.
DEFAULT_MAX_PENDING_COMPILES = 8
DEFAULT_MAX_CACHE_BYTES = 512 << 20
# A compiled grammar's resident memory is about twice its memory_size_bytes (measured on
# deserialized grammars of 3 MB and 38 MB: 5.8 MB and 74 MB of RSS each).
_RSS_PER_GRAMMAR_BYTE = 2


@dataclass
class StructuredOutputStats:
    """Counters of the compiled-grammar cache and of the per-step masking work."""

    num_compiles: int = 0
    num_cache_hits: int = 0
    num_errors: int = 0
    num_timeouts: int = 0  # compiles killed at the time limit (counted in num_errors too)
    num_busy: int = 0  # compiles refused because max_pending_compiles were in flight
    compile_time_s: float = 0.0
    num_masked_rows: int = 0  # constrained rows masked, summed over steps
    mask_time_s: float = 0.0  # filling and applying bitmasks
    accept_time_s: float = 0.0  # advancing matchers


class GrammarBusyError(RuntimeError):
    """Too many grammars are compiling now; the request may be retried (a 503, not a 400)."""


@dataclass
class _CacheEntry:
    future: Future[xgr.CompiledGrammar]
    num_bytes: int  # an estimate: the key while compiling, then the compiled grammar's


def grammar_error_message(error: BaseException) -> str:
    """Return the grammar parser's message without xgrammar's source-location prefix."""
    return _ERROR_PREFIX.sub("", str(error)).strip()


def choice_grammar(choices: list[str]) -> str:
    """Return an EBNF grammar whose only sentences are the given strings."""
    # EBNF string literals take JSON's escapes.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def compile_job(params: StructuredOutputsParams) -> CompileJob:
    """Return what xgrammar compiles for a constraint."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema: Any = params.json if kind == "json" else {"type": "object"}
        if params.disable_any_whitespace:
            return CompileJob("json", json.dumps(schema), any_whitespace=False)
        return CompileJob("json", json.dumps(schema), max_whitespace_cnt=MAX_WHITESPACE_CHARS)
    if kind == "regex":
        assert params.regex is not None
        return CompileJob("regex", params.regex)
    if kind == "choice":
        assert params.choice is not None
        return CompileJob("grammar", choice_grammar(params.choice))
    assert params.grammar is not None
    return CompileJob("grammar", params.grammar)


def grammar_num_bytes(key: str, compiled: xgr.CompiledGrammar) -> int:
    """Estimate the memory a cached grammar holds (its key and its token-mask cache)."""
    return len(key) + _RSS_PER_GRAMMAR_BYTE * compiled.memory_size_bytes


class StructuredOutputManager:
    """Owns the grammar compiler and its cache, and the matcher of each constrained request.

    `compile` may run on any thread (the server compiles before submitting, so the engine's
    add_request finds the grammar cached); matchers are touched only by the engine's thread.
    Grammars compile in a GrammarCompilePool's processes, killed past `compile_timeout_s`
    (None: in the calling thread, without a time limit). The cache keeps at most `max_cached`
    grammars and `max_cache_bytes` of them, evicting the least recently used.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_cached: int = 1024,
        max_cache_bytes: int = DEFAULT_MAX_CACHE_BYTES,
        compile_timeout_s: float | None = DEFAULT_COMPILE_TIMEOUT_S,
        max_pending_compiles: int = DEFAULT_MAX_PENDING_COMPILES,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_cached = max_cached
        self.max_cache_bytes = max_cache_bytes
        self.compile_timeout_s = compile_timeout_s
        self.max_pending_compiles = max_pending_compiles
        self.stats = StructuredOutputStats()
        self._lock = threading.Lock()
        self._tokenizer_info: xgr.TokenizerInfo | None = None
        self._compiler: xgr.GrammarCompiler | None = None
        self._pool: GrammarCompilePool | None = None
        self._threads: ThreadPoolExecutor | None = None  # for `submit`'s compiles
        self._num_compiling = 0
        self._batch_matcher: xgr.BatchGrammarMatcher | None = None
        self._cache: OrderedDict[str, _CacheEntry] = OrderedDict()
        self.cache_bytes = 0  # the sum of the entries' num_bytes
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(vocab / 32)] int32, reused

    # -- compilation (any thread) ---------------------------------------------------------
    def _get_tokenizer_info(self) -> xgr.TokenizerInfo:
        with self._lock:
            if self._tokenizer_info is None:
                from infer8.structured_output.tokenizer_info import build_tokenizer_info

                self._tokenizer_info = build_tokenizer_info(self.tokenizer, self.vocab_size)
            return self._tokenizer_info

    def _compile_uncached(self, job: CompileJob) -> xgr.CompiledGrammar:
        info = self._get_tokenizer_info()
        timeout_s = self.compile_timeout_s
        with self._lock:
            if timeout_s is not None and self._pool is None:
                self._pool = GrammarCompilePool(info)
            if timeout_s is None and self._compiler is None:
                import xgrammar as xgr

                # infer8 keeps its own cache (to count hits and bound it); xgrammar's is off.
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            pool, compiler = self._pool, self._compiler
        if timeout_s is not None:
            assert pool is not None
            return pool.compile(job, timeout_s)
        assert compiler is not None
        return compile_with(compiler, job)

    def _reserve(
        self, key: str, refuse_when_busy: bool
    ) -> tuple[Future[xgr.CompiledGrammar], bool]:
        """Return the cached or pending future of a key, or a new one the caller must fulfil."""
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                self.stats.num_cache_hits += 1
                return entry.future, False
            if refuse_when_busy and self._num_compiling >= self.max_pending_compiles:
                self.stats.num_busy += 1
                raise GrammarBusyError(f"{self._num_compiling} grammars are compiling; retry later")
            self._num_compiling += 1
            entry = _CacheEntry(Future(), len(key))
            self._cache[key] = entry
            self.cache_bytes += entry.num_bytes
            self._evict()
            return entry.future, True

    def _evict(self) -> None:
        """Drop least recently used entries past max_cached or max_cache_bytes (lock held)."""
        while self._cache and (
            len(self._cache) > self.max_cached or self.cache_bytes > self.max_cache_bytes
        ):
            _, entry = self._cache.popitem(last=False)
            self.cache_bytes -= entry.num_bytes

    def _fulfil(self, params: StructuredOutputsParams, future: Future[xgr.CompiledGrammar]) -> None:
        """Compile a reserved key and settle its future (errors are cached as ValueError)."""
        key = params.key
        t0 = time.perf_counter()
        num_bytes = len(key)
        try:
            compiled = self._compile_uncached(compile_job(params))
            num_bytes = grammar_num_bytes(key, compiled)
            future.set_result(compiled)
        except GrammarTimeoutError as e:
            message = f"the {params.kind} constraint is too costly to compile: {e}"
            future.set_exception(GrammarTimeoutError(message))
            num_bytes += len(message)
            with self._lock:
                self.stats.num_errors += 1
                self.stats.num_timeouts += 1
        except GrammarWorkerError as e:  # not the grammar's fault: not cached
            future.set_exception(GrammarBusyError(str(e)))
            num_bytes = -1
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for bad input
            message = f"invalid {params.kind} constraint: {grammar_error_message(e)}"
            future.set_exception(ValueError(message))
            num_bytes += len(message)
            with self._lock:
                self.stats.num_errors += 1
        finally:
            with self._lock:
                self._num_compiling -= 1
                self.stats.num_compiles += 1
                self.stats.compile_time_s += time.perf_counter() - t0
                entry = self._cache.get(key)
                if entry is not None and entry.future is future:
                    if num_bytes < 0:
                        del self._cache[key]
                        self.cache_bytes -= entry.num_bytes
                    else:
                        self.cache_bytes += num_bytes - entry.num_bytes
                        entry.num_bytes = num_bytes
                        self._evict()

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Return the compiled grammar of a constraint, compiling it once; ValueError if invalid.

        Compiles in the calling thread's turn (never refused as busy): the engine's thread
        calls this for a grammar evicted since the server compiled it.
        """
        future, is_owner = self._reserve(params.key, refuse_when_busy=False)
        if is_owner:
            self._fulfil(params, future)
        return future.result()

    def submit(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """Return a future of the compiled grammar, compiled in the manager's threads.

        GrammarBusyError when `max_pending_compiles` compiles are in flight: a flood of
        distinct grammars is refused at once instead of queueing behind the time limit.
        """
        future, is_owner = self._reserve(params.key, refuse_when_busy=True)
        if is_owner:
            with self._lock:
                if self._threads is None:
                    self._threads = ThreadPoolExecutor(
                        self.max_pending_compiles, thread_name_prefix="infer8-grammar"
                    )
            self._threads.submit(self._fulfil, params, future)
        return future

    def close(self) -> None:
        """Stop the compile processes (idempotent; a later compile starts them again)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    # -- per-request matchers (the engine's thread) ---------------------------------------
    def add_request(self, req_id: str, params: StructuredOutputsParams) -> None:
        """Start a matcher for a request (compiling its grammar unless cached)."""
        import xgrammar as xgr

        self._matchers[req_id] = xgr.GrammarMatcher(self.compile(params))

    def remove_request(self, req_id: str) -> None:
        """Drop a finished or aborted request's matcher."""
        self._matchers.pop(req_id, None)

    @property
    def num_requests(self) -> int:
        """Return how many requests have a live matcher."""
        return len(self._matchers)

    def _bitmask_rows(self, num_rows: int) -> torch.Tensor:
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = xgr.allocate_token_bitmask(max(num_rows, 64), self.vocab_size)
        return self._bitmask[:num_rows]

    def apply_bitmask(self, logits: torch.Tensor, req_ids: list[str]) -> None:
        """Mask, in place, the tokens each constrained row's grammar forbids (one batched op).

        logits: [len(req_ids), vocab], one row per sampled request. Unconstrained rows are
        untouched, and a batch without constrained requests costs one dict check.
        """
        if not self._matchers:
            return
        rows = [i for i, req_id in enumerate(req_ids) if req_id in self._matchers]
        if not rows:
            return
        import xgrammar as xgr

        t0 = time.perf_counter()
        if self._batch_matcher is None:
            self._batch_matcher = xgr.BatchGrammarMatcher()
        bitmask = self._bitmask_rows(len(req_ids))
        matchers = [self._matchers[req_ids[i]] for i in rows]
        self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
        self.stats.num_masked_rows += len(rows)
        self.stats.mask_time_s += time.perf_counter() - t0

    def accept_tokens(self, req_id: str, token_ids: list[int]) -> bool:
        """Advance a request's matcher; return True when its grammar has ended the request.

        The grammar ends a request once it accepted a stop token (its sentence is complete),
        or, defensively, if a token it forbade was sampled anyway.
        """
        matcher = self._matchers.get(req_id)
        if matcher is None:
            return False
        t0 = time.perf_counter()
        try:
            for token_id in token_ids:
                if not matcher.accept_token(token_id):
                    logger.warning(
                        "request %s: token %d violates its grammar; stopping", req_id, token_id
                    )
                    return True
                if matcher.is_terminated():
                    return True
            return False
        finally:
            self.stats.accept_time_s += time.perf_counter() - t0
