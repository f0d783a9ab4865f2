"""N-gram prompt lookup: draft the tokens that followed the latest earlier occurrence of a
request's last n tokens (vLLM's ngram method; no model runs)."""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Owns each running request's token ids as a growing array, and proposes drafts from them."""

    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n
        self.min_n, self.max_n = min_n, max_n
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}  # req_id -> (buffer, length)

    def _sync(self, req_id: str, prompt_ids: list[int], output_ids: list[int]) -> np.ndarray:
        """Return the request's tokens as an array, copying only what is new since last time."""
        buf, n = self._tokens.get(req_id, (np.empty(0, np.int64), 0))
        num_prompt = len(prompt_ids)
        total = num_prompt + len(output_ids)
        if total < n:  # not a continuation (a reused id): start again
            n = 0
        if total > len(buf):
            grown = np.empty(max(total, 2 * len(buf), 64), np.int64)
            grown[:n] = buf[:n]
            buf = grown
        if n < num_prompt:
            buf[n:num_prompt] = prompt_ids[n:]
            n = num_prompt
        if total > n:
            buf[n:total] = output_ids[n - num_prompt :]
        self._tokens[req_id] = (buf, total)
        return buf[:total]

    def propose(
        self, req_id: str, prompt_ids: list[int], output_ids: list[int], max_num_tokens: int
    ) -> list[int]:
        """Return up to `max_num_tokens` drafts: what followed the latest earlier occurrence of
        the longest suffix (max_n down to min_n tokens) found; empty when none is."""
        tokens = self._sync(req_id, prompt_ids, output_ids)
        length = len(tokens)
        if max_num_tokens < 1 or length < self.min_n + 1:
            return []
        # earlier positions holding the last token, latest first: the ends of candidate matches
        # (a match must leave at least one token after it to propose)
        ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])[::-1]
        if len(ends) == 0:
            return []
        # how far each candidate matches backwards, up to max_n tokens: [candidates, max_n]
        back = np.arange(min(self.max_n, length - 1))
        at = ends[:, None] - back[None, :]
        same = (at >= 0) & (tokens[np.maximum(at, 0)] == tokens[length - 1 - back][None, :])
        matched = np.where(same.all(axis=1), same.shape[1], same.argmin(axis=1))
        best = int(matched.argmax())  # the longest; the latest among equals (ends run backwards)
        if matched[best] < self.min_n:
            return []
        end = int(ends[best])
        return tokens[end + 1 : end + 1 + max_num_tokens].tolist()

    def remove(self, req_id: str) -> None:
        """Forget a request that left."""
        self._tokens.pop(req_id, None)
