"""Turn logits into next tokens: penalties, temperature, top-k/top-p/min-p, seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from infer8.sampling_params import SamplingParams


@dataclass
class SamplingState:
    """One request's sampling inputs that live across steps (kept by the model runner)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


def _apply_penalties(logits: torch.Tensor, state: SamplingState, stop_ids: list[int]) -> None:
    """Apply repetition/presence/frequency penalties and min_tokens in place to one row."""
    p = state.params
    device = logits.device
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(
            sorted(set(state.prompt_token_ids + state.output_token_ids)),
            dtype=torch.int64,
            device=device,
        )
        vals = logits[seen]
        logits[seen] = torch.where(
            vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
        )
    if (p.presence_penalty or p.frequency_penalty) and state.output_token_ids:
        out = torch.tensor(state.output_token_ids, dtype=torch.int64, device=device)
        counts = torch.bincount(out, minlength=logits.shape[0]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    if len(state.output_token_ids) < p.min_tokens and stop_ids:
        logits[torch.tensor(stop_ids, dtype=torch.int64, device=device)] = -float("inf")


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Return probabilities after temperature, top-k, top-p and min-p for one row."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[0]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs


class Sampler:
    """Samples one token per row; greedy rows take the argmax, seeded rows their own generator."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, states: list[SamplingState], eos_token_ids: list[int]
    ) -> tuple[list[int], list[tuple[float, list[tuple[int, float]]] | None]]:
        """Return sampled token ids and, where asked, (sampled logprob, top-k logprobs)."""
        raw_logprobs = None
        if any(s.params.logprobs is not None for s in states):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        processed = logits
        for i, s in enumerate(states):
            p = s.params
            if (
                p.repetition_penalty != 1.0
                or p.presence_penalty
                or p.frequency_penalty
                or (len(s.output_token_ids) < p.min_tokens)
            ):
                if processed is logits:
                    processed = logits.clone()
                stop_ids = ([] if p.ignore_eos else eos_token_ids) + p.stop_token_ids
                _apply_penalties(processed[i], s, stop_ids)
        tokens = processed.argmax(dim=-1).tolist()
        for i, s in enumerate(states):
            if s.params.is_greedy:
                continue
            probs = _filter(processed[i], s.params)
            gen = s.generator if s.generator is not None else self.generator
            tokens[i] = int(torch.multinomial(probs, 1, generator=gen).item())
        logprobs: list[tuple[float, list[tuple[int, float]]] | None] = []
        for i, s in enumerate(states):
            if s.params.logprobs is None or raw_logprobs is None:
                logprobs.append(None)
                continue
            row = raw_logprobs[i]
            top: list[tuple[int, float]] = []
            if s.params.logprobs > 0:
                vals, ids = torch.topk(row, s.params.logprobs)
                top = list(zip(ids.tolist(), vals.tolist()))
            logprobs.append((float(row[tokens[i]]), top))
        return tokens, logprobs
