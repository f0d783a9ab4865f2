"""Tiny helpers shared across the package (one copy each; no torch)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def cdiv(a: int, b: int) -> int:
    """Return ceil(a / b) for positive b."""
    return -(-a // b)


def cache_dir() -> Path:
    """Return infer8's cache root: $INFER8_CACHE, else $XDG_CACHE_HOME/infer8 or ~/.cache/infer8."""
    if os.environ.get("INFER8_CACHE"):
        return Path(os.environ["INFER8_CACHE"]).expanduser()
    xdg_cache = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg_cache).expanduser() / "infer8"


def json_object_flag(flag: str, text: str | dict[str, Any]) -> dict[str, Any]:
    """Return a flag's JSON object (a dict is taken as is); ValueError naming the flag for bad
    JSON or a non-object."""
    if isinstance(text, dict):
        return dict(text)
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON: {e}") from e
    if not isinstance(values, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return values


def check_known_keys(flag: str, values: dict[str, Any], known: Iterable[str]) -> None:
    """Raise ValueError naming the flag's keys outside `known`, and the known ones."""
    known = set(known)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(
            f"{flag}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
