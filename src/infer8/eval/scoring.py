"""Teacher-forced scoring through the engine's own paged-cache path (for accuracy harnesses)."""

from __future__ import annotations

import torch

from infer8.engine import LLMEngine


def score_tokens(engine: LLMEngine, token_ids: list[int], chunk_tokens: int = 512) -> torch.Tensor:
    """Return float32 log-probabilities [len(token_ids), vocab] of each next token.

    The sequence is prefilled in chunks exactly as the scheduler would serve it: each chunk's
    K/V is written into (and, for an FP8 cache, quantized in) the paged cache, and attention
    reads the cache back, so the numbers include the cache's quantization error
    (LLMEngine.score_tokens).
    """
    return engine.score_tokens(token_ids, chunk_tokens)
