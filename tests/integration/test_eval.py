"""The accuracy harnesses: eval kv JSON, calibrate-kv round trip, gsm8k on the real model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infer8.cli import main
from infer8.config import EngineArgs
from infer8.eval.gsm8k import extract_answer, read_gsm8k, run_gsm8k
from infer8.eval.kv_accuracy import calibrate_kv, run_kv_eval

REQUIRED_KEYS = {
    "kv_cache_dtype",
    "kv_scale",
    "ref_perplexity",
    "perplexity",
    "perplexity_delta_rel",
    "kl_mean",
    "top1_agreement",
    "greedy_match_tokens_mean",
    "num_tokens_evaluated",
    "kv_tokens_capacity_ref",
    "kv_tokens_capacity",
}


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. Hello world! " * 40)
    return path


def test_eval_kv_reports_every_key_consistently(llama_dir: Path, text_file: Path) -> None:
    args = EngineArgs(model=str(llama_dir), dtype="float32", kv_cache_dtype="fp8_e4m3")
    r = run_kv_eval(
        args, num_tokens=200, text=str(text_file), num_prompts=3, prompt_tokens=16, greedy_tokens=8
    )
    assert REQUIRED_KEYS <= set(r)
    assert r["kv_cache_dtype"] == "fp8_e4m3" and r["kv_scale"] == "dynamic"
    assert r["num_tokens_evaluated"] == 199
    assert r["perplexity_delta_rel"] == pytest.approx(r["perplexity"] / r["ref_perplexity"] - 1)
    assert 0.8 <= r["top1_agreement"] <= 1.0 and 0 <= r["kl_mean"] < 0.01
    assert 0 <= r["greedy_match_tokens_mean"] <= 8
    # fp32 reference cache (4 B) vs fp8 + bf16 scales (1 B + 2 B per 16 elements)
    assert r["kv_tokens_capacity"] / r["kv_tokens_capacity_ref"] == pytest.approx(64 / 18, rel=0.01)


def test_calibrate_then_static_eval_uses_the_file(
    llama_dir: Path, text_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "scales.json"
    args = EngineArgs(model=str(llama_dir), dtype="float32")
    data = calibrate_kv(args, out, num_tokens=300, text=str(text_file), granularity="head")
    assert data["granularity"] == "head" and len(data["k_amax"]) == 2
    assert all(0 < a < 1e4 for layer in data["k_amax"] for a in layer)
    static = EngineArgs(
        model=str(llama_dir),
        dtype="float32",
        kv_cache_dtype="fp8_e4m3",
        kv_scale="static",
        kv_scales_path=str(out),
    )
    r = run_kv_eval(
        static,
        num_tokens=200,
        text=str(text_file),
        num_prompts=2,
        prompt_tokens=16,
        greedy_tokens=4,
    )
    assert r["kv_scale"] == f"static ({out})"
    # calibrated on the same text: only the greedy continuations (new text) may clip a few of the
    # ~30k values written (240 tokens x 2 layers x (K, V) x 2 heads x 16 dims)
    assert r["kv_saturated_values"] < 30
    assert r["top1_agreement"] >= 0.8


def test_cli_eval_kv_writes_json(llama_dir: Path, text_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    rc = main(
        [
            "eval",
            "kv",
            str(llama_dir),
            "--dtype",
            "float32",
            "--kv-cache-dtype",
            "fp8_e5m2",
            "--num-tokens",
            "150",
            "--text",
            str(text_file),
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    r = json.loads(out.read_text())
    assert REQUIRED_KEYS <= set(r) and r["kv_cache_dtype"] == "fp8_e5m2"


def test_gsm8k_parsing(tmp_path: Path) -> None:
    assert extract_answer("so the total is 1,250 apples.\n#### 1,250") == "1250"
    assert extract_answer("The answer is 42.") == "42"
    assert extract_answer("no number") is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "no marker"}\n')
    with pytest.raises(ValueError, match="####"):
        read_gsm8k(bad)


@pytest.mark.slow
@pytest.mark.real_model
def test_gsm8k_on_the_default_model(tmp_path: Path) -> None:
    data = tmp_path / "gsm8k.jsonl"
    rows = [
        ("What is 2 + 3?", 5),
        ("What is 9 + 10?", 19),
        ("What is 6 times 7?", 42),
        ("What is 100 divided by 4?", 25),
    ]
    data.write_text(
        "".join(json.dumps({"question": q, "answer": f"#### {a}"}) + "\n" for q, a in rows)
    )
    args = EngineArgs(kv_cache_memory_bytes=64 << 20)  # 4 questions: a small cache suffices
    r = run_gsm8k(args, data, ["auto", "fp8_e4m3"], max_tokens=48)
    auto, f8 = r["groups"]["auto"], r["groups"]["fp8_e4m3"]
    assert r["num_questions"] == 4
    assert auto["num_correct"] >= 2  # the 135M model gets most of these right
    assert f8["accuracy_delta"] == pytest.approx(f8["accuracy"] - auto["accuracy"])
    assert 0.0 <= f8["answer_agreement"] <= 1.0
