"""Teacher-forced scoring through the engine's own paged-cache path (for accuracy harnesses)."""

from __future__ import annotations

import torch

from infer8.attention.exact_tail import build_tail_metadata
from infer8.attention.metadata import build_attention_metadata
from infer8.engine import LLMEngine
from infer8.request import Request
from infer8.sampling_params import SamplingParams


@torch.inference_mode()
def score_tokens(engine: LLMEngine, token_ids: list[int], chunk_tokens: int = 512) -> torch.Tensor:
    """Return float32 log-probabilities [len(token_ids), vocab] of each next token.

    The sequence is prefilled in chunks exactly as the scheduler would serve it: each chunk's
    K/V is written into (and, for an FP8 cache, quantized in) the paged cache, and attention
    reads the cache back, so the numbers include the cache's quantization error.
    """
    assert not engine.has_unfinished_requests(), "score on an idle engine"
    if engine.worker.tp_group is not None:  # the model runs here alone: workers would not join
        raise ValueError("scoring runs on one device; use --tensor-parallel-size 1")
    n = len(token_ids)
    if n > engine.max_model_len:
        raise ValueError(f"{n} tokens exceed max_model_len {engine.max_model_len}")
    manager = engine.kv_cache_manager
    req_id = "__score__"
    # Its own cache salt: whatever it leaves in the prefix cache is never reused by a request.
    request = Request(req_id, token_ids, SamplingParams(max_tokens=1), [], cache_salt=req_id)
    if not manager.can_seat() or manager.allocate_slots(request, n) is None:
        raise ValueError(f"the KV cache cannot hold {n} tokens")
    # a seat of its own, computed from position 0, from the KV cache manager like a request's
    manager.seat(request)
    seat = manager.get_seat(req_id)
    try:
        block_ids = manager.get_block_ids(req_id)
        device = engine.model_config.device
        runner = engine.worker.runner
        out = []
        for start in range(0, n, chunk_tokens):
            chunk = token_ids[start : start + chunk_tokens]
            meta = build_attention_metadata(
                [len(chunk)], [start], [block_ids], engine.cache_config.block_size, device
            )
            if runner.has_tail:
                assert seat is not None
                meta.tail = build_tail_metadata(
                    runner.exact_tail_tokens,
                    runner.exact_sink_tokens,
                    [seat.row],
                    [seat.exact_start],
                    [(seat.sink_slot, seat.writes_sinks)],
                    [len(chunk)],
                    [start],
                    meta.decode_seq_ids,
                    meta.decode_block_tables.shape[1] * engine.cache_config.block_size,
                    device,
                )
            hidden = engine.worker.model(
                torch.tensor(chunk, device=device),
                torch.arange(start, start + len(chunk), device=device),
                meta,
                engine.worker.kv_caches,
            )
            out.append(torch.log_softmax(engine.worker.model.compute_logits(hidden), dim=-1))
        return torch.cat(out)
    finally:
        manager.free(req_id)
