"""Turn logits into next tokens: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

Sampling runs in float32 over the whole batch, and every intermediate is kept finite: a request
with extreme but legal parameters (a repetition penalty of 1e-38, a temperature of 1e-4) gets a
token, never a NaN that kills the batch. A row that still fails is reported in `errors` and the
other rows are sampled as usual (per-request fault isolation).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

from infer8.sampling_params import SamplingParams
from infer8.worker.penalties import (
    LOGIT_LIMIT,
    PenaltyRows,
    SamplingState,
    apply_penalties,
    finite_,
    row_error,
)

logger = logging.getLogger(__name__)

_GREEDY_TEMPERATURE = 1e-5
# Rows with top-k or top-p are filtered and sampled among their CANDIDATES[0] most likely
# tokens when their support fits there (chat defaults such as temperature 0.2, top_p 0.9 nearly
# always do), else among the next tier's, else over the sorted vocabulary: partial selections
# instead of a sort. 32 rows of a 49,152-token vocab: sort 60 ms, topk(256) 3 ms, topk(4096)
# 10 ms (docs/benchmarks.md, "Online").
CANDIDATES = (256, 4096)
# On CPU a native pass finds each row's candidates instead (NativeSampling.nucleus_candidates:
# every token within a few natural-log units of the row's maximum, as few units as hold the
# row's top-p mass and top-k); rows with more than NATIVE_CAP of them take the tiers above.
NATIVE_CAP = 4096

# (logprob of the sampled token, [(token_id, logprob)] of the top-k) for one row
RowLogprobs = tuple[float, list[tuple[int, float]]]


class SamplerOutput(NamedTuple):
    """Sampled ids per row (-1 for a failed row), logprobs where asked, and row failures."""

    token_ids: list[int]
    logprobs: list[RowLogprobs | None]
    errors: dict[int, str]


def _filter_params(
    params: list[SamplingParams], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return each row's top-k (vocab when off), top-p and min-p as [rows, 1] tensors."""
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    return (
        torch.tensor(top_k, dtype=torch.int64, device=device).unsqueeze(1),
        torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device).unsqueeze(1),
        torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device).unsqueeze(1),
    )


def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Return probabilities after top-k, top-p and min-p over the whole vocabulary.

    logits: [rows, vocab], already divided by the temperature.
    """
    vocab = logits.shape[1]
    top_k, top_p, min_p = _filter_params(params, vocab, logits.device)
    if int(top_k.min()) < vocab:
        sorted_desc = logits.sort(dim=1, descending=True).values
        kth = sorted_desc.gather(1, top_k - 1)
        logits = logits.masked_fill(logits < kth, -float("inf"))
    probs = torch.softmax(logits, dim=1)
    if float(top_p.min()) < 1.0:
        sorted_probs, order = probs.sort(dim=1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = sorted_probs.cumsum(1) - sorted_probs >= top_p
        drop[:, 0] = False
        probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
    if float(min_p.max()) > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=1, keepdim=True), 0.0)
    return probs


def _candidate_probs(
    logits: torch.Tensor, params: list[SamplingParams], k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_probs over each row's k most likely tokens, where that is the same support.

    Returns (probs [rows, K] in descending order, their token ids, whether the row's support
    fits): a row fits when its top-k is at most K, or when its top-p mass is reached within
    the K (every token after them would be dropped by top-p anyway). Probabilities are the
    full softmax's (over the top-k when top-k is on), so top-p and min-p cut where _probs does.
    """
    vocab = logits.shape[1]
    k = min(k, vocab)
    vals, ids = logits.topk(k, dim=1)  # descending
    # (the whole row's sum; exponents clamped at -87, where exp leaves float32's normal range
    # and turns 15x slower: what is lost there is < 1e-33 of the sum)
    full = (logits - vals[:, :1]).clamp_(min=-87.0).exp_().sum(1, keepdim=True)
    return _filter_candidates(vals, ids, full, params, vocab)


