"""The default real model (SmolLM2-135M-Instruct) through the engine: GGUF and converted dir."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infer8 import LLM, SamplingParams
from infer8.models.default_model import default_gguf_path, pull_default_model

pytestmark = pytest.mark.real_model

QUESTION = "What is the capital of France? Answer in one sentence."


def _step_logits(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """Return every step's logits and the greedy tokens."""
    seen: list[torch.Tensor] = []
    model = llm.engine.worker.model
    orig = model.compute_logits

    def wrapped(hidden: torch.Tensor) -> torch.Tensor:
        out = orig(hidden)
        seen.append(out.clone())
        return out

    model.compute_logits = wrapped  # type: ignore[method-assign]
    try:
        out = llm.generate(
            [prompt],
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )[0]
    finally:
        model.compute_logits = orig  # type: ignore[method-assign]
    return torch.cat(seen), out.outputs[0].token_ids


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return pull_default_model()


@pytest.fixture(scope="module")
def gguf_path(model_dir: Path) -> Path:
    return default_gguf_path()


@pytest.mark.slow
def test_gguf_matches_transformers_gguf_loading_in_float32(gguf_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(str(gguf_path), dtype="float32", kv_cache_memory_bytes=32 << 20)
    tok = llm.get_tokenizer()
    ref = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    for text in (QUESTION, "Once upon a time, in a small village by the sea,"):
        prompt = tok.encode_chat([{"role": "user", "content": text}])
        ours, generated = _step_logits(llm, prompt, 4)
        with torch.no_grad():
            full = ref(torch.tensor([prompt + generated[:-1]])).logits[0]
        err = (ours - full[len(prompt) - 1 :]).abs().max().item()
        assert err < 1e-3, f"{text!r}: max abs logits error {err}"


@pytest.mark.slow
def test_gguf_file_and_converted_dir_give_the_same_logits(gguf_path: Path, model_dir: Path) -> None:
    # The converted dir stores bf16 weights, so compare both at bf16: identical weights, identical logits.
    a = LLM(str(gguf_path), dtype="bfloat16", kv_cache_memory_bytes=32 << 20)
    b = LLM(str(model_dir), dtype="bfloat16", kv_cache_memory_bytes=32 << 20)
    prompt = a.get_tokenizer().encode_chat([{"role": "user", "content": QUESTION}])
    assert prompt == b.get_tokenizer().encode_chat([{"role": "user", "content": QUESTION}])
    la, ta = _step_logits(a, prompt, 6)
    lb, tb = _step_logits(b, prompt, 6)
    assert ta == tb
    assert torch.equal(la, lb)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_chat_answers_paris(model_dir: Path, dtype: str) -> None:
    llm = LLM(str(model_dir), dtype=dtype, kv_cache_memory_bytes=32 << 20)
    out = llm.chat(
        [{"role": "user", "content": QUESTION}], SamplingParams(max_tokens=24, temperature=0.0)
    )
    text = out[0].outputs[0].text
    assert "Paris" in text, text
    assert out[0].outputs[0].finish_reason == "stop"  # the model ends its turn with <|im_end|>


def test_default_model_is_used_when_none_given(model_dir: Path) -> None:
    llm = LLM(kv_cache_memory_bytes=32 << 20)
    assert llm.engine.model_config.model == str(model_dir)
    assert llm.engine.worker.model.config.num_hidden_layers == 30


def test_the_converted_directory_samples_as_the_default_model(model_dir: Path) -> None:
    """Check `--model <the default model's directory>` gets the same sampling defaults as none."""
    by_path = LLM(model=str(model_dir), kv_cache_memory_bytes=32 << 20).engine
    assert by_path.default_sampling == {"temperature": 0.2, "top_p": 0.9}
    assert by_path.served_model_name == str(model_dir)  # the --model string, as vLLM serves it


def test_corrupt_gguf_and_missing_config_are_clear_errors(tmp_path: Path, gguf_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    with gguf_path.open("rb") as f:
        truncated.write_bytes(f.read(1 << 20))
    with pytest.raises(ValueError, match="truncated.gguf"):
        LLM(str(truncated))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ValueError, match="garbage.gguf"):
        LLM(str(garbage))
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path))
