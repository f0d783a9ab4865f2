"""`infer8 eval gsm8k`: exact-match accuracy of final answers with each KV-cache dtype."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from infer8.config import EngineArgs
from infer8.entrypoints.llm import LLM
from infer8.eval.kv_accuracy import eval_args
from infer8.sampling_params import SamplingParams

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
INSTRUCTION = "Solve the problem. End your answer with '#### <number>'.\n\n"


def read_gsm8k(path: str | Path) -> list[tuple[str, str]]:
    """Return (question, final answer) pairs from GSM8K JSONL (`answer` ends in '#### N')."""
    items = []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            question, answer = row["question"], row["answer"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{i}: not a GSM8K record ({e})") from None
        if "####" not in answer:
            raise ValueError(f"{path}:{i}: answer does not end in '#### <number>'")
        items.append((question, normalize(answer.split("####")[-1])))
    if not items:
        raise ValueError(f"{path} has no questions")
    return items


def normalize(text: str) -> str:
    """Return a number's canonical text ('1,000.50' -> '1000.5')."""
    text = text.strip().replace(",", "").rstrip(".")
    try:
        value = float(text)
    except ValueError:
        return text
    return str(int(value)) if value == int(value) else str(value)


def extract_answer(completion: str) -> str | None:
    """Return the number after '####', else the last number in the completion."""
    tail = completion.split("####")[-1] if "####" in completion else completion
    numbers = _NUMBER.findall(tail) or _NUMBER.findall(completion)
    return normalize(numbers[-1]) if numbers else None


def run_gsm8k(
    args: EngineArgs,
    data: str | Path,
    kv_cache_dtypes: list[str],
    max_tokens: int = 256,
    limit: int | None = None,
) -> dict[str, Any]:
    """Answer every question greedily with each KV dtype; return accuracies and the deltas."""
    items = read_gsm8k(data)[:limit]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    results: dict[str, Any] = {"data": str(data), "num_questions": len(items), "groups": {}}
    for kv in kv_cache_dtypes:
        llm = LLM(**dataclasses.asdict(eval_args(args, kv_cache_dtype=kv)))
        outs = llm.chat([[{"role": "user", "content": INSTRUCTION + q}] for q, _ in items], params)
        answers = [extract_answer(o.outputs[0].text) for o in outs]
        correct = [a == gold for a, (_, gold) in zip(answers, items)]
        results["groups"][kv] = {
            "accuracy": sum(correct) / len(items),
            "num_correct": sum(correct),
            "answers": answers,
        }
    base = results["groups"][kv_cache_dtypes[0]]["accuracy"]
    for kv in kv_cache_dtypes[1:]:
        group = results["groups"][kv]
        group["accuracy_delta"] = group["accuracy"] - base
        ref_answers = results["groups"][kv_cache_dtypes[0]]["answers"]
        group["answer_agreement"] = sum(
            a == b for a, b in zip(group["answers"], ref_answers)
        ) / len(items)
    return results
