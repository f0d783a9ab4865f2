"""A schema fuzz of the server (schemathesis against /openapi.json): no 5xx, answers as documented."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.entrypoints.openai.cli_args import ServerConfig
from tests.utils import RunningServer, build_tiny_model, start_server, stop_server

API_KEY = "fuzz-key"


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    model_dir: Path = build_tiny_model(tmp_path_factory.mktemp("fuzz"), "llama")
    args = EngineArgs(
        model=str(model_dir),
        dtype="float32",
        kv_cache_memory_bytes=4 << 20,
        served_model_name="tiny",
        max_num_seqs=16,
    )
    config = ServerConfig(port=0, api_key=API_KEY, max_waiting_requests=64)
    running = start_server(LLMEngine(args), config)
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def api_schema(fuzz_server: RunningServer) -> Any:
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_no_server_errors_and_documented_answers(case: Any) -> None:
    case.headers = {**(case.headers or {}), "Authorization": f"Bearer {API_KEY}"}
    response = case.call(timeout=20)
    assert response.status_code < 500 or response.status_code == 503, response.text
    case.validate_response(
        response,
        checks=[status_code_conformance, content_type_conformance, response_schema_conformance],
    )


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 4}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        ),
    ],
)
def test_streams_answer_as_documented(api_schema: Any, path: str, body: dict[str, Any]) -> None:
    """Every event of a stream matches the documented event schema (the fuzz may not stream)."""
    case = api_schema[path]["POST"].Case(
        body={"model": "tiny", "stream": True, **body},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    response = case.call(timeout=20)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"][0].startswith("text/event-stream")
    assert response.text.rstrip().endswith("data: [DONE]")
    case.validate_response(
        response,
        checks=[status_code_conformance, content_type_conformance, response_schema_conformance],
    )
