"""The raw body's lists are counted before parsing: a body of empty lists parsed for seconds."""

from __future__ import annotations

import json
import time

import pytest

from infer8.entrypoints.openai import request_limits
from infer8.entrypoints.openai.request_limits import check_raw_body, raw_limits


def test_a_body_of_a_million_empty_lists_is_refused_before_parsing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 1.57M empty lists, 4.7 MB: under the default body cap of an 8,192-token model
    body = b'{"prompt": [' + b",".join([b"[]"] * 1_570_000) + b"]}"
    assert len(body) < request_limits.default_max_body_bytes(8192)

    def no_parse(*args: object) -> None:
        raise AssertionError("parsed")

    monkeypatch.setattr(json, "loads", no_parse)
    start = time.perf_counter()
    with pytest.raises(ValueError, match="lists"):
        check_raw_body(body, raw_limits(8192))
    assert time.perf_counter() - start < 0.2  # a byte count: ~2 ms, where parsing took 2 s


def test_bodies_with_lists_that_requests_use_pass() -> None:
    limits = raw_limits(8192)
    token_prompts = {"prompt": [[1, 2, 3]] * 1024, "max_tokens": 1}
    check_raw_body(json.dumps(token_prompts).encode(), limits)
    # brackets inside text count too (an over-count only), up to a context's worth
    code = {"prompt": "a[i][j] = b[j][i]\n" * 4096}
    check_raw_body(json.dumps(code).encode(), limits)
    assert raw_limits(1 << 20).max_lists >= 1 << 20  # grows with the context
