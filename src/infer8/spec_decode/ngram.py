"""N-gram prompt lookup: draft the tokens that followed the latest earlier occurrence of a
request's last n tokens (vLLM's ngram method; no model runs)."""

from __future__ import annotations

import numpy as np


def match_lengths(
    tokens: np.ndarray, context: np.ndarray, limit: int
) -> tuple[np.ndarray, np.ndarray]:
    """Return the positions in `tokens` (before its last) that hold the context's last token,
    ascending, and how many tokens back from each match the context (at most `limit`)."""
    ends = np.flatnonzero(tokens[:-1] == context[-1])
    if len(ends) == 0:
        return ends, ends
    back = np.arange(min(limit, len(context)))
    at = ends[:, None] - back[None, :]
    same = (at >= 0) & (tokens[np.maximum(at, 0)] == context[len(context) - 1 - back][None, :])
    return ends, np.where(same.all(axis=1), same.shape[1], same.argmin(axis=1))


class TokenBuffers:
    """Each running request's token ids as a growing array, copying only what is new."""

    def __init__(self) -> None:
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}  # req_id -> (buffer, length)

    def sync(self, req_id: str, prompt_ids: list[int], output_ids: list[int]) -> np.ndarray:
        """Return the request's tokens as an array, appending what is new since last time."""
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

    def remove(self, req_id: str) -> None:
        """Forget a request that left."""
        self._tokens.pop(req_id, None)


class NgramProposer:
    """Owns each running request's token ids as a growing array, and proposes drafts from them."""

    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n
        self.min_n, self.max_n = min_n, max_n
        self.buffers = TokenBuffers()

    def propose(
        self, req_id: str, prompt_ids: list[int], output_ids: list[int], max_num_tokens: int
    ) -> list[int]:
        """Return up to `max_num_tokens` drafts: what followed the latest earlier occurrence of
        the longest suffix (max_n down to min_n tokens) found; empty when none is."""
        tokens = self.buffers.sync(req_id, prompt_ids, output_ids)
        length = len(tokens)
        if max_num_tokens < 1 or length < self.min_n + 1:
            return []
        # earlier occurrences of the last token (a match leaves one token after it to propose)
        # and how far back each matches, up to max_n tokens
        ends, matched = match_lengths(tokens, tokens[length - 1 - min(self.max_n, length - 1) :],
                                      self.max_n)  # fmt: skip
        if len(ends) == 0:
            return []
        # the longest; the latest among equals (argmax takes the first of the reversed)
        best = len(ends) - 1 - int(matched[::-1].argmax())
        if matched[best] < self.min_n:
            return []
        end = int(ends[best])
        return tokens[end + 1 : end + 1 + max_num_tokens].tolist()

    def remove(self, req_id: str, output_ids: list[int]) -> None:
        """Forget a request that left."""
        self.buffers.remove(req_id)
