"""What the sampler keeps per request across steps (SamplingState) and the logit processing
that reads it: repetition / presence / frequency penalties and the min_tokens mask, batched over
the rows that need them, with every value kept finite.

A running request's penalties read a row of PenaltyRows: which tokens its prompt and output
hold and how often its output holds each, dense [rows, vocab] tensors on the sampler's device
that each step updates with the new tokens only (vLLM's dense counts, kept across steps
instead of rebuilt). Rows without one (drafts being verified, a request whose prompt held an
id outside the vocabulary) take the sparse path, built from the token lists each step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from infer8.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Logits are clamped to +-LOGIT_LIMIT after each step that could overflow; real logits are
# orders of magnitude smaller, and dividing the limit by the smallest sampled temperature
# (1e-5) still fits float32.
LOGIT_LIMIT = 1e20


@dataclass
class SamplingState:
    """One request's sampling inputs that live across steps (kept by the model runner)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # its row of PenaltyRows (None: the sparse path); copies made for draft rows drop it
    penalty_row: PenaltyRow | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.penalty_row is not None and self.penalty_row.state is not self:
            self.penalty_row = None  # dataclasses.replace: another token list, not this row's

    @property
    def needs_penalties(self) -> bool:
        """Return whether this step's logits need a per-row penalty or a min_tokens mask."""
        p = self.params
        return (
            p.repetition_penalty != 1.0
            or bool(p.presence_penalty)
            or bool(p.frequency_penalty)
            or len(self.output_token_ids) < p.min_tokens
        )


def uses_penalty_rows(params: SamplingParams) -> bool:
    """Return whether a request's penalties read token counts (a PenaltyRows row pays)."""
    return (
        params.repetition_penalty != 1.0
        or bool(params.presence_penalty)
        or bool(params.frequency_penalty)
    )


@dataclass(eq=False)
class PenaltyRow:
    """A request's row of PenaltyRows; `recorded` of its output tokens are in it (-1: none of
    its tokens yet, the prompt included)."""

    state: SamplingState
    row: int
    recorded: int = -1


class PenaltyRows:
    """Dense [rows, vocab] tables of the running requests' tokens: `seen` (prompt and output,
    for the repetition penalty) and `counts` (output, for the frequency and presence
    penalties). A row is taken when a request arrives and filled on its first step (the vocab
    is the logits' width); each step adds the tokens its rows gained since, in one scatter."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seen: torch.Tensor | None = None  # [rows, vocab] bool
        self.counts: torch.Tensor | None = None  # [rows, vocab] int32
        self._free: list[int] = []
        self._num_rows = 0

    def take(self, state: SamplingState) -> None:
        """Give a request's state a row (it stays on the sparse path until its first step)."""
        if not self._free:
            grown = max(8, 2 * self._num_rows)
            self._free = list(range(grown - 1, self._num_rows - 1, -1))
            self._num_rows = grown
        state.penalty_row = PenaltyRow(state, self._free.pop())

    def release(self, state: SamplingState) -> None:
        """Free a finished (or replaced) request's row, zeroed for its next holder."""
        handle = state.penalty_row
        if handle is None:
            return
        state.penalty_row = None
        if handle.recorded >= 0 and self.seen is not None and handle.row < self.seen.shape[0]:
            self.seen[handle.row] = False
            if self.counts is not None:
                self.counts[handle.row] = 0
        self._free.append(handle.row)

    def sync(self, states: list[SamplingState], vocab: int) -> None:
        """Add the tokens each state gained since its last sync (all of them, the prompt
        included, the first time). A state holding an id outside the vocabulary leaves its row
        for the sparse path, which reports it."""
        self._ensure(vocab)
        assert self.seen is not None and self.counts is not None
        rows: list[int] = []
        tokens: list[int] = []
        counted: list[bool] = []
        for s in states:
            handle = s.penalty_row
            assert handle is not None
            new = s.output_token_ids[max(handle.recorded, 0) :]
            if handle.recorded < 0:  # the first sync: the prompt too
                tokens.extend(s.prompt_token_ids)
                counted.extend([False] * len(s.prompt_token_ids))
                rows.extend([handle.row] * len(s.prompt_token_ids))
            tokens.extend(new)
            counted.extend([True] * len(new))
            rows.extend([handle.row] * len(new))
            handle.recorded = len(s.output_token_ids)
        if not tokens:
            return
        ids = np.asarray(tokens, dtype=np.int64)
        row_ids = np.asarray(rows, dtype=np.int64)
        bad = (ids < 0) | (ids >= vocab)
        if bad.any():  # those rows go back to the sparse path, which reports them
            bad_rows = set(row_ids[bad].tolist())
            for s in states:
                if s.penalty_row is not None and s.penalty_row.row in bad_rows:
                    self.release(s)
            keep = ~np.isin(row_ids, list(bad_rows))
            ids, row_ids, counted = ids[keep], row_ids[keep], np.asarray(counted)[keep].tolist()
        flat = torch.from_numpy(row_ids * vocab + ids).to(self.device)
        self.seen.view(-1)[flat] = True
        out = flat[torch.tensor(counted, dtype=torch.bool, device=self.device)]
        self.counts.view(-1).index_add_(0, out, torch.ones_like(out, dtype=torch.int32))

    def _ensure(self, vocab: int) -> None:
        """Allocate (or grow to) every taken row at this vocabulary."""
        if self.seen is not None and self.seen.shape == (self._num_rows, vocab):
            return
        assert self.seen is None or self.seen.shape[1] == vocab, "the vocabulary changed"
        seen = torch.zeros((self._num_rows, vocab), dtype=torch.bool, device=self.device)
        counts = torch.zeros((self._num_rows, vocab), dtype=torch.int32, device=self.device)
        if self.seen is not None and self.counts is not None:
            seen[: self.seen.shape[0]] = self.seen
            counts[: self.counts.shape[0]] = self.counts
        self.seen, self.counts = seen, counts


