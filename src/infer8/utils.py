"""Tiny helpers shared across the package (one copy each; no torch)."""

from __future__ import annotations

import os
from pathlib import Path


def cdiv(a: int, b: int) -> int:
    """Return ceil(a / b) for positive b."""
    return -(-a // b)


def cache_dir() -> Path:
    """Return infer8's cache root: $INFER8_CACHE, else $XDG_CACHE_HOME/infer8 or ~/.cache/infer8."""
    if os.environ.get("INFER8_CACHE"):
        return Path(os.environ["INFER8_CACHE"]).expanduser()
    xdg_cache = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg_cache).expanduser() / "infer8"
