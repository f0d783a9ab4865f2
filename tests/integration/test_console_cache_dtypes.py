"""The engine view against real engines of every cache dtype, in headless Chromium (tiny model).

An FP8 engine carries the exact tail and the rotation by default; the view's capacity figures
must be computed for it (and for every other format) without an error in the event stream.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, sync_playwright

from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.entrypoints.openai.cli_args import ServerConfig
from tests.utils import build_tiny_model, start_server, stop_server, wait_for_js

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("INFER8_CHROMIUM") or next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None
)
if CHROMIUM is None:
    pytest.skip("Chromium is not installed (scripts/setup.sh installs it)", allow_module_level=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("dtypes"), "llama")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield chromium
        chromium.close()


@pytest.mark.parametrize(
    "kv_cache_dtype, extra",
    [
        ("fp8_e4m3", {}),  # the default FP8 options: exact tail, sinks and rotation
        ("fp8_e4m3", {"kv_cache_exact_tail_tokens": 0, "kv_cache_hadamard": False}),
        ("fp8_e5m2", {}),
        ("bfloat16", {}),
        ("float32", {}),
    ],
)
def test_engine_view_shows_every_cache_dtype(
    model_dir: Path, browser: Browser, kv_cache_dtype: str, extra: dict[str, object]
) -> None:
    args = EngineArgs(
        model=str(model_dir), kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=8 << 20,
        max_num_seqs=8, **extra,
    )  # fmt: skip
    engine = LLMEngine(args)
    spec = engine.kv_spec
    running = start_server(engine, ServerConfig())
    try:
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(running.url + "/engine")
        wait_for_js(page, "Number(document.body.dataset.records || 0) >= 1", timeout=20_000)
        wait_for_js(page, "document.getElementById('kv-capacity').textContent.length > 0")
        capacity = page.inner_text("#kv-capacity")
        assert str(spec.dtype).removeprefix("torch.") in capacity
        assert f"{engine.num_blocks * spec.block_size:,} tokens" in capacity
        if spec.is_fp8:
            bf16_bytes = 2 * spec.num_kv_heads * spec.head_dim * 2 * spec.num_layers
            gain = bf16_bytes / spec.bytes_per_token  # same memory, tokens as FP8 / as bf16
            shown = float(page.inner_text("#kv-capacity .gain").lstrip("×"))
            assert shown == pytest.approx(gain, abs=0.01)
        # A request runs and the view receives its steps.
        records = int(page.evaluate("document.body.dataset.records"))
        reply = httpx.post(
            running.url + "/v1/completions",
            json={"model": engine.served_model_name, "prompt": "hi", "max_tokens": 4},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        wait_for_js(page, f"Number(document.body.dataset.records) > {records}", timeout=20_000)
        assert errors == []
        page.close()
    finally:
        stop_server(running)
