"""The engine-level sections of benchmarks/gpu_check.py: they run on any device.

Each builds small random-weight models on disk and runs them through the engine (LLM, the
Worker, the Sampler), so the CPU tests run every section with tiny shapes and the GPU run
checks the same code on CUDA. Every section collects its failures and raises them at its end.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

# Teacher-forced agreement with the bf16 run (same compute dtype), over SCORE_TOKENS positions
# of a random-weight model whose next-token distributions are nearly flat (its top-1 is fragile;
# KL is the robust figure). Measured on CPU (bf16 compute): FP8 cache KL 1.7e-3 (tail and
# rotation) / 2.5e-3 (plain), top-1 0.93; FP8 weights KL 1.3e-2, top-1 0.82 (weights only; the
# GPU's _scaled_mm quantizes activations too, hence the wider bound).
FP8_KV_MAX_KL, FP8_KV_MIN_TOP1 = 0.01, 0.85
FP8_WEIGHTS_MAX_KL, FP8_WEIGHTS_MIN_TOP1 = 0.05, 0.7
SCORE_TOKENS = 400
# The engine may exceed utilization x device memory by at most this much after its heaviest
# steps (allocator rounding, a library workspace created late).
MEMORY_SLACK_BYTES = 512 << 20

SMOKE_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 512,
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "attention_bias": True, "bos_token_id": 1,
    "eos_token_id": 4, "torch_dtype": "float32",
}  # fmt: skip
# The memory section's model on a GPU: 8 layers of 8 KV heads x 128 (32 KiB of bf16 KV per
# token), so 256 requests of 32K tokens want far more than an H200 holds: the budget is "left".
MEMORY_CONFIG: dict[str, Any] = {
    "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
    "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 32768, "torch_dtype": "bfloat16",
}  # fmt: skip


def write_smoke_model(out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a small random-weight Qwen2-shaped model (config, safetensors, tokenizer)."""
    from safetensors.torch import save_file

    from infer8.models.gguf_metadata import expected_shapes

    sys.path.insert(0, str(ROOT))
    from tests.utils import build_tokenizer

    config = {**SMOKE_CONFIG, **overrides}
    dtype = getattr(torch, config["torch_dtype"])
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=dtype)
        else:  # large enough that greedy tokens are decided by clear margins
            w = torch.randn(shape, generator=gen) * (0.5 if "bias" in name else 0.08)
            weights[name] = w.to(dtype)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config))
    build_tokenizer(out_dir, vocab_size=300)
    return out_dir


SMOKE_PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 90)), [300, 301, 302], list(range(100, 260))]


def _llm(model_dir: Path, device: str, **kwargs: Any) -> Any:
    from infer8 import LLM

    kwargs.setdefault("kv_cache_memory_bytes", 64 << 20)
    return LLM(str(model_dir), device=device, max_model_len=512, max_num_seqs=8, **kwargs)


