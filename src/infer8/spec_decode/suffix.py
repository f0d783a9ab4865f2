"""Suffix decoding: drafts from what followed the latest tokens' earlier occurrences, in the
request's own tokens and in a bounded cache of earlier responses, as long as that continuation
stays likely (vLLM's suffix method and options, after Arctic Inference's SuffixDecoding; one
chain per step, not a tree).

A suffix tree answers "where did these tokens occur before, and what followed, how often" by
walking nodes; here the same counts come from numpy searches over token arrays (memory: the
tokens themselves, not a node per suffix and depth): the occurrences of the context's last
token, how far back each matches the context (up to max_depth tokens), and, for the matches
of a length, the continuation tokens counted step by step.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from infer8.spec_decode.ngram import TokenBuffers, match_lengths

# The response cache: the outputs of the last max_cached_requests finished requests, at most
# this many tokens (the oldest overwritten first): recent conversations are what repeat, and a
# bounded array keeps each search at tens of microseconds.
CACHE_TOKENS = 1 << 16
_SEPARATOR = -1
_MAX_CANDIDATES = 4


def _chain(
    tokens: np.ndarray, ends: np.ndarray, max_tokens: int, min_prob: float
) -> tuple[list[int], float]:
    """Follow the most frequent continuation after the match ends `ends` (positions in
    `tokens` of each occurrence's last matched token) while its estimated probability (the
    share of the occurrences still agreeing) stays >= min_prob; return it and its expected
    accepted length (the sum of the prefix probabilities)."""
    out: list[int] = []
    prob, expected = 1.0, 0.0
    n = len(tokens)
    while len(out) < max_tokens:
        nxt = ends + 1
        nxt = nxt[nxt < n]
        if len(nxt) == 0:
            break
        following = tokens[nxt]
        nxt, following = nxt[following != _SEPARATOR], following[following != _SEPARATOR]
        if len(following) == 0:
            break
        values, counts = np.unique(following, return_counts=True)
        best = int(counts.argmax())
        prob *= counts[best] / len(ends)
        if prob < min_prob:
            break
        out.append(int(values[best]))
        expected += prob
        ends = nxt[following == values[best]]
    return out, expected


class SuffixProposer:
    """Owns each running request's tokens (as arrays) and the response cache; proposes from
    whichever of the two promises the longer accepted draft."""

    def __init__(
        self, max_depth: int, max_cached_requests: int, max_spec_factor: float, min_prob: float
    ) -> None:
        self.max_depth = max_depth
        self.max_spec_factor, self.min_prob = max_spec_factor, min_prob
        self.max_cached_requests = max_cached_requests
        self.buffers = TokenBuffers()
        self.cache = np.full(CACHE_TOKENS, _SEPARATOR, np.int64)
        self._head = 0  # where the next response is written
        self._cached: deque[tuple[int, int]] = deque()  # (start, length), oldest first

    def propose(
        self, req_id: str, prompt_ids: list[int], output_ids: list[int], max_num_tokens: int
    ) -> list[int]:
        """Return up to `max_num_tokens` drafts after the request's tokens (maybe none)."""
        tokens = self.buffers.sync(req_id, prompt_ids, output_ids)
        if max_num_tokens < 1 or len(tokens) < 2:
            return []
        context = tokens[-self.max_depth :]
        best: tuple[list[int], float] = ([], 0.0)
        for source in (tokens, self.cache):
            best = max(best, self._best_chain(source, context, max_num_tokens, best[1]),
                       key=lambda b: b[1])  # fmt: skip
        return best[0]

    def _best_chain(
        self, source: np.ndarray, context: np.ndarray, max_num_tokens: int, to_beat: float
    ) -> tuple[list[int], float]:
        """Return the best chain over every match length found in `source`.

        A longer match is surer but leaves less of max_depth to draft (match + draft <=
        max_depth, as in vLLM's trees), so each length is a candidate, tried in order of the
        most it could draft until that is no better than the best so far.
        """
        ends, lengths = match_lengths(source, context, self.max_depth)
        if len(ends) == 0:
            return [], 0.0

        def most(length: int) -> int:
            factor_cap = max(1, int(self.max_spec_factor * length))
            return min(max_num_tokens, factor_cap, self.max_depth - length)

        best: tuple[list[int], float] = ([], to_beat)
        # an occurrence matching n tokens matches every shorter length too; the few that could
        # draft the most are tried (each is a handful of array passes)
        order = sorted(range(1, int(lengths.max()) + 1), key=lambda n: (most(n), n), reverse=True)
        for length in order[:_MAX_CANDIDATES]:
            if most(length) <= best[1]:
                break
            tokens, expected = _chain(source, ends[lengths >= length], most(length), self.min_prob)
            if expected > best[1]:
                best = (tokens, expected)
        return best if best[0] else ([], 0.0)

    def remove(self, req_id: str, output_ids: list[int]) -> None:
        """Forget a request that left; its output joins the response cache."""
        self.buffers.remove(req_id)
        output = output_ids
        if not output or self.max_cached_requests < 1:
            return
        output = output[-(CACHE_TOKENS - 1) :]
        n = len(output)
        if self._head + n + 1 > CACHE_TOKENS:  # no room before the end: start over at 0
            self.cache[self._head :] = _SEPARATOR
            while self._cached and self._cached[0][0] >= self._head:  # the previous lap's
                self._cached.popleft()
            self._head = 0
        start = self._head
        self.cache[start : start + n] = output
        self.cache[start + n] = _SEPARATOR
        self._head = start + n + 1
        # what was overwritten is gone; and at most max_cached_requests are kept
        while self._cached and _overlaps(self._cached[0], start, n + 1):
            self._cached.popleft()
        self._cached.append((start, n))
        while len(self._cached) > self.max_cached_requests:
            old_start, old_n = self._cached.popleft()
            self.cache[old_start : old_start + old_n] = _SEPARATOR


def _overlaps(span: tuple[int, int], start: int, n: int) -> bool:
    """Return whether a cached response (start, length) lies in [start, start + n)."""
    return span[0] < start + n and start < span[0] + span[1]
