"""The web console in headless Chromium against `infer8 serve` on the real default model."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, BrowserContext, Page, Request, sync_playwright

from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.entrypoints.openai.cli_args import ServerConfig
from tests.utils import RunningServer, start_server, stop_server, wait_for_js

pytestmark = [pytest.mark.browser, pytest.mark.real_model]

API_KEY = "console-key"
CHROMIUM = os.environ.get("INFER8_CHROMIUM") or next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None
)
if CHROMIUM is None:
    pytest.skip("Chromium is not installed (scripts/setup.sh installs it)", allow_module_level=True)
ARTIFACTS = Path(os.environ.get("INFER8_TEST_ARTIFACTS", "test-artifacts")) / "console"
# The one 401 a wrong key is answered with; nothing else may reach the console.
_WRONG_KEY_ERROR = "status of 401"


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    args = EngineArgs(model=None, kv_cache_memory_bytes=64 << 20, max_num_seqs=8)
    running = start_server(LLMEngine(args), ServerConfig(api_key=API_KEY))
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield chromium
        chromium.close()


@pytest.fixture()
def context(browser: Browser) -> Iterator[BrowserContext]:
    context = browser.new_context(viewport={"width": 1440, "height": 1000})
    yield context
    context.close()


def _watch_errors(page: Page) -> list[str]:
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
    return errors


def _keyed_page(
    context: BrowserContext, server: RunningServer, path: str
) -> tuple[Page, list[str]]:
    """Open a page with the key already entered in this tab; return it and its console errors."""
    context.add_init_script(f"sessionStorage.setItem('infer8-api-key', {json.dumps(API_KEY)})")
    page = context.new_page()
    errors = _watch_errors(page)
    page.goto(server.url + path)
    page.wait_for_selector("body:not(.locked)", timeout=10_000)
    return page, errors


def _wait_for_answers(page: Page, num: int, timeout_ms: int) -> None:
    wait_for_js(
        page,
        f"document.querySelectorAll('.message.assistant[data-finish-reason]').length === {num}",
        timeout=timeout_ms,
    )


def _num_running(server: RunningServer) -> float:
    return server.metric("vllm:num_requests_running")


def test_the_api_key_prompt_gates_both_pages_and_the_event_stream(
    server: RunningServer, context: BrowserContext
) -> None:
    assert httpx.get(server.url + "/").status_code == 200  # the page itself is public
    assert httpx.get(server.url + "/console/api/events").status_code == 401
    assert httpx.get(server.url + "/console/api/defaults").status_code == 401
    assert httpx.get(server.url + "/v1/models").status_code == 401
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("GET", server.url + "/console/api/events", headers=auth) as response:
        assert response.status_code == 200
        first = next(response.iter_lines())
        assert first == "event: info"
    for path, marker in (("/", "#composer"), ("/engine", "#kv-map")):
        page = context.new_page()
        errors = _watch_errors(page)
        page.goto(server.url + path)
        page.wait_for_selector("#key-dialog.open")
        assert page.evaluate("document.body.classList.contains('locked')")
        assert not page.is_visible(marker)  # nothing shows behind the prompt
        page.fill("#api-key-input", "wrong-key")
        page.click("#key-submit")
        wait_for_js(page, "document.getElementById('key-error').textContent.includes('refused')")
        assert page.evaluate("document.body.classList.contains('locked')")
        page.fill("#api-key-input", API_KEY)
        page.click("#key-submit")
        page.wait_for_selector("body:not(.locked)")
        assert page.is_visible(marker)
        assert page.inner_text("#model-name") == "SmolLM2-135M-Instruct"
        page.wait_for_timeout(300)
        assert [e for e in errors if _WRONG_KEY_ERROR not in e] == []
        assert len(errors) == 1  # the wrong key's 401, and nothing else
        page.close()


def _chat_bodies(page: Page) -> list[dict[str, Any]]:
    """Collect the JSON bodies the page posts to /v1/chat/completions."""
    bodies: list[dict[str, Any]] = []

    def on_request(request: Request) -> None:
        if request.url.endswith("/v1/chat/completions"):
            bodies.append(request.post_data_json)

    page.on("request", on_request)
    return bodies


def test_chat_streams_an_answer_and_stop_aborts_the_request(
    server: RunningServer, context: BrowserContext
) -> None:
    page, errors = _keyed_page(context, server, "/")
    bodies = _chat_bodies(page)
    # The first question a new user types, with the page as it loads: the server's defaults.
    page.fill("#prompt", "What is the capital of France? Answer in one sentence.")
    page.press("#prompt", "Enter")
    _wait_for_answers(page, 1, timeout_ms=30_000)
    answer = page.locator(".message.assistant").last
    assert answer.get_attribute("data-finish-reason") == "stop"
    assert "Paris" in answer.locator(".content").inner_text()
    assert "TTFT" in answer.locator(".meta").inner_text()
    assert not {"temperature", "top_p"} & set(bodies[0])  # the server's defaults applied

    page.fill("#max-tokens", "400")
    page.fill("#prompt", "Write a long story about a lighthouse keeper and the sea.")
    page.press("#prompt", "Enter")
    # The answer streams: text shows while the request is still running.
    wait_for_js(
        page,
        "(() => { const c = document.querySelectorAll('.message.assistant .content');"
        " const last = c[c.length - 1];"
        " return last.classList.contains('streaming') && last.textContent.length > 20; })()",
        timeout=30_000,
    )
    assert _num_running(server) == 1
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chat.png"))
    page.click("#stop")
    _wait_for_answers(page, 2, timeout_ms=5_000)
    stopped = page.locator(".message.assistant").last
    assert stopped.get_attribute("data-finish-reason") == "stopped"
    deadline = time.monotonic() + 10
    while _num_running(server) != 0:
        assert time.monotonic() < deadline, "the stopped request kept running"
        time.sleep(0.1)
    assert server.metric("vllm:request_success_total", finished_reason="abort") >= 1
    assert errors == []


def test_sampling_fields_show_the_servers_defaults_and_send_only_typed_values(
    server: RunningServer, context: BrowserContext
) -> None:
    defaults = httpx.get(
        server.url + "/console/api/defaults", headers={"Authorization": f"Bearer {API_KEY}"}
    ).json()
    assert defaults["model"] == "SmolLM2-135M-Instruct"
    assert defaults["sampling"]["temperature"] == 0.2 and defaults["sampling"]["top_p"] == 0.9
    page, errors = _keyed_page(context, server, "/")
    bodies = _chat_bodies(page)
    wait_for_js(page, "document.body.dataset.defaults === 'loaded'")
    assert page.input_value("#temperature") == "" and page.input_value("#top-p") == ""
    assert page.get_attribute("#temperature", "placeholder") == "0.2"
    assert page.get_attribute("#top-p", "placeholder") == "0.9"
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "4")
    page.fill("#prompt", "Say hello.")
    page.press("#prompt", "Enter")
    _wait_for_answers(page, 1, timeout_ms=30_000)
    assert bodies[0]["temperature"] == 0 and "top_p" not in bodies[0]  # sent as typed
    page.fill("#top-p", "0.5")
    page.click("#reset-sampling")
    assert page.input_value("#temperature") == "" and page.input_value("#top-p") == ""
    page.fill("#prompt", "Say hello again.")
    page.press("#prompt", "Enter")
    _wait_for_answers(page, 2, timeout_ms=30_000)
    assert not {"temperature", "top_p"} & set(bodies[1])
    assert errors == []


def test_markdown_from_the_model_cannot_inject_html(
    server: RunningServer, context: BrowserContext
) -> None:
    page, errors = _keyed_page(context, server, "/")
    hostile = (
        '<img src=x onerror="window.pwned=1"> **bold** `<b>code</b>`\n'
        "```html\n<script>window.pwned=2</script>\n```\n- item <i>x</i>"
    )
    result = page.evaluate(
        """(text) => {
            const div = document.createElement('div');
            document.body.appendChild(div);
            markdown.render(div, text);
            return {
                tags: [...div.querySelectorAll('*')].map((e) => e.tagName.toLowerCase()),
                text: div.textContent,
                pwned: window.pwned === undefined ? null : window.pwned,
            };
        }""",
        hostile,
    )
    assert result["pwned"] is None
    assert not {"img", "script", "b", "i"} & set(result["tags"])
    assert {"strong", "code", "pre", "ul", "li"} <= set(result["tags"])
    assert '<img src=x onerror="window.pwned=1">' in result["text"]
    assert "<script>window.pwned=2</script>" in result["text"]
    assert errors == []


def test_engine_view_shows_the_batch_filling_and_the_kv_map_changing_in_a_burst(
    server: RunningServer, context: BrowserContext
) -> None:
    page, errors = _keyed_page(context, server, "/engine")
    wait_for_js(page, "Number(document.body.dataset.records || 0) >= 1")
    assert page.inner_text("#stat-running") == "0"
    page.fill("#burst-count", "12")
    page.fill("#burst-max-tokens", "16")
    page.click("#burst")
    running_seen: set[int] = set()
    signatures: set[str] = set()
    kv_used_seen: set[int] = set()
    deadline = time.monotonic() + 40
    while page.inner_text("#burst-progress") != "12/12 done":
        assert time.monotonic() < deadline, "the burst did not finish"
        running_seen.add(int(page.inner_text("#stat-running")))
        signatures.add(page.get_attribute("#kv-map", "data-signature") or "")
        kv_used_seen.add(int(page.get_attribute("#kv-map", "data-kv-used") or 0))
        if max(running_seen) >= 6 and not (ARTIFACTS / "engine.png").exists():
            page.screenshot(path=str(ARTIFACTS / "engine.png"))
        time.sleep(0.1)
    assert max(running_seen) >= 6  # the batch filled up (max_num_seqs 8, 12 requests)
    assert len(signatures) >= 3 and max(kv_used_seen) > 0  # blocks filled and freed live
    wait_for_js(page, "document.getElementById('stat-running').textContent === '0'")
    assert page.inner_text("#stat-waiting") == "0"
    assert page.locator("#req-rows tr").count() == 0  # every block was given back
    # the finished requests' latency percentiles arrive with the next metrics event (1 s)
    wait_for_js(page, "document.getElementById('ttft-0').textContent !== '–'", timeout=5_000)
    assert errors == []
