"""The external reference: Hugging Face transformers `generate` (static batches) on the same prompts."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch

from infer8.bench.flops import ModelFlops
from infer8.bench.workload import BenchRequest
from infer8.progress import progress_bar


def _load_hf_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device) -> Any:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise RuntimeError(
            "--hf-baseline needs Hugging Face transformers (a test-only dependency of infer8): "
            "pip install transformers"
        ) from None
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"--hf-baseline needs a Hugging Face model directory, got {model_dir}")
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


@torch.inference_mode()
def _generate(model: Any, batch: list[BenchRequest], pad_id: int, device: torch.device) -> int:
    """Generate one left-padded batch until its longest output; return tokens generated."""
    width = max(r.prompt_len for r in batch)
    num_new = max(r.output_len for r in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):
        input_ids[i, width - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
        mask[i, width - r.prompt_len :] = 1
    out = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=num_new,
        min_new_tokens=num_new,  # as ignore_eos: the batch runs to its longest request
        do_sample=False,
        pad_token_id=pad_id,
    )
    return (out.shape[1] - width) * len(batch)


def run_hf_baseline(
    model_dir: str | Path,
    requests: list[BenchRequest],
    batch_size: int,
    dtype: torch.dtype,
    device: torch.device,
    pad_token_id: int,
    flops: ModelFlops | None = None,
    peak_flops_per_s: float | None = None,
    use_tqdm: bool = True,
) -> dict[str, Any]:
    """Run the requests through `generate` in fixed batches of `batch_size`, in order.

    A batch generates until its longest request's output length (greedy, EOS ignored); the
    useful output of each request is its own `output_len`, the rest is padding waste, exactly
    as in infer8's static scheduler.
    """
    model = _load_hf_model(model_dir, dtype, device)
    warm = [dataclasses.replace(r, output_len=4) for r in requests[:2]]
    _generate(model, warm, pad_token_id, device)  # warm-up: thread pools, first-call costs
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    generated = 0
    t0 = time.perf_counter()
    for batch in progress_bar(batches, desc="hf generate", disable=not use_tqdm, unit="batch"):
        generated += _generate(model, batch, pad_token_id, device)
    elapsed_s = time.perf_counter() - t0
    useful = sum(r.output_len for r in requests)
    result: dict[str, Any] = {
        "engine": f"transformers generate (static batches of {batch_size})",
        "batch_size": batch_size,
        "dtype": str(dtype).removeprefix("torch."),
        "num_requests": len(requests),
        "elapsed_s": elapsed_s,
        "output_tokens": useful,
        "generated_tokens": generated,
        "output_tokens_per_s": useful / elapsed_s,
        "generated_tokens_per_s": generated / elapsed_s,
        "padding_waste_pct": 100.0 * (generated - useful) / max(1, generated),
    }
    if flops is not None:
        model_flops = sum(flops.request_flops(r.prompt_len, r.output_len) for r in requests)
        result["model_flops_per_s"] = model_flops / elapsed_s
        if peak_flops_per_s:
            result["compute_utilization_pct"] = 100.0 * model_flops / elapsed_s / peak_flops_per_s
    del model
    return result
