"""Benchmark workloads: seeded length distributions and prompts cut from public-domain text."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from importlib import resources
from typing import Any, Protocol

# Public-domain texts shipped with infer8 (see infer8/eval/data/SOURCES.md).
PROMPT_TEXTS = ("areopagitica.txt", "hamlet_act1.txt")
DISTRIBUTIONS = ("fixed", "uniform", "lognormal")


class TokenizerLike(Protocol):
    """What workloads need from a tokenizer (infer8's Tokenizer fits)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class LengthSpec:
    """A distribution of token counts: fixed, uniform in [low, high], or long-tailed lognormal.

    Spec strings (`parse`): "128" fixed; "uniform:20:150" (or "20:150"); "lognormal:MEDIAN"
    with optional ":SIGMA:MAX" (defaults sigma 1.0, max 8 x median), the long-tailed shape of
    ShareGPT-like chat lengths: most requests short, a few very long.
    """

    kind: str
    value: int  # fixed: the length; lognormal: the median; uniform: unused (low)
    low: int = 1
    high: int = 1
    sigma: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in DISTRIBUTIONS:
            raise ValueError(f"unknown length distribution {self.kind!r}; choose {DISTRIBUTIONS}")
        if self.kind == "fixed" and self.value < 1:
            raise ValueError(f"a length must be >= 1, got {self.value}")
        if self.kind != "fixed" and not 1 <= self.low <= self.high:
            raise ValueError(f"need 1 <= low <= high, got {self.low}..{self.high}")
        if self.kind == "lognormal" and (self.sigma <= 0 or not self.low <= self.value):
            raise ValueError(f"lognormal needs sigma > 0 and median >= 1, got {self}")

    @classmethod
    def parse(cls, spec: str | int) -> LengthSpec:
        """Parse "128", "uniform:20:150", "20:150" or "lognormal:MEDIAN[:SIGMA[:MAX]]"."""
        text = str(spec).strip()
        parts = text.split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", int(parts[0]))
            if parts[0] == "uniform" and len(parts) == 3:
                return cls("uniform", int(parts[1]), int(parts[1]), int(parts[2]))
            if len(parts) == 2 and parts[0].isdigit():
                return cls("uniform", int(parts[0]), int(parts[0]), int(parts[1]))
            if parts[0] == "lognormal" and 2 <= len(parts) <= 4:
                median = int(parts[1])
                sigma = float(parts[2]) if len(parts) > 2 else 1.0
                high = int(parts[3]) if len(parts) > 3 else 8 * median
                return cls("lognormal", median, 1, high, sigma)
        except ValueError as e:
            if "invalid literal" not in str(e) and "could not convert" not in str(e):
                raise
        raise ValueError(
            f"bad length spec {text!r}; use N, uniform:LOW:HIGH, LOW:HIGH or "
            "lognormal:MEDIAN[:SIGMA[:MAX]]"
        )

    @property
    def max_len(self) -> int:
        """Return the largest length this spec can produce."""
        return self.value if self.kind == "fixed" else self.high

    def sample(self, num: int, rng: random.Random) -> list[int]:
        """Draw `num` lengths."""
        if self.kind == "fixed":
            return [self.value] * num
        if self.kind == "uniform":
            return [rng.randint(self.low, self.high) for _ in range(num)]
        mu = math.log(self.value)
        return [
            min(self.high, max(self.low, round(rng.lognormvariate(mu, self.sigma))))
            for _ in range(num)
        ]

    def describe(self) -> str:
        """Return the spec as a parseable string."""
        if self.kind == "fixed":
            return str(self.value)
        if self.kind == "uniform":
            return f"uniform:{self.low}:{self.high}"
        return f"lognormal:{self.value}:{self.sigma:g}:{self.high}"


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: a prompt (token ids and its text) and how many tokens to generate."""

    prompt_token_ids: list[int]
    prompt: str
    output_len: int

    @property
    def prompt_len(self) -> int:
        """Return the prompt's length in tokens (as this tokenizer counts them)."""
        return len(self.prompt_token_ids)


def load_prompt_corpus(tokenizer: TokenizerLike) -> list[int]:
    """Return the token ids of the shipped public-domain texts, concatenated."""
    token_ids: list[int] = []
    for name in PROMPT_TEXTS:
        text = resources.files("infer8.eval").joinpath("data", name).read_text(encoding="utf-8")
        token_ids.extend(tokenizer.encode(text, add_special_tokens=False))
    return token_ids


def make_requests(
    tokenizer: TokenizerLike,
    num_requests: int,
    input_len: LengthSpec,
    output_len: LengthSpec,
    seed: int = 0,
    vocab_size: int | None = None,
) -> list[BenchRequest]:
    """Cut `num_requests` prompts of sampled lengths from real text, each from its own offset.

    Distinct offsets keep prompts from sharing a prefix, so prefix caching does not skew a
    throughput run. Token ids at or above `vocab_size` (a tokenizer larger than the model's
    embedding) are folded into range.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = random.Random(seed)
    input_lens = input_len.sample(num_requests, rng)
    output_lens = output_len.sample(num_requests, rng)
    corpus = load_prompt_corpus(tokenizer)
    longest = max(input_lens)
    while len(corpus) < longest + num_requests:
        corpus = corpus + corpus
    if vocab_size is not None:
        corpus = [t % vocab_size for t in corpus]
    offsets = rng.sample(range(len(corpus) - longest), num_requests)
    requests = []
    for offset, n_in, n_out in zip(offsets, input_lens, output_lens):
        ids = corpus[offset : offset + n_in]
        requests.append(BenchRequest(ids, tokenizer.decode(ids), n_out))
    return requests


def workload_summary(requests: list[BenchRequest]) -> dict[str, Any]:
    """Return counts and length statistics of a workload (for reports)."""
    ins = [r.prompt_len for r in requests]
    outs = [r.output_len for r in requests]
    return {
        "num_requests": len(requests),
        "input_tokens_total": sum(ins),
        "output_tokens_total": sum(outs),
        "input_len_mean": sum(ins) / len(ins),
        "input_len_max": max(ins),
        "output_len_mean": sum(outs) / len(outs),
        "output_len_min": min(outs),
        "output_len_max": max(outs),
    }
