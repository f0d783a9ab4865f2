"""Benchmark results out: latency summaries, markdown tables, JSON files and PNG plots."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def summarize(values_s: Sequence[float], name: str) -> dict[str, float | None]:
    """Return `<name>_mean_s`, `_p50_s`, `_p90_s`, `_p99_s` (None when there are no values)."""
    keys = ("mean", "p50", "p90", "p99")
    if not values_s:
        return {f"{name}_{k}_s": None for k in keys}
    arr = np.asarray(values_s, dtype=np.float64)
    stats = (arr.mean(), *np.percentile(arr, [50, 90, 99]))
    return {f"{name}_{k}_s": float(v) for k, v in zip(keys, stats)}


def fmt(value: Any, scale: float = 1.0, digits: int = 1) -> str:
    """Format a number for a table (None or NaN as '-')."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool) or isinstance(value, str):
        return str(value)
    if isinstance(value, int) and scale == 1.0:
        return str(value)
    return f"{value * scale:.{digits}f}"


def fmt_bytes(num_bytes: int) -> str:
    """Format a byte count as GiB / MiB / KiB."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= size:
            value = num_bytes / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{num_bytes} B"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Return a GitHub markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str | Path, result: dict[str, Any]) -> None:
    """Write a result dict as indented JSON."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")


def write_text(path: str | Path, text: str) -> None:
    """Write a markdown report."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text.rstrip() + "\n")


def _figure(width: float = 6.4, height: float = 4.0) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise RuntimeError(
            "plots need matplotlib: pip install 'infer8[bench]' (or drop --plot-dir)"
        ) from None
    # A bare Figure (no pyplot) renders with Agg and touches no global backend state.
    return Figure(figsize=(width, height), layout="tight")


def bar_plot(
    path: str | Path,
    labels: Sequence[str],
    values: Sequence[float | None],
    title: str,
    ylabel: str,
    reference: float | None = None,
    reference_label: str = "",
) -> Path:
    """Save a bar chart (one bar per label, value printed on top) as PNG; return its path."""
    fig = _figure()
    ax = fig.subplots()
    heights = [0.0 if v is None else float(v) for v in values]
    bars = ax.bar(range(len(labels)), heights, color="#4C72B0")
    ax.bar_label(bars, labels=[fmt(v) for v in values], padding=2, fontsize=8)
    ax.set_xticks(range(len(labels)), labels, rotation=15, ha="right", fontsize=8)
    if reference is not None:
        ax.axhline(reference, color="#C44E52", linestyle="--", label=reference_label)
        ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    return _save(fig, path)


def cdf_plot(path: str | Path, series: dict[str, Sequence[float]], title: str, xlabel: str) -> Path:
    """Save empirical CDFs of several samples (e.g. TTFT per group) as PNG; return its path."""
    fig = _figure()
    ax = fig.subplots()
    for label, values in series.items():
        if not values:
            continue
        xs = np.sort(np.asarray(values, dtype=np.float64))
        ys = np.arange(1, len(xs) + 1) / len(xs)
        ax.step(np.r_[xs[0], xs], np.r_[0.0, ys], where="post", label=label)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def line_plot(
    path: str | Path,
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    title: str,
    xlabel: str,
    ylabel: str,
) -> Path:
    """Save one step line per series ((x, y) pairs, y holding until the next x) as PNG."""
    fig = _figure()
    ax = fig.subplots()
    for label, (xs, ys) in series.items():
        ax.step(xs, ys, where="post", label=label, linewidth=1)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