def finite_(x: torch.Tensor) -> torch.Tensor:
    """Clamp in place into [-LOGIT_LIMIT, LOGIT_LIMIT]; NaN goes to the bottom."""
    torch.nan_to_num_(x, nan=-LOGIT_LIMIT, posinf=LOGIT_LIMIT, neginf=-LOGIT_LIMIT)
    return x.clamp_(-LOGIT_LIMIT, LOGIT_LIMIT)


def check_ids(ids: list[int], vocab_size: int, what: str) -> None:
    """Raise ValueError if a token id is outside the vocabulary."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise ValueError(f"{what} hold a token id outside the vocabulary of {vocab_size}")


def apply_penalties(
    logits: torch.Tensor,
    rows: list[int],
    states: list[SamplingState],
    stop_ids: list[list[int]],
    tables: PenaltyRows | None = None,
) -> dict[int, str]:
    """Apply repetition/presence/frequency penalties and min_tokens in place to `rows` of
    logits ([num_rows, vocab] float32, already finite); stop_ids[j] are row rows[j]'s.

    Rows whose state holds a row of `tables` read it (dense gathers, after the step's new
    tokens are added); the others are batched over the flat (row, token) positions their
    token lists touch. Returns the failed rows.
    """
    vocab, device = logits.shape[1], logits.device
    flat = logits.view(-1)
    tabled = []
    if tables is not None:
        tabled = [i for i in rows if states[i].penalty_row is not None]
        if tabled:
            tables.sync([states[i] for i in tabled], vocab)
            tabled = [i for i in tabled if states[i].penalty_row is not None]
    errors: dict[int, str] = {}
    kept: list[int] = []
    in_table = set(tabled)
    for i in rows:
        if i in in_table:
            continue
        s = states[i]
        try:
            check_ids(s.output_token_ids, vocab, "the output tokens")
            if s.params.repetition_penalty != 1.0:
                check_ids(s.prompt_token_ids, vocab, "the prompt tokens")
        except ValueError as e:
            errors[i] = row_error(i, e)
            continue
        kept.append(i)
    if kept:
        _sparse_penalties(logits, kept, states)
    if tabled:
        assert tables is not None
        _dense_penalties(logits, tabled, states, tables)
    finite_(logits)  # the other rows are finite already
    is_kept = set(kept) | in_table
    masked = [
        [t for t in stop_ids[j] if t < vocab]
        if len(states[i].output_token_ids) < states[i].params.min_tokens and i in is_kept
        else []
        for j, i in enumerate(rows)
    ]  # fmt: skip
    masked = [ids if len(ids) < vocab else [] for ids in masked]  # never mask every token
    if any(masked):
        pos = [i * vocab + t for i, ids in zip(rows, masked) for t in ids]
        flat[torch.tensor(pos, dtype=torch.int64, device=device)] = -float("inf")
    return errors


def _sparse_penalties(logits: torch.Tensor, kept: list[int], states: list[SamplingState]) -> None:
    """Penalise rows `kept` from their token lists: each penalty is one gather / scatter over
    the flat (row, token) positions it touches (on a CPU, fresh dense tensors cost more than
    the positions of short contexts)."""
    vocab, device = logits.shape[1], logits.device
    flat = logits.view(-1)
    params = [states[i].params for i in kept]

    def positions(ids_per_row: list[list[int]]) -> torch.Tensor:
        """Return the flat positions row * vocab + token of every pair, in one tensor."""
        pos = [i * vocab + t for i, ids in zip(kept, ids_per_row) for t in ids]
        return torch.tensor(pos, dtype=torch.int64, device=device)

    def per_row(values: list[float], pos: torch.Tensor) -> torch.Tensor:
        """Return each position's row value (float32, like the logits)."""
        table = torch.zeros(logits.shape[0], dtype=logits.dtype, device=device)
        table[torch.tensor(kept, dtype=torch.int64, device=device)] = torch.tensor(
            values, dtype=logits.dtype, device=device
        )
        return table[pos // vocab]

    if any(p.repetition_penalty != 1.0 for p in params):
        seen = positions([
            [*states[i].prompt_token_ids, *states[i].output_token_ids]
            if p.repetition_penalty != 1.0 else []
            for i, p in zip(kept, params)
        ]).unique()  # fmt: skip
        vals = flat[seen]
        rep = per_row([p.repetition_penalty for p in params], seen)
        flat[seen] = torch.where(vals > 0, vals / rep, vals * rep)
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        out, counts = positions([
            states[i].output_token_ids if p.frequency_penalty or p.presence_penalty else []
            for i, p in zip(kept, params)
        ]).unique(return_counts=True)  # fmt: skip
        freq = per_row([p.frequency_penalty for p in params], out)
        pres = per_row([p.presence_penalty for p in params], out)
        flat[out] -= freq * counts.to(logits.dtype) + pres * torch.ones_like(freq)


def _dense_penalties(
    logits: torch.Tensor, tabled: list[int], states: list[SamplingState], tables: PenaltyRows
) -> None:
    """Penalise rows `tabled` from their rows of `tables`: gathers of [rows, vocab]."""
    assert tables.seen is not None and tables.counts is not None
    device = logits.device
    params = [states[i].params for i in tabled]
    index = torch.tensor(tabled, dtype=torch.int64, device=device)
    rows = torch.tensor([states[i].penalty_row.row for i in tabled],  # type: ignore[union-attr]
                        dtype=torch.int64, device=device)  # fmt: skip

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=device)[:, None]

    x = logits[index]  # [len(tabled), vocab]
    if any(p.repetition_penalty != 1.0 for p in params):
        rep = column([p.repetition_penalty for p in params])
        x = torch.where(tables.seen[rows], torch.where(x > 0, x / rep, x * rep), x)
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        counts = tables.counts[rows]
        freq = column([p.frequency_penalty for p in params])
        pres = column([p.presence_penalty for p in params])
        # as the sparse path rounds: one subtraction of freq * count + pres
        x = x - (freq * counts.to(logits.dtype) + pres * (counts > 0).to(logits.dtype))
    logits[index] = x


def row_error(row: int, error: Exception) -> str:
    logger.exception("sampling failed for batch row %d", row, exc_info=error)
    return f"sampling failed: {type(error).__name__}"
