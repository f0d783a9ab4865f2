"""The engine view's figures at a cache of >10,000 blocks, in headless Chromium (tiny random model)."""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Page, sync_playwright

from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.entrypoints.console.snapshot import MAX_MAP_CELLS
from infer8.entrypoints.openai.cli_args import ServerConfig
from tests.utils import RunningServer, build_tiny_model, start_server, stop_server, wait_for_js

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("INFER8_CHROMIUM") or next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None
)
if CHROMIUM is None:
    pytest.skip("Chromium is not installed (scripts/setup.sh installs it)", allow_module_level=True)
ARTIFACTS = Path(os.environ.get("INFER8_TEST_ARTIFACTS", "test-artifacts")) / "console"
# The browser's clock runs this far ahead of the server's (another machine, virtual time).
BROWSER_CLOCK_AHEAD_MS = 30_000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    model_dir = build_tiny_model(tmp_path_factory.mktemp("engine-view"), "llama")
    args = EngineArgs(model=str(model_dir), kv_cache_memory_bytes=96 << 20, max_num_seqs=16)
    engine = LLMEngine(args)
    assert engine.num_blocks > 10_000
    running = start_server(engine, ServerConfig())
    yield running
    stop_server(running)


def _tiles(page: Page) -> dict[str, str]:
    """Return the figure tiles' texts, read at once (a record may land between two reads)."""
    return page.evaluate(
        """() => Object.fromEntries(["running", "decode", "prefill", "step", "kv", "kv-blocks"]
            .map((name) => [name, document.getElementById("stat-" + name).textContent]))"""
    )


def test_a_large_cache_under_load_shows_used_blocks_rates_and_an_aggregated_map(
    server: RunningServer,
) -> None:
    num_blocks = server.engine.num_blocks
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        page = browser.new_page(viewport={"width": 1440, "height": 1000})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.add_init_script(
            f"const serverNow = Date.now; Date.now = () => serverNow() + {BROWSER_CLOCK_AHEAD_MS};"
        )
        page.goto(server.url + "/engine")
        wait_for_js(page, "Number(document.body.dataset.records || 0) >= 1")
        page.fill("#burst-count", "128")
        page.fill("#burst-max-tokens", "300")
        page.fill("#burst-prompt-words", "8")  # the tiny model's max_model_len is 512
        page.click("#burst")
        busy: list[dict[str, str]] = []
        deadline = time.monotonic() + 60
        while page.inner_text("#burst-progress") != "128/128 done":
            assert time.monotonic() < deadline, "the burst did not finish"
            tiles = _tiles(page)
            if int(tiles["running"]) >= 8:
                busy.append(tiles)
                if len(busy) == 3:
                    ARTIFACTS.mkdir(parents=True, exist_ok=True)
                    page.screenshot(path=str(ARTIFACTS / "engine-large-cache.png"))
            time.sleep(0.2)
        assert "failed" not in page.inner_text("#burst-progress")
        assert len(busy) >= 3, "the batch never filled"
        for tiles in busy[1:]:  # the first may predate the window's first steps
            used = int(tiles["kv-blocks"].split(" / ")[0].replace(",", ""))
            assert used > 0 and f"/ {num_blocks:,} blocks" in tiles["kv-blocks"]
            assert tiles["kv"] not in ("0%", "<0.01%") and tiles["kv"].endswith("%")
            assert float(tiles["kv"].rstrip("%")) == pytest.approx(100 * used / num_blocks, 0.05)
            assert float(tiles["decode"].replace(",", "")) > 0
            assert tiles["step"] != "–" and float(tiles["step"]) > 0
        cell_blocks = math.ceil(num_blocks / MAX_MAP_CELLS)
        assert page.get_attribute("#kv-map", "data-cell-blocks") == str(cell_blocks)
        assert page.inner_text("#kv-cell-note").startswith(f"one cell = {cell_blocks} blocks")
        # Idle again: the rates read 0 at once, not the last busy figures.
        wait_for_js(page, "document.getElementById('stat-running').textContent === '0'")
        assert page.inner_text("#stat-decode") == "0" and page.inner_text("#stat-step") == "–"
        assert errors == []
        browser.close()
