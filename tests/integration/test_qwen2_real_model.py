"""A real Qwen2-family model (Qwen2.5-Coder-0.5B-Instruct, a Q4_K_M GGUF with Q4_K, Q5_0, Q6_K and
Q8_0 tensors, k/q/v biases, tied embeddings) pulled from the package registry, against
transformers' own GGUF loading of the same file."""

from __future__ import annotations

from typing import Any

import numpy as np
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


def _q4_k(raw: np.ndarray) -> np.ndarray:
    """ggml's Q4_K, written from its block layout: per 256 values d, dmin (f16), 12 bytes of
    6-bit scales and mins for 8 sub-blocks, 128 bytes of 4-bit values."""
    blocks = raw.reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 4:16].astype(np.int32)
    scale = np.empty((len(blocks), 8), np.int32)
    mins = np.empty((len(blocks), 8), np.int32)
    scale[:, :4], mins[:, :4] = q[:, 0:4] & 63, q[:, 4:8] & 63
    scale[:, 4:] = (q[:, 8:12] & 0xF) | ((q[:, 0:4] >> 6) << 4)
    mins[:, 4:] = (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)
    qs = blocks[:, 16:].reshape(-1, 4, 32).astype(np.int32)  # 4 chunks of 64 values
    low, high = qs & 0xF, qs >> 4  # sub-blocks 2c and 2c + 1
    values = np.stack([low, high], axis=2).reshape(-1, 8, 32)
    return (d * scale)[..., None] * values - (dmin * mins)[..., None]


def _q6_k(raw: np.ndarray) -> np.ndarray:
    """ggml's Q6_K: per 256 values 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8
    scales (one per 16 values) and d (f16)."""
    blocks = raw.reshape(-1, 210)
    ql = blocks[:, :128].reshape(-1, 2, 64).astype(np.int32)
    qh = blocks[:, 128:192].reshape(-1, 2, 32).astype(np.int32)
    scales = blocks[:, 192:208].copy().view(np.int8).astype(np.float32).reshape(-1, 2, 8)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    out = np.empty((len(blocks), 2, 128), np.float32)
    for i, (lo, shift) in enumerate([(0, 0), (32, 2), (0, 4), (32, 6)]):
        nibble = ql[:, :, lo : lo + 32] & 0xF if i < 2 else ql[:, :, lo : lo + 32] >> 4
        q = (nibble | (((qh >> shift) & 3) << 4)) - 32
        sc = np.repeat(scales[:, :, 2 * i : 2 * i + 2], 16, axis=2)
        out[:, :, 32 * i : 32 * i + 32] = d[:, :, None] * sc * q
    return out


@pytest.mark.parametrize(
    ("gguf_name", "hf_name", "dequantize"),
    [
        ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", _q6_k),
        ("blk.11.ffn_down.weight", "model.layers.11.mlp.down_proj.weight", _q4_k),
    ],
    ids=["Q6_K", "Q4_K"],
)
def test_k_quant_tensors_load_as_their_block_layout_says(
    gguf_name: str, hf_name: str, dequantize: Any
) -> None:
    from infer8.models.gguf_loader import load_gguf

    path = pull(QWEN25_CODER_05B.name, progress=False).parent / QWEN25_CODER_05B.gguf_name
    model = load_gguf(path)
    tensor = model.tensors[gguf_name]
    assert tensor.tensor_type.name == dequantize.__name__.removeprefix("_").upper()
    expected = dequantize(np.asarray(tensor.data).view(np.uint8).reshape(-1))
    got = next(w for name, w in model.iter_weights() if name == hf_name).numpy()
    np.testing.assert_allclose(got.reshape(-1), expected.reshape(-1), rtol=0, atol=1e-6)
