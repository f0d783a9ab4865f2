"""Suffix decoding: drafts from suffix tries over each request's own tokens and over a bounded
cache of earlier responses, as long as the continuation seen there stays likely (vLLM's suffix
method, after Arctic Inference's SuffixDecoding; one chain per step, not a tree)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class _Node:
    count: int = 0  # how many inserted suffixes pass through this node
    children: dict[int, _Node] = field(default_factory=dict)


class SuffixTrie:
    """Every suffix (up to `max_depth` tokens) of the sequences added, with counts.

    A sequence grows one token at a time: the nodes of its suffixes that end at its last token
    are kept (`_active`), so appending a token extends each by one child (O(depth) a token).
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()
        self._active: dict[object, list[_Node]] = {}

    def extend(self, seq_id: object, token_ids: list[int], sign: int = 1) -> None:
        """Add (sign 1) or take back (sign -1) the suffixes ending at each of these tokens,
        as the continuation of sequence `seq_id`."""
        active = self._active.get(seq_id, [])
        for token in token_ids:
            grown = []
            for node in [self.root, *active[: self.max_depth - 1]]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += sign
                if child.count == 0:
                    del node.children[token]
                else:
                    grown.append(child)
            active = grown
        self._active[seq_id] = active

    def end(self, seq_id: object) -> None:
        """Stop growing a sequence (its suffixes stay)."""
        self._active.pop(seq_id, None)

    def match(self, context: list[int]) -> tuple[_Node | None, int]:
        """Return the node of the longest suffix of `context` in the trie that has a
        continuation, and its length (None, 0 if none has).

        The trie holds every suffix of what it holds, so if a suffix of `context` is a path,
        so is each shorter one: the longest path is found by bisection.
        """
        lo, hi = 0, min(self.max_depth, len(context))  # a path of lo tokens exists
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._walk(context[len(context) - mid :]) is None:
                hi = mid - 1
            else:
                lo = mid
        for n in range(lo, 0, -1):
            node = self._walk(context[len(context) - n :])
            if node is not None and node.children:
                return node, n
        return None, 0

    def match_own(self, seq_id: object) -> tuple[_Node | None, int]:
        """Return match() of a growing sequence's own tokens in its trie, from the nodes of its
        latest suffixes (no walk): the longest with a continuation seen earlier."""
        active = self._active.get(seq_id, [])
        for depth in range(len(active), 0, -1):
            if active[depth - 1].children:
                return active[depth - 1], depth
        return None, 0

    def _walk(self, token_ids: list[int]) -> _Node | None:
        node: _Node | None = self.root
        for token in token_ids:
            node = node.children.get(token)
            if node is None:
                return None
        return node


def _chain(node: _Node, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
    """Follow the most frequent continuation from `node` while its estimated probability (the
    product of child count / siblings' total) stays >= min_prob; return it and its expected
    number of accepted tokens (the sum of the prefix probabilities)."""
    tokens: list[int] = []
    prob, expected = 1.0, 0.0
    while len(tokens) < max_tokens and node.children:
        total = sum(c.count for c in node.children.values())
        token, child = max(node.children.items(), key=lambda item: item[1].count)
        prob *= child.count / total
        if prob < min_prob:
            break
        tokens.append(token)
        expected += prob
        node = child
    return tokens, expected


class SuffixProposer:
    """Owns a trie per running request (its prompt and output) and one over the outputs of
    the last `max_cached_requests` finished requests; proposes from whichever promises more."""

    def __init__(
        self, max_depth: int, max_cached_requests: int, max_spec_factor: float, min_prob: float
    ) -> None:
        self.max_depth = max_depth
        self.max_spec_factor, self.min_prob = max_spec_factor, min_prob
        self.max_cached_requests = max_cached_requests
        self._requests: dict[str, tuple[SuffixTrie, int]] = {}  # trie, tokens added
        self._outputs: dict[str, tuple[int, list[int]]] = {}  # output tokens seen, per request
        self.responses = SuffixTrie(max_depth)  # earlier requests' outputs
        self._cached: OrderedDict[int, list[int]] = OrderedDict()  # oldest first
        self._num_cached = 0  # keys of the cache's entries (request ids may come back)

    def propose(
        self, req_id: str, prompt_ids: list[int], output_ids: list[int], max_num_tokens: int
    ) -> list[int]:
        """Return up to `max_num_tokens` drafts after the request's tokens (maybe none)."""
        trie, num_added = self._requests.get(req_id, (None, 0))
        if trie is None:
            trie = SuffixTrie(self.max_depth)
        total = len(prompt_ids) + len(output_ids)
        if num_added < len(prompt_ids):
            trie.extend(req_id, prompt_ids[num_added:])
            num_added = len(prompt_ids)
        if num_added < total:
            trie.extend(req_id, output_ids[num_added - len(prompt_ids) :])
        self._requests[req_id] = (trie, total)
        self._outputs[req_id] = (len(prompt_ids), output_ids)
        if max_num_tokens < 1:
            return []
        recent = output_ids if len(output_ids) >= self.max_depth else prompt_ids + output_ids
        context = recent[-self.max_depth :]
        best: tuple[list[int], float] = ([], 0.0)
        for node, length in (trie.match_own(req_id), self.responses.match(context)):
            if node is None:
                continue
            limit = min(max_num_tokens, max(1, int(self.max_spec_factor * length)))
            tokens, expected = _chain(node, limit, self.min_prob)
            if expected > best[1]:
                best = (tokens, expected)
        return best[0]

    def remove(self, req_id: str) -> None:
        """Forget a request that left; its output joins the response cache (oldest evicted)."""
        self._requests.pop(req_id, None)
        _, output_ids = self._outputs.pop(req_id, (0, []))
        if not output_ids or self.max_cached_requests < 1:
            return
        key = self._num_cached = self._num_cached + 1
        output = list(output_ids)
        self.responses.extend(key, output)
        self.responses.end(key)
        self._cached[key] = output
        while len(self._cached) > self.max_cached_requests:
            old_key, old = self._cached.popitem(last=False)
            self.responses.extend(-old_key, old, sign=-1)  # the same walk, counted down
            self.responses.end(-old_key)
