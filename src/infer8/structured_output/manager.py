"""StructuredOutputManager: compiled-grammar cache, per-request matchers, batched token bitmasks."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

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


@dataclass
class StructuredOutputStats:
    """Counters of the compiled-grammar cache and of the per-step masking work."""

    num_compiles: int = 0
    num_cache_hits: int = 0
    num_errors: int = 0
    compile_time_s: float = 0.0
    num_masked_rows: int = 0  # constrained rows masked, summed over steps
    mask_time_s: float = 0.0  # filling and applying bitmasks
    accept_time_s: float = 0.0  # advancing matchers


def grammar_error_message(error: BaseException) -> str:
    """Return the grammar parser's message without xgrammar's source-location prefix."""
    return _ERROR_PREFIX.sub("", str(error)).strip()


def choice_grammar(choices: list[str]) -> str:
    """Return an EBNF grammar whose only sentences are the given strings."""
    # EBNF string literals take JSON's escapes.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class StructuredOutputManager:
    """Owns the grammar compiler and its cache, and the matcher of each constrained request.

    `compile` may run on any thread (the server compiles before submitting, so the engine's
    add_request finds the grammar cached); matchers are touched only by the engine's thread.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_cached: int = 1024) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_cached = max_cached
        self.stats = StructuredOutputStats()
        self._lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None
        self._batch_matcher: xgr.BatchGrammarMatcher | None = None
        self._cache: OrderedDict[str, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(vocab / 32)] int32, reused

    # -- compilation (any thread) ---------------------------------------------------------
    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                from infer8.structured_output.tokenizer_info import build_tokenizer_info

                info = build_tokenizer_info(self.tokenizer, self.vocab_size)
                # infer8 keeps its own cache (to count hits and bound it); xgrammar's is off.
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    def _compile_uncached(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        compiler = self._get_compiler()
        kind = params.kind
        if kind in ("json", "json_object"):
            schema: Any = params.json if kind == "json" else {"type": "object"}
            if params.disable_any_whitespace:
                return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
            return compiler.compile_json_schema(
                json.dumps(schema), any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE_CHARS
            )
        if kind == "regex":
            assert params.regex is not None
            return compiler.compile_regex(params.regex)
        if kind == "choice":
            assert params.choice is not None
            return compiler.compile_grammar(choice_grammar(params.choice))
        assert params.grammar is not None
        return compiler.compile_grammar(params.grammar)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Return the compiled grammar of a constraint, compiling it once; ValueError if invalid."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            is_owner = future is None
            if future is None:
                future = Future()
                self._cache[key] = future
                while len(self._cache) > self.max_cached:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
                self.stats.num_cache_hits += 1
        if is_owner:
            t0 = time.perf_counter()
            try:
                future.set_result(self._compile_uncached(params))
            except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for bad input
                message = f"invalid {params.kind} constraint: {grammar_error_message(e)}"
                future.set_exception(ValueError(message))
                with self._lock:
                    self.stats.num_errors += 1
            finally:
                with self._lock:
                    self.stats.num_compiles += 1
                    self.stats.compile_time_s += time.perf_counter() - t0
        return future.result()

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

    def has_request(self, req_id: str) -> bool:
        """Return whether a request is constrained."""
        return req_id in self._matchers

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
