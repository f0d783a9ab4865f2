"""Sweep the FP8 exact tail and Hadamard rotation on one text: KL, top-1, perplexity vs the auto cache.

    python benchmarks/kv_tail_sweep.py float32 areopagitica.txt fp8_e4m3:0:0 fp8_e4m3:24:1:4

Each variant is KV_DTYPE:TAIL_TOKENS:HADAMARD(0/1)[:SINK_TOKENS] (sinks: auto when left out);
the same teacher-forced scoring as
`infer8 eval kv` (2,048 tokens, 512-token chunks through the engine's paged cache).
"""

from __future__ import annotations

import sys
import time

import torch

from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.eval.kv_accuracy import load_text
from infer8.eval.scoring import score_tokens


def main(dtype: str, text: str, variants: list[str]) -> None:
    """Print one line per variant."""
    common = dict(dtype=dtype, kv_cache_memory_bytes=128 << 20, max_num_seqs=4)
    ref = LLMEngine(EngineArgs(kv_cache_dtype="auto", **common))
    tokens = ref.tokenizer.encode(load_text(text), add_special_tokens=False)[:2048]
    ref_lp = score_tokens(ref, tokens)
    target = torch.tensor(tokens[1:])[:, None]
    nll_ref = -ref_lp[:-1].gather(1, target).mean().item()
    del ref
    for v in variants:
        kv, tail, rot, *sinks = v.split(":")
        engine = LLMEngine(
            EngineArgs(
                kv_cache_dtype=kv,
                kv_cache_exact_tail_tokens=int(tail),
                kv_cache_exact_sink_tokens=int(sinks[0]) if sinks else None,
                kv_cache_hadamard=rot == "1",
                **common,
            )
        )
        t0 = time.perf_counter()
        lp = score_tokens(engine, tokens)
        nll = -lp[:-1].gather(1, target).mean().item()
        kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).mean().item()
        top1 = (ref_lp.argmax(-1) == lp.argmax(-1)).float().mean().item()
        ppl = 100 * (torch.tensor(nll - nll_ref).exp().item() - 1)
        print(
            f"{dtype} {text} {v}: KL {kl:.2e} top1 {100 * top1:.2f}% ppl {ppl:+.3f}% "
            f"({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
        del engine


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