def _filter_candidates(
    vals: torch.Tensor,
    ids: torch.Tensor,
    full: torch.Tensor,
    params: list[SamplingParams],
    vocab: int,
    sizes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_candidate_probs' rule over given candidates: vals [rows, K] each row's K largest
    logits in descending order (the first a row's maximum; -inf past `sizes`, its number of
    candidates when they are fewer than K), their ids, full [rows, 1] the row's softmax
    denominator (sum of e^max(x - max, -87))."""
    k = vals.shape[1]
    top_k, top_p, min_p = _filter_params(params, vocab, vals.device)
    column = torch.arange(k, device=vals.device).unsqueeze(0)
    vals = vals.masked_fill(column >= top_k, -float("inf"))
    within_k = top_k <= (k if sizes is None else sizes.unsqueeze(1))
    # as softmax computes it: exp(x - max) over the sum of those (the row's max is vals[:, 0])
    weights = (vals - vals[:, :1]).exp()
    probs = weights / torch.where(within_k, weights.sum(1, keepdim=True), full)
    cumulative = probs.cumsum(1)
    drop = (cumulative - probs >= top_p) & (top_p < 1.0)
    drop[:, 0] = False
    drop |= probs < min_p * probs[:, :1]
    fits = within_k | ((top_p < 1.0) & (cumulative[:, -1:] >= top_p))
    return probs.masked_fill(drop, 0.0), ids, fits.squeeze(1)


Candidates = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, int],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
]


class Sampler:
    """Samples one token per row; greedy rows take the argmax, seeded rows their own generator."""

    def __init__(
        self,
        device: torch.device,
        seed: int,
        greedy: Callable[[torch.Tensor, float], list[int]] | None = None,
        candidates: Candidates | None = None,
    ) -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)
        # On a GPU, the running requests' token tables their penalties read (the model runner
        # takes and releases rows as requests come and go). A CPU keeps the sparse path:
        # dense [rows, vocab] passes cost it more than the positions (2-9x at 8-256 rows of a
        # 49K vocabulary and 128-1,024-token contexts).
        self.penalty_rows = PenaltyRows(device) if device.type == "cuda" else None
        # (logits, limit) -> each row's argmax after finite_, without the copy: a native pass
        # on CPU (NativeSampling.greedy), for steps whose rows are all plain greedy
        self.greedy = greedy
        # (scaled logits, top_p, top_k, cap) -> (ids, count, row max, softmax denominator): the
        # CPU's native candidate pass (NativeSampling.nucleus_candidates)
        self.candidates = candidates

    def __call__(
        self,
        logits: torch.Tensor,
        states: list[SamplingState],
        eos_token_ids: list[int] | tuple[int, ...] = (),
    ) -> SamplerOutput:
        """Sample a token per row of `logits` ([num_rows, vocab]); failed rows land in errors."""
        if self.greedy is not None and logits.dtype == torch.float32 and logits.dim() == 2:
            plain = (s.params.is_greedy and s.params.logprobs is None and not s.needs_penalties
                     for s in states)  # fmt: skip
            if all(plain):
                tokens = self.greedy(logits, LOGIT_LIMIT)
                return SamplerOutput(tokens, [None] * len(states), {})
        processed, errors, raw_logprobs = self._process(logits, states, eos_token_ids)
        sampled = [i for i, s in enumerate(states) if not s.params.is_greedy and i not in errors]
        # the greedy rows' argmax (a pass over the vocabulary saved when no row is greedy)
        if len(sampled) == len(states):
            tokens = [-1] * len(states)
        else:
            tokens = processed.argmax(dim=-1).tolist()
        if sampled:
            try:
                self._sample_rows(processed, states, sampled, tokens)
            except Exception:  # noqa: BLE001 - isolate the row that fails, keep the others
                for i in sampled:
                    try:
                        self._sample_rows(processed, states, [i], tokens)
                    except Exception as e:  # noqa: BLE001
                        errors[i] = row_error(i, e)
        logprobs: list[RowLogprobs | None] = []
        for i, s in enumerate(states):
            if s.params.logprobs is None or raw_logprobs is None or i in errors:
                logprobs.append(None)
                continue
            row = raw_logprobs[i]
            top: list[tuple[int, float]] = []
            if s.params.logprobs > 0:
                vals, ids = torch.topk(row, s.params.logprobs)
                top = list(zip(ids.tolist(), vals.tolist()))
            logprobs.append((float(row[tokens[i]]), top))
        for i in errors:
            tokens[i] = -1
        return SamplerOutput(tokens, logprobs, errors)

    def _process(
        self,
        logits: torch.Tensor,
        states: list[SamplingState],
        eos_token_ids: list[int] | tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, dict[int, str], torch.Tensor | None]:
        """Return (processed logits: a float32 copy, finite, penalised and masked; failed rows;
        raw log-probabilities where a row asks for logprobs)."""
        logits = logits.to(torch.float32, copy=True)  # [num_rows, vocab], our own copy
        # Tokens already masked (-inf: a grammar's bitmask) stay masked whatever the penalties
        # do to them (a repetition penalty below 1 would pull -1e20 up to about 0).
        is_masked = None
        if any(s.needs_penalties for s in states):
            is_masked = torch.isneginf(logits)
        finite_(logits)
        errors: dict[int, str] = {}
        raw_logprobs = None
        if any(s.params.logprobs is not None for s in states):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        processed = logits  # penalised in place: the raw logprobs above are a separate tensor
        penalised = [i for i, s in enumerate(states) if s.needs_penalties]
        if penalised:
            stop_ids = []
            for i in penalised:
                p = states[i].params
                eos_ids = [*states[i].eos_token_ids, *eos_token_ids]  # the request's, and these
                stop_ids.append(([] if p.ignore_eos else eos_ids) + p.stop_token_ids)
            try:
                errors.update(apply_penalties(processed, penalised, states, stop_ids,
                                              self.penalty_rows))  # fmt: skip
            except Exception:  # noqa: BLE001 - isolate the row that fails, keep the others
                for i, ids in zip(penalised, stop_ids):
                    try:
                        errors.update(apply_penalties(processed, [i], states, [ids],
                                                      self.penalty_rows))  # fmt: skip
                    except Exception as e:  # noqa: BLE001
                        errors[i] = row_error(i, e)
        if is_masked is not None:
            processed.masked_fill_(is_masked, -LOGIT_LIMIT)
        return processed, errors, raw_logprobs

    def probs(
        self, logits: torch.Tensor, states: list[SamplingState]
    ) -> tuple[torch.Tensor, dict[int, str]]:
        """Return the distribution each row samples from ([rows, vocab] float32: penalties,
        temperature, top-k, top-p, min-p applied; unnormalised) and the failed rows."""
        processed, errors, _ = self._process(logits, states)
        params = [s.params for s in states]
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32,
                             device=processed.device)  # fmt: skip
        scaled = finite_(processed / temps.clamp(min=_GREEDY_TEMPERATURE)[:, None])
        return _probs(scaled, params), errors

    def _sample_rows(
        self,
        logits: torch.Tensor,
        states: list[SamplingState],
        rows: list[int],
        tokens: list[int],
    ) -> None:
        """Sample `rows` in place into tokens: inverse CDF of the filtered probabilities, one
        uniform number per row (from the request's generator when it has a seed)."""
        device = logits.device
        index = torch.tensor(rows, dtype=torch.int64, device=device)
        params = [states[i].params for i in rows]
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        every = len(rows) == logits.shape[0]  # rows are sorted: then they are all of them
        sub = logits if every else logits.index_select(0, index)
        scaled = finite_(sub / temps.clamp(min=_GREEDY_TEMPERATURE)[:, None])
        uniform = torch.empty(len(rows), dtype=torch.float64, device=device)
        shared = [j for j, i in enumerate(rows) if states[i].generator is None]
        if shared:
            uniform[shared] = torch.rand(
                len(shared), dtype=torch.float64, device=device, generator=self.generator
            )
        for j, i in enumerate(rows):
            if states[i].generator is not None:
                uniform[j] = torch.rand(
                    1, dtype=torch.float64, device=device, generator=states[i].generator
                )[0]
        vocab = scaled.shape[1]
        filtered = [j for j, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
        fits = torch.zeros(len(rows), dtype=torch.bool)
        if filtered and self.candidates is not None and scaled.device.type == "cpu":
            for j, token in self._native_candidates(scaled, params, filtered, uniform).items():
                tokens[rows[j]] = token
                fits[j] = True
            filtered = [j for j in filtered if not fits[j]]
        for k in CANDIDATES:
            if not filtered or k >= vocab:
                break
            part = torch.tensor(filtered, dtype=torch.int64, device=device)
            probs, ids, part_fits = _candidate_probs(
                scaled if len(filtered) == len(rows) else scaled.index_select(0, part),
                [params[j] for j in filtered],
                k,
            )
            fits[part] = part_fits.cpu()
            chosen = _inverse_cdf(probs, uniform[part])
            choice = ids.gather(1, chosen[:, None])[:, 0].tolist()
            for j, c, f in zip(filtered, choice, part_fits.tolist()):
                if f:
                    tokens[rows[j]] = c
            filtered = [j for j in filtered if not fits[j]]
        rest = [j for j in range(len(rows)) if not fits[j]]
        if rest:
            part = torch.tensor(rest, dtype=torch.int64, device=device)
            part_scaled = scaled if len(rest) == len(rows) else scaled.index_select(0, part)
            probs = _probs(part_scaled, [params[j] for j in rest])
            for j, c in zip(rest, _inverse_cdf(probs, uniform[part]).tolist()):
                tokens[rows[j]] = c

    def _native_candidates(
        self,
        scaled: torch.Tensor,
        params: list[SamplingParams],
        filtered: list[int],
        uniform: torch.Tensor,
    ) -> dict[int, int]:
        """Sample the `filtered` rows of `scaled` whose support fits among the native pass's
        candidates; return {row: token} for those (the others are left to the tiers)."""
        assert self.candidates is not None
        vocab = scaled.shape[1]
        part = torch.tensor(filtered, dtype=torch.int64)
        sub = scaled if len(filtered) == scaled.shape[0] else scaled.index_select(0, part)
        rows_params = [params[j] for j in filtered]
        top_k, top_p, _ = _filter_params(rows_params, vocab, scaled.device)
        ids, count, _, denominator = self.candidates(sub, top_p[:, 0], top_k[:, 0], NATIVE_CAP)
        chosen: dict[int, int] = {}
        # rows in two groups by their number of candidates, each padded to its own largest
        small = (count >= 0) & (count <= CANDIDATES[0])
        for group in (small, (count > CANDIDATES[0])):
            at = group.nonzero()[:, 0]
            if at.numel() == 0:
                continue
            size = count[at]
            width = int(size.max())
            pad = torch.arange(width).unsqueeze(0) >= size.unsqueeze(1)
            group_ids = ids[at, :width].masked_fill(pad, 0)
            flat = (at * vocab).unsqueeze(1) + group_ids  # (no copy of the rows)
            vals = sub.reshape(-1)[flat].masked_fill(pad, -float("inf"))
            vals, order = vals.sort(dim=1, descending=True)
            probs, group_ids, fits = _filter_candidates(
                vals,
                group_ids.gather(1, order),
                denominator[at].unsqueeze(1),
                [rows_params[i] for i in at.tolist()],
                vocab,
                size,
            )
            picks = _inverse_cdf(probs, uniform[part[at]])
            tokens = group_ids.gather(1, picks[:, None])[:, 0].tolist()
            for i, token, fit in zip(at.tolist(), tokens, fits.tolist()):
                if fit:
                    chosen[filtered[i]] = token
        return chosen


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Return per row the index where the cumulative probability passes uniform * total.

    probs: [rows, n] >= 0 with a positive entry per row; uniform: [rows] in [0, 1). The sum is
    taken in float64, and the index is the last positive entry at most (a zero-probability
    token is never returned).
    """
    cdf = probs.to(torch.float64).cumsum(1)
    target = uniform * cdf[:, -1]
    chosen = torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp_(
        max=probs.shape[1] - 1
    )
    zero = probs.gather(1, chosen[:, None])[:, 0] <= 0  # rounding ran past the last positive
    if bool(zero.any()):
        positive = probs[zero] > 0
        last = probs.shape[1] - 1 - positive.flip(1).to(torch.int8).argmax(1)
        chosen[zero] = torch.minimum(chosen[zero], last)
    return chosen
