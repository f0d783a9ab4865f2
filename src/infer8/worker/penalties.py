"""What the sampler keeps per request across steps (SamplingState) and the logit processing
that reads it: repetition / presence / frequency penalties and the min_tokens mask, batched over
the rows that need them, with every value kept finite."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

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
) -> dict[int, str]:
    """Apply repetition/presence/frequency penalties and min_tokens in place to `rows` of
    logits ([num_rows, vocab] float32, already finite); stop_ids[j] are row rows[j]'s.

    Batched over every row at once: each penalty is one gather / scatter over the flat
    (row, token) positions it touches (vLLM scatters into a dense [rows, vocab] count tensor;
    on a CPU, fresh dense tensors cost more than the positions). Returns the failed rows.
    """
    vocab, device = logits.shape[1], logits.device
    flat = logits.view(-1)
    errors: dict[int, str] = {}
    kept: list[int] = []
    for i in rows:
        s = states[i]
        try:
            check_ids(s.output_token_ids, vocab, "the output tokens")
            if s.params.repetition_penalty != 1.0:
                check_ids(s.prompt_token_ids, vocab, "the prompt tokens")
        except ValueError as e:
            errors[i] = row_error(i, e)
            continue
        kept.append(i)
    params = [states[i].params for i in kept]
    is_kept = set(kept)

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
    finite_(logits)  # the other rows are finite already
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


def row_error(row: int, error: Exception) -> str:
    logger.exception("sampling failed for batch row %d", row, exc_info=error)
    return f"sampling failed: {type(error).__name__}"
