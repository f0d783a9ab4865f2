"""`infer8 bench lora`: W1 through the base model alone, one LoRA adapter, and N adapters mixed.

Adapters are random PEFT adapters of the given rank on every projection (q/k/v/o/gate/up/
down), written for the model being measured; each group is one engine in a fresh process, one
after the other, on the same W1 requests (greedy, fixed lengths): output tokens per second and
its ratio to the base model alone.
"""

from __future__ import annotations

import json
import multiprocessing
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from infer8.bench.report import markdown_table
from infer8.bench.throughput import bench_engine_args, run_workload, warm_up
from infer8.bench.workload import LengthSpec, make_requests
from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.lora.config import LoRARequest
from infer8.lora.peft import TARGET_MODULES, module_shapes
from infer8.models.llama import LlamaArchConfig
from infer8.models.loader import read_hf_config, resolve_model_path


def write_random_adapter(
    arch: LlamaArchConfig, path: Path, rank: int, seed: int, target_modules: list[str] | None = None
) -> Path:
    """Write a PEFT LoRA adapter with random A and B (a trained adapter's scale) into path."""
    path.mkdir(parents=True, exist_ok=True)
    targets = target_modules or list(TARGET_MODULES)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": targets, "task_type": "CAUSAL_LM"}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_hidden_layers):
        for module in targets:
            in_features, out_features = module_shapes(arch)[module]
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = (
                torch.randn(rank, in_features, generator=gen) / in_features**0.5
            )
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.01
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def _run_group(
    args: EngineArgs, name: str, adapters: list[str], num_requests: int, use_tqdm: bool
) -> dict[str, Any]:
    """Build one group's engine and run W1 on it (in a process of its own)."""
    lora = dict(enable_lora=True, max_loras=len(adapters), max_lora_rank=64) if adapters else {}
    engine = LLMEngine(bench_engine_args(args, **lora))
    requests = make_requests(
        engine.tokenizer, num_requests, LengthSpec.parse("128"), LengthSpec.parse("128"),
        seed=args.seed, vocab_size=engine.vocab_size,
    )  # fmt: skip
    loras = [LoRARequest(Path(p).name, i + 1, p) for i, p in enumerate(adapters)]
    per_request = [loras[i % len(loras)] if loras else None for i in range(num_requests)]
    warm_up(engine, requests)
    result = run_workload(
        engine, requests, desc=f"{name}: W1 x{num_requests}", use_tqdm=use_tqdm,
        lora_requests=per_request,
    )  # fmt: skip
    return {"group": name, "num_adapters": len(adapters),
            "output_tok_s": result["output_tokens_per_s"]}  # fmt: skip


def run_lora_bench(
    args: EngineArgs,
    num_adapters: int = 4,
    rank: int = 16,
    num_requests: int = 64,
    rounds: int = 1,
    use_tqdm: bool = True,
) -> dict[str, Any]:
    """Run W1 on the base model, one adapter and `num_adapters` mixed, `rounds` times in turn;
    return each group's output tok/s and its ratio to the base in the same round."""
    arch = LlamaArchConfig.from_hf_config(read_hf_config(Path(resolve_model_path(args.model))))
    spawn = multiprocessing.get_context("spawn")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="infer8-lora-bench-") as tmp:
        adapters = [
            str(write_random_adapter(arch, Path(tmp) / f"adapter{i}", rank, seed=i))
            for i in range(num_adapters)
        ]
        groups = [("base", []), ("1 adapter", adapters[:1]), (f"{num_adapters} adapters", adapters)]
        for round_index in range(rounds):
            for name, group_adapters in groups:
                with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
                    job = (args, name, group_adapters, num_requests, use_tqdm)
                    row = pool.submit(_run_group, *job).result()
                row["round"] = round_index
                rows.append(row)
    for row in rows:
        base = next(r for r in rows if r["round"] == row["round"] and r["group"] == "base")
        row["ratio"] = row["output_tok_s"] / base["output_tok_s"]
    return {"rows": rows, "rank": rank, "num_requests": num_requests, "dtype": args.dtype}


def format_lora(result: dict[str, Any]) -> str:
    """Return the markdown table of a run."""
    table = [
        [str(r["round"]), r["group"], f"{r['output_tok_s']:.0f}", f"{r['ratio']:.3f}x"]
        for r in result["rows"]
    ]
    header = ["round", f"W1 {result['num_requests']} x 128/128, rank {result['rank']}",
              "output tok/s", "vs base"]  # fmt: skip
    return markdown_table(header, table)
