"""Session-wide fixtures: tiny models are built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.utils import build_tiny_model


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2")
