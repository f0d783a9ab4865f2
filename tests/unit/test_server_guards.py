"""The HTTP guards a browser or a tenant meets: Host names on a loopback server (DNS rebinding),
request head limits, CORS that cannot echo every origin with credentials, /metrics behind keys."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from infer8.entrypoints.openai.cli_args import ServerConfig, make_serve_parser, serve_args_from
from infer8.entrypoints.openai.guards import (
    HeaderLimitMiddleware,
    HostCheckMiddleware,
    allowed_host_patterns,
)


async def _ok(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


def _client(bind_host: str, allowed_hosts: list[str] | None = None) -> TestClient:
    app = Starlette(routes=[Route("/v1/models", _ok)])
    patterns = allowed_host_patterns(bind_host, allowed_hosts)
    if patterns is not None:
        app.add_middleware(HostCheckMiddleware, allowed_hosts=patterns)
    return TestClient(app)


def _status(client: TestClient, host: str) -> int:
    return client.get("/v1/models", headers={"Host": host}).status_code


@pytest.mark.parametrize("bind_host", ["127.0.0.1", "::1", "localhost"])
def test_a_loopback_server_answers_only_loopback_host_names(bind_host: str) -> None:
    client = _client(bind_host)
    for host in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000", "LOCALHOST", "app.localhost"):
        assert _status(client, host) == 200, host
    for host in ("attacker.example:8000", "attacker.example", "127.0.0.1.nip.io", "10.0.0.5"):
        response = client.get("/v1/models", headers={"Host": host})
        assert response.status_code == 421, host
        assert response.json()["error"]["code"] == "misdirected_request"


def test_allowed_hosts_name_more_hosts_and_a_public_bind_checks_none_by_default() -> None:
    client = _client("127.0.0.1", ["api.example.com", "*.internal.example"])
    assert _status(client, "api.example.com") == 200
    assert _status(client, "node-1.internal.example:8000") == 200
    assert _status(client, "localhost:8000") == 200  # loopback names always
    assert _status(client, "internal.example") == 421
    assert _status(client, "attacker.example") == 421
    assert _status(_client("0.0.0.0"), "attacker.example") == 200  # as vLLM: no check
    assert _status(_client("127.0.0.1", ["*"]), "attacker.example") == 200
    assert _status(_client("0.0.0.0", ["api.example.com"]), "10.0.0.5") == 421


def test_oversized_request_heads_get_431() -> None:
    app = Starlette(routes=[Route("/v1/models", _ok)])
    app.add_middleware(HeaderLimitMiddleware, max_header_bytes=64 * 1024, max_num_headers=100)
    client = TestClient(app)
    assert client.get("/v1/models").status_code == 200
    many = {f"x-h{i}": "1" for i in range(100)}
    response = client.get("/v1/models", headers=many)
    assert response.status_code == 431
    assert response.json()["error"]["code"] == "request_header_fields_too_large"
    assert client.get("/v1/models", headers={"x-big": "a" * 100_000}).status_code == 431
    assert client.get("/v1/models", headers={"x-big": "a" * 60_000}).status_code == 200


def test_wildcard_origins_with_credentials_are_refused_at_start_up(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(ValueError, match="any web page"):
        ServerConfig(allowed_origins='["*"]', allow_credentials=True)
    ServerConfig(allowed_origins='["https://app.example"]', allow_credentials=True)
    ServerConfig(allowed_origins='["*"]')  # no credentials: vLLM's own default
    with pytest.raises(SystemExit) as exit_info:
        make_serve_parser().parse_args(
            ["/models/m", "--allowed-origins", '["*"]', "--allow-credentials"]
        )
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert "--allow-credentials" in lines[-1] and "Traceback" not in "".join(lines)


def test_metrics_need_a_key_when_keys_are_set_unless_opened() -> None:
    assert ServerConfig().metrics_require_api_key
    parser = make_serve_parser()
    _, server = serve_args_from(parser.parse_args(["/models/m", "--api-key", "k"]))
    assert server.metrics_require_api_key
    ns = parser.parse_args(["/models/m", "--api-key", "k", "--no-metrics-require-api-key"])
    assert not serve_args_from(ns)[1].metrics_require_api_key
    ns = parser.parse_args(["/models/m", "--allowed-hosts", "api.example.com"])
    assert serve_args_from(ns)[1].allowed_hosts == "api.example.com"  # a bare word: one name
    with pytest.raises(ValueError, match="allowed-hosts"):
        ServerConfig(allowed_hosts='{"a": 1}')
