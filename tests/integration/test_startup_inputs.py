"""`infer8 serve` on bad start-up inputs (review finding 6): exit 2 with one line on stderr that
names the file and the field, before any model is loaded; no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.utils import free_port


def _serve(model: Path, *flags: str) -> tuple[int, str, float]:
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "infer8.cli", "serve", str(model), "--device", "cpu",
         "--port", str(free_port()), *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return run.returncode, run.stderr, time.monotonic() - start


def _one_line(stderr: str) -> str:
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("infer8: error: ")
    return lines[0]


@pytest.fixture
def model_dir(llama_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(llama_dir, tmp_path / "model"))


def test_a_truncated_safetensors_file(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    code, stderr, _ = _serve(model_dir)
    line = _one_line(stderr)
    assert code == 2 and f"{weights}: tensor " in line and "run past the data section" in line


def test_a_safetensors_header_length_of_minus_ten(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    weights.write_bytes((-10).to_bytes(8, "little", signed=True) + weights.read_bytes()[8:])
    code, stderr, _ = _serve(model_dir)
    assert code == 2 and f"{weights}: header length -10 does not fit" in _one_line(stderr)


def _set_config(model_dir: Path, **values: int) -> Path:
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))
    return path


def test_zero_attention_heads(model_dir: Path) -> None:
    config = _set_config(model_dir, num_attention_heads=0)
    code, stderr, _ = _serve(model_dir)
    line = _one_line(stderr)
    assert code == 2 and f"{config}: num_attention_heads must be a positive integer" in line


def test_a_hundred_thousand_layers_over_a_two_layer_checkpoint(model_dir: Path) -> None:
    config = _set_config(model_dir, num_hidden_layers=100_000)
    code, stderr, elapsed_s = _serve(model_dir)
    line = _one_line(stderr)
    assert code == 2 and f"{config}: num_hidden_layers is 100,000" in line and "2 layers" in line
    assert elapsed_s < 60  # was 147 s and 2.8 GB of modules before the weights were compared


@pytest.mark.parametrize("size", ["inf", "1e300"])
def test_kv_offloading_size_that_is_no_byte_count(model_dir: Path, size: str) -> None:
    code, stderr, _ = _serve(model_dir, "--kv-offloading-size", size)
    assert code == 2 and "kv_offloading_size" in _one_line(stderr)


def test_kv_offloading_size_beyond_ram(model_dir: Path) -> None:
    code, stderr, _ = _serve(model_dir, "--kv-offloading-size", "1000000")  # ~1 PiB
    line = _one_line(stderr)
    assert code == 2 and "--kv-offloading-size 1000000 GiB does not fit in RAM" in line
    assert "GiB available" in line and "the model needs" in line
