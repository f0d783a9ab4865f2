"""Sampling defaults from a model's generation_config.json (vLLM's --generation-config).

"auto" reads the model's own file (or the GGUF metadata's), "vllm" uses none (the API's
defaults: temperature 1.0 ...), a folder reads that folder's file. `--override-generation-config`
(JSON) is applied on top. A request's explicit values always win over these defaults.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


def sampling_defaults(
    model_path: str,
    mode: str = "auto",
    overrides_json: str | None = None,
    gguf_generation_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Return the SamplingParams fields the model's generation config sets (validated types)."""
    config: dict[str, Any] = {}
    if mode == "auto":
        path = Path(model_path)
        if path.is_dir():
            config = _read(path / "generation_config.json")
        elif gguf_generation_config is not None:
            config = dict(gguf_generation_config)
    elif mode != "vllm":
        folder = Path(mode)
        if not (folder / "generation_config.json").is_file():
            raise ValueError(
                f"--generation-config {mode!r}: expected 'auto', 'vllm' or a folder holding "
                "generation_config.json"
            )
        config = _read(folder / "generation_config.json")
    if overrides_json:
        try:
            overrides = json.loads(overrides_json)
        except json.JSONDecodeError as e:
            raise ValueError(f"--override-generation-config is not valid JSON: {e}") from None
        if not isinstance(overrides, dict):
            raise ValueError("--override-generation-config must be a JSON object")
        config.update(overrides)
    defaults: dict[str, Any] = {}
    for key, field in SAMPLING_KEYS.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"generation config {key} must be a number, got {value!r}")
        defaults[field] = int(value) if field == "top_k" else float(value)
    return defaults


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}