def _greedy(model_dir: Path, device: str, **kwargs: Any) -> tuple[list[list[int]], Any]:
    from infer8 import SamplingParams

    llm = _llm(model_dir, device, **kwargs)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = llm.generate(SMOKE_PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def _raise_failures(name: str, out: dict[str, Any]) -> dict[str, Any]:
    _log(f"\n## {name}\n" + json.dumps(out, indent=1, default=str))
    if out["failures"]:
        raise AssertionError("; ".join(out["failures"]))
    return out


def _log(msg: str) -> None:
    print(msg, flush=True)


def engine_smoke(device: torch.device, work_dir: Path) -> dict[str, Any]:
    """Run the engine on `device` and check it against itself and the CPU reference."""
    from infer8 import SamplingParams

    model_dir = write_smoke_model(work_dir / "smoke-model")
    out: dict[str, Any] = {"failures": []}
    dev = device.type
    reference, _ = _greedy(model_dir, "cpu", dtype="float32")
    eager32, _ = _greedy(model_dir, dev, dtype="float32", enforce_eager=True)
    out["eager_fp32_matches_cpu_reference"] = eager32 == reference
    if eager32 != reference:
        out["failures"].append("float32 eager tokens differ from the CPU reference")
    eager, _ = _greedy(model_dir, dev, dtype="bfloat16", enforce_eager=True)
    graphs, _ = _greedy(model_dir, dev, dtype="bfloat16")
    out["graphs_match_eager_bf16"] = graphs == eager
    if graphs != eager:
        out["failures"].append("CUDA-graph tokens differ from eager tokens (bf16)")
    # the FP8 cache's exact tail and rotation (the defaults): graphs replay what eager computes
    fp8, _ = _greedy(model_dir, dev, dtype="bfloat16", kv_cache_dtype="fp8_e4m3")
    fp8_eager, llm = _greedy(model_dir, dev, dtype="bfloat16", kv_cache_dtype="fp8_e4m3",
                             enforce_eager=True)  # fmt: skip
    out["fp8_uses_tail_and_rotation"] = llm.engine.worker.uses_exact_tail
    if dev == "cuda" and not llm.engine.worker.uses_exact_tail:
        out["failures"].append("the FP8 cache runs without its exact tail / rotation")
    out["fp8_tail_graphs_match_eager"] = fp8 == fp8_eager
    if fp8 != fp8_eager:
        out["failures"].append("CUDA-graph tokens differ from eager tokens (FP8 exact tail)")
    # a prefix-cache hit: the same long prompt twice gives the same tokens, the second cached
    _, llm = _greedy(model_dir, dev, dtype="bfloat16")
    stats: list[Any] = []
    llm.engine.stat_loggers.append(stats.append)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    again = llm.generate([SMOKE_PROMPTS[3]], params, use_tqdm=False)[0].outputs[0].token_ids
    hits = sum(s.num_prefix_cache_hits for s in stats)
    out["prefix_cache_hit_tokens"] = hits
    if hits == 0 or again != eager[3][:8]:
        out["failures"].append(
            f"prefix cache: {hits} hit tokens, tokens equal: {again == eager[3][:8]}"
        )
    if dev == "cuda" and torch.cuda.device_count() >= 2:
        tp2, llm2 = _greedy(model_dir, dev, dtype="float32", enforce_eager=True,
                            tensor_parallel_size=2)  # fmt: skip
        llm2.engine.executor.shutdown()
        out["tp2_matches_tp1_fp32"] = tp2 == eager32
        if tp2 != eager32:
            out["failures"].append("TP=2 tokens differ from TP=1 (float32)")
    else:
        out["tp2_matches_tp1_fp32"] = "skipped: fewer than 2 GPUs"
    return _raise_failures("engine smoke", out)


# -- FP8 agreement with bf16: the cache (with and without the exact tail), the weights ---------


def _score(
    model_dir: Path, device: str, tokens: list[int], **kwargs: Any
) -> tuple[torch.Tensor, Any]:
    """Return teacher-forced log-probabilities [len(tokens), vocab] (CPU) and the engine."""
    from infer8.eval.scoring import score_tokens

    llm = _llm(model_dir, device, dtype="bfloat16", **kwargs)
    return score_tokens(llm.engine, tokens).float().cpu(), llm.engine


def _agreement(ref_lp: torch.Tensor, lp: torch.Tensor) -> dict[str, float]:
    """Return the mean KL(ref || test), top-1 agreement and the largest probability change."""
    return {
        "kl_mean": (ref_lp.exp() * (ref_lp - lp)).sum(-1).mean().item(),
        "top1_agreement": (ref_lp.argmax(-1) == lp.argmax(-1)).float().mean().item(),
        "max_prob_diff": (ref_lp.exp() - lp.exp()).abs().max().item(),
    }


def agreement_failure(name: str, r: dict[str, float], max_kl: float, min_top1: float) -> str | None:
    """Return why `r` misses its bounds (a NaN misses both), or None."""
    if r["kl_mean"] <= max_kl and r["top1_agreement"] >= min_top1:
        return None
    return (
        f"{name}: KL {r['kl_mean']:.2e} (bound {max_kl}), top-1 "
        f"{r['top1_agreement']:.3f} (bound {min_top1})"
    )


def fp8_agreement(device: torch.device, work_dir: Path) -> dict[str, Any]:
    """Score one sequence with bf16, an FP8 cache (tail on / off) and FP8 weights; bound each.

    Every run goes through the engine's Worker (quantize-on-load for --quantization fp8) and
    its paged cache, teacher-forced, so the bounds hold per position, not per greedy path.
    """
    from infer8.layers.fp8_linear import Fp8Linear

    model_dir = write_smoke_model(work_dir / "fp8-model")
    dev = device.type
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(5, SMOKE_CONFIG["vocab_size"], (SCORE_TOKENS,), generator=gen).tolist()
    out: dict[str, Any] = {"failures": [], "tokens": SCORE_TOKENS}
    ref, _ = _score(model_dir, dev, tokens)
    variants = {
        "fp8 cache, tail + rotation": ({"kv_cache_dtype": "fp8_e4m3"}, FP8_KV_MAX_KL, FP8_KV_MIN_TOP1),
        "fp8 cache, no tail": (
            {"kv_cache_dtype": "fp8_e4m3", "kv_cache_exact_tail_tokens": 0,
             "kv_cache_hadamard": False},
            FP8_KV_MAX_KL, FP8_KV_MIN_TOP1,
        ),
        "fp8 weights": ({"quantization": "fp8"}, FP8_WEIGHTS_MAX_KL, FP8_WEIGHTS_MIN_TOP1),
    }  # fmt: skip
    for name, (kwargs, max_kl, min_top1) in variants.items():
        lp, engine = _score(model_dir, dev, tokens, **kwargs)
        out[name] = r = _agreement(ref, lp)
        failure = agreement_failure(name, r, max_kl, min_top1)
        if failure is not None:
            out["failures"].append(failure)
        if name == "fp8 weights":
            fp8_layers = [m for m in engine.worker.model.modules() if isinstance(m, Fp8Linear)]
            out["fp8_linear_layers"] = len(fp8_layers)
            out["uses_scaled_mm"] = any(m.use_scaled_mm for m in fp8_layers)
            if not fp8_layers:
                out["failures"].append("--quantization fp8 left no Fp8Linear layer")
        elif dev == "cuda" and name.endswith("rotation") and not engine.worker.uses_exact_tail:
            out["failures"].append("the default FP8 cache runs without its tail / rotation")
    return _raise_failures("FP8 agreement with bf16", out)


# -- the start-up memory profile ----------------------------------------------------------------


def memory_split(
    device: torch.device,
    work_dir: Path,
    utilization: float = 0.94,
    max_num_seqs: int = 256,
    kv_cache_dtype: str = "fp8_e4m3",
    **config: Any,
) -> dict[str, Any]:
    """Start one engine with the default memory profile; report the split, check it holds.

    The FP8 cache with its defaults (exact-tail rings and rotation: the production set-up).
    No kv_cache_memory_bytes: on a GPU the activations are measured and the KV cache gets what
    is left of utilization x device memory. Then the heaviest steps run (a full token budget of
    prefill, max_num_seqs decodes) and the device's use must stay within the budget.
    """
    from infer8 import LLM, SamplingParams

    model_dir = write_smoke_model(work_dir / "memory-model", **(config or MEMORY_CONFIG))
    is_cuda = device.type == "cuda"
    gc.collect()  # earlier sections' engines (reference cycles) must not hold device memory
    if is_cuda:
        torch.cuda.empty_cache()
    llm = LLM(str(model_dir), device=device.type, gpu_memory_utilization=utilization,
              max_num_seqs=max_num_seqs, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    worker = llm.engine.worker
    plan = worker.memory_plan
    kv_allocated = sum(
        t.numel() * t.element_size()
        for c in worker.kv_caches
        for t in (c.k, c.v, c.k_scale, c.v_scale, *(c.tail_store or ()))  # blocks and tail rings
        if t is not None
    )
    out: dict[str, Any] = {
        "failures": [],
        "report": plan.report(not is_cuda),
        "source": plan.source,
        "is_measured": plan.is_measured,
        "device_gib": plan.device_bytes / 2**30,
        "weights_gib": plan.weight_bytes / 2**30,
        "activations_gib": plan.activation_bytes / 2**30,
        "graph_reserve_gib": plan.graph_bytes / 2**30,
        "other_gib": plan.other_bytes / 2**30,
        "kv_budget_gib": plan.kv_bytes / 2**30,
        "kv_allocated_gib": kv_allocated / 2**30,
        "num_blocks": worker.num_blocks,
        "max_model_len": worker.max_model_len,
    }
    if kv_allocated > plan.kv_bytes:
        out["failures"].append(f"KV cache allocated {kv_allocated} > its budget {plan.kv_bytes}")
    if is_cuda:
        # "need": what max_num_seqs x max_model_len can fill was less than the measured rest
        if not plan.is_measured or plan.source not in ("left", "need"):
            out["failures"].append(
                f"the default start-up did not size the cache from a measured profile "
                f"(source {plan.source!r}, measured {plan.is_measured})"
            )
        if plan.activation_bytes <= 0 or (worker.uses_cuda_graphs and plan.graph_bytes <= 0):
            out["failures"].append("no activation or graph reserve was deducted")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        # device memory outside the allocator (context, kernels, graphs), after start-up
        out["outside_allocator_after_start_gib"] = (
            total_bytes - free_bytes - torch.cuda.memory_reserved(device)
        ) / 2**30
    # the heaviest steps: prompts filling the token budget, then max_num_seqs decodes at once
    budget = llm.engine.scheduler_config.max_num_batched_tokens
    long_len = min(worker.max_model_len - 16, 2 * budget)
    vocab = SMOKE_CONFIG["vocab_size"]
    prompts = [[(7 * i + j) % (vocab - 10) + 5 for j in range(long_len)] for i in range(2)]
    prompts += [[(i + j) % (vocab - 10) + 5 for j in range(32)] for i in range(max_num_seqs)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    out["workload"] = f"2 x {long_len} + {max_num_seqs} x 32 prompt tokens, 8 new tokens each"
    if any(len(o.outputs[0].token_ids) != 8 for o in outs):
        out["failures"].append("a request of the heaviest steps did not finish")
    if is_cuda:
        torch.cuda.synchronize()
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        used = total_bytes - free_bytes
        limit = int(utilization * total_bytes) + MEMORY_SLACK_BYTES
        out["used_after_workload_gib"] = used / 2**30
        out["outside_allocator_after_workload_gib"] = (
            used - torch.cuda.memory_reserved(device)
        ) / 2**30
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
        out["limit_gib"] = limit / 2**30
        if used > limit:
            out["failures"].append(
                f"device use {used / 2**30:.2f} GiB after the heaviest steps exceeds "
                f"{utilization} x device + {MEMORY_SLACK_BYTES >> 20} MiB ({limit / 2**30:.2f} GiB)"
            )
    del llm, worker
    gc.collect()  # the next section gets the device back
    return _raise_failures("memory split", out)


# -- sampling on the device --------------------------------------------------------------------


def _states(params: list[Any], device: torch.device, outputs: list[list[int]]) -> list[Any]:
    from infer8.worker.sampler import SamplingState

    return [
        SamplingState(
            p, prompt_token_ids=[1, 2, 3], output_token_ids=list(o),
            generator=torch.Generator(device=device).manual_seed(p.seed)
            if p.seed is not None else None,
        )
        for p, o in zip(params, outputs)
    ]  # fmt: skip


def sampling(device: torch.device, vocab: int = 4096, draws: int = 64) -> dict[str, Any]:
    """Sample on the device: seeds reproduce, top-k / top-p supports hold, penalties equal CPU's.

    Rows: top-k 2 (its frequency must match the two tokens' renormalized probability within
    5 sigma), top-k 5, top-p 0.5, min-p 0.2, plain temperature 1 (all seeded), and greedy rows
    with repetition / presence / frequency penalties (their tokens must equal the CPU
    sampler's on the same logits).
    """
    from infer8.sampling_params import SamplingParams
    from infer8.worker.sampler import Sampler

    gen = torch.Generator().manual_seed(0)
    base = torch.randn(vocab, generator=gen)  # below the head's 9.0 .. 4.0 by far
    base[:8] = torch.tensor([9.0, 8.6, 8.0, 7.5, 7.0, 6.0, 5.0, 4.0])  # a clear head
    seeded = [
        SamplingParams(temperature=1.0, top_k=2, seed=11),
        SamplingParams(temperature=1.0, top_k=5, seed=12),
        SamplingParams(temperature=1.0, top_p=0.5, seed=13),
        SamplingParams(temperature=1.0, min_p=0.2, seed=14),
        SamplingParams(temperature=1.0, seed=15),
    ]
    penalised = [
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
        SamplingParams(temperature=0.0, presence_penalty=1.5),
        SamplingParams(temperature=0.0, frequency_penalty=0.3),
    ]
    params = seeded + penalised
    outputs = [[]] * len(seeded) + [[0, 1], [0, 2], [0, 0, 0, 1]]
    logits = base.repeat(len(params), 1)  # [rows, vocab]
    probs = torch.softmax(base.double(), -1)
    order = probs.argsort(descending=True)
    nucleus = int((probs[order].cumsum(0) < 0.5).sum()) + 1
    supports = {
        0: set(order[:2].tolist()),
        1: set(order[:5].tolist()),
        2: set(order[: nucleus + 1].tolist()),  # one token of slack for rounding at the edge
        3: set(torch.nonzero(probs >= 0.2 * probs.max() * 0.999).flatten().tolist()),
    }
    out: dict[str, Any] = {"failures": [], "draws": draws}

    def run(dev: torch.device) -> list[list[int]]:
        sampler = Sampler(dev, seed=0)
        states = _states(params, dev, outputs)
        rows = []
        for _ in range(draws):
            result = sampler(logits.to(dev), states)
            if result.errors:
                out["failures"].append(f"sampler row errors: {result.errors}")
                break
            rows.append(result.token_ids)
        return [list(col) for col in zip(*rows)]  # [row][draw]

    first, second = run(device), run(device)
    out["seeds_reproduce"] = first[: len(seeded)] == second[: len(seeded)]
    if not out["seeds_reproduce"]:
        out["failures"].append("seeded rows sampled different tokens on a second run")
    for row, support in supports.items():
        outside = sorted(set(first[row]) - support)
        if outside:
            out["failures"].append(f"{params[row]!r}: sampled {outside} outside its support")
    p0, p1 = probs[order[0]].item(), probs[order[1]].item()
    share = p0 / (p0 + p1)
    hits = sum(t == int(order[0]) for t in first[0])
    sigma = (draws * share * (1 - share)) ** 0.5
    out["top_k2_first_token_share"] = {"sampled": hits / draws, "expected": share}
    if abs(hits - draws * share) > 5 * sigma:
        out["failures"].append(f"top-k 2: first token {hits}/{draws}, expected {share:.3f}")
    out["temperature_1_distinct_tokens"] = len(set(first[4]))
    if len(set(first[4])) < 2:
        out["failures"].append("temperature 1 sampled one token every time")
    cpu = run(torch.device("cpu")) if device.type != "cpu" else first
    greedy = slice(len(seeded), len(params))
    out["penalised_greedy_tokens"] = [col[0] for col in first[greedy]]
    if first[greedy] != cpu[greedy]:
        out["failures"].append("penalised greedy rows differ from the CPU sampler's")
    if out["penalised_greedy_tokens"][0] == int(order[0]):
        out["failures"].append("a repetition penalty of 2 left the repeated top token on top")
    return _raise_failures("sampling", out)
