"""Verifying drafts on the device side: speculative sampling over a step's logits, and the exact
tail's ring kept free of rejected drafts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer8.attention.kv_cache import LayerKVCache
from infer8.worker.penalties import SamplingState
from infer8.worker.sampler import RowLogprobs, Sampler, _inverse_cdf


@dataclass
class DraftRows:
    """One sampled request's rows of the step's logits: `first_row` scores its first draft (or
    its next token without drafts), then one row per further draft and the bonus token."""

    first_row: int
    draft_ids: list[int]


@dataclass
class Verified:
    """One request's outcome: accepted drafts (a prefix), then the token sampled after them."""

    num_accepted: int
    token_id: int
    error: str | None = None
    logprobs: RowLogprobs | None = None  # a request without drafts that asked for them


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    row_states: list[SamplingState],
    requests: list[DraftRows],
) -> list[Verified]:
    """Return each request's accepted drafts and next token from `logits` ([rows, vocab]).

    Row first_row + j is scored with the request's tokens and its first j drafts (row_states
    hold those as output, so penalties and min_tokens see them). Greedy: a draft is accepted
    while it is the argmax, so the output is the one without drafts. Sampled: speculative
    sampling with the draft as a point mass: draft x is accepted with probability p(x), else
    the token is drawn from p without x (renormalised), so every token is distributed as p.
    """
    sampled = sampler(logits, row_states)  # each row's own token: the argmax when greedy
    stochastic = [
        r for r in requests if r.draft_ids and not row_states[r.first_row].params.is_greedy
    ]
    rows = [r.first_row + j for r in stochastic for j in range(len(r.draft_ids))]
    probs, prob_errors = None, {}
    if rows:
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        probs, prob_errors = sampler.probs(
            logits.index_select(0, index), [row_states[i] for i in rows]
        )
    at = {row: j for j, row in enumerate(rows)}  # a draft row's row in probs
    out = []
    for r in requests:
        k, first = len(r.draft_ids), r.first_row
        failed = [sampled.errors[i] for i in range(first, first + k + 1) if i in sampled.errors]
        failed += [prob_errors[at[i]] for i in range(first, first + k) if at.get(i) in prob_errors]
        if failed:
            out.append(Verified(0, -1, failed[0]))
            continue
        state = row_states[first]
        a = 0
        if state.params.is_greedy or probs is None:
            while a < k and sampled.token_ids[first + a] == r.draft_ids[a]:
                a += 1
            out.append(Verified(a, sampled.token_ids[first + a], None, sampled.logprobs[first]))
            continue
        token = None
        while a < k:
            p, x = probs[at[first + a]], r.draft_ids[a]
            total = float(p.sum())
            u = torch.rand(1, dtype=torch.float64, generator=state.generator or sampler.generator)
            if float(u) * total < float(p[x]):
                a += 1
                continue
            residual = p.clone()
            residual[x] = 0.0
            if float(residual.sum()) > 0.0:
                u = torch.rand(
                    1, dtype=torch.float64, generator=state.generator or sampler.generator
                )
                token = int(_inverse_cdf(residual[None, :], u.to(p.device))[0])
            else:  # p is x alone (rounding made u * total reach it): x it is
                a += 1
                continue
            break
        final = sampled.token_ids[first + a] if token is None else token
        out.append(Verified(a, final, None, sampled.logprobs[first] if k == 0 else None))
    return out


class TailRingBackup:
    """Saves the exact tail's ring slots that a step's drafts overwrite, and puts back those of
    the drafts that were rejected.

    The ring keeps a request's latest positions at `position % ring_size`; a draft at position
    q overwrites the slot of q - ring_size, which the next step's query still reads when the
    draft is rejected. Restored at the start of the next step, from the tokens it appends (so
    every tensor-parallel rank restores the same, sampling or not).
    """

    def __init__(self, ring_size: int) -> None:
        self.ring_size = ring_size
        # req_id -> (its ring row, the drafts' slots in order, per layer the saved values)
        self._saved: dict[str, tuple[int, list[int], list[tuple[torch.Tensor, torch.Tensor]]]] = {}

    def save(self, kv_caches: list[LayerKVCache], req_id: str, row: int, positions: range) -> None:
        """Save the ring slots that positions (a request's drafts, in order) will overwrite."""
        slots = [p % self.ring_size for p in positions]
        saved = []
        for layer in kv_caches:
            assert layer.tail_store is not None
            residuals, scales = layer.tail_store
            saved.append((residuals[:, row, slots].clone(), scales[:, row, slots].clone()))
        self._saved[req_id] = (row, slots, saved)

    def restore(
        self,
        kv_caches: list[LayerKVCache],
        appended: dict[str, list[int]],
        gone: set[str],
    ) -> None:
        """Put back the slots of the previous step's rejected drafts: a request that appended
        n tokens accepted n - 1 drafts. Requests that left are dropped (their rows are free)."""
        for req_id, (row, slots, saved) in self._saved.items():
            tokens = appended.get(req_id)
            if req_id in gone or tokens is None:
                continue
            rejected = slots[len(tokens) - 1 :]
            if not rejected:
                continue
            num_kept = len(slots) - len(rejected)
            for layer, (residuals, scales) in zip(kv_caches, saved):
                assert layer.tail_store is not None
                store_res, store_scales = layer.tail_store
                # (a float8 tensor takes advanced-index assignment, not index_copy_)
                store_res[:, row, rejected] = residuals[:, num_kept:]
                store_scales[:, row, rejected] = scales[:, num_kept:]
        self._saved.clear()

    def clear(self) -> None:
        """Forget every saved slot (after a failed step)."""
        self._saved.clear()
