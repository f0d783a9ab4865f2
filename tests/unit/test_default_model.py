"""The default model's cache: sampling defaults in its generation_config.json, old caches too."""

from __future__ import annotations

import json
from pathlib import Path

from infer8.generation_config import sampling_defaults
from infer8.models.default_model import (
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_SAMPLING,
    HF_MODEL_FILES,
    pull_default_model,
)


def _old_cache(root: Path) -> Path:
    """Write a converted directory as older versions left it: token ids, no sampling keys."""
    model_dir = root / "models" / DEFAULT_MODEL_NAME
    model_dir.mkdir(parents=True)
    for name in HF_MODEL_FILES:
        (model_dir / name).write_text("{}")
    old = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    (model_dir / "generation_config.json").write_text(json.dumps(old))
    return model_dir


def test_pull_adds_sampling_defaults_to_an_old_cache(tmp_path: Path) -> None:
    """Check an already-converted cache gains the sampling defaults, keeps its ids, no re-fetch."""
    model_dir = _old_cache(tmp_path)
    assert pull_default_model(tmp_path, progress=False) == model_dir
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation == {
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "temperature": 0.2,
        "top_p": 0.9,
    }
    assert sorted(p.name for p in model_dir.iterdir()) == sorted(HF_MODEL_FILES)
    assert not (tmp_path / "downloads").exists()


def test_the_directory_alone_gives_the_default_models_sampling(tmp_path: Path) -> None:
    """Check `--model <the converted directory>` reads the same defaults as no --model."""
    model_dir = pull_default_model(_old_cache(tmp_path).parents[1], progress=False)
    assert (
        sampling_defaults(str(model_dir))
        == DEFAULT_MODEL_SAMPLING
        == {
            "temperature": 0.2,
            "top_p": 0.9,
        }
    )


def test_pull_keeps_a_users_own_sampling_values(tmp_path: Path) -> None:
    """Check values already in the file win over the defaults being added."""
    model_dir = _old_cache(tmp_path)
    (model_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.7}))
    pull_default_model(tmp_path, progress=False)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation == {"temperature": 0.7, "top_p": 0.9}
