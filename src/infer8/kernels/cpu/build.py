"""Building the native CPU kernels (csrc/*.c): once per source version, compiler, flags and CPU
feature set, with the system C compiler (gcc/cc, OpenMP), into the infer8 cache; library.py loads
the result. `-march=native` code for one CPU can be an illegal instruction on another, so a
cache directory shared between hosts keeps one build per feature set."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from infer8.utils import cache_dir

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = (
    _CSRC / "fp8_gather.c",
    _CSRC / "decode_attention.c",
    _CSRC / "hadamard.c",
    _CSRC / "elementwise.c",
    _CSRC / "band_attention.c",
    _CSRC / "two_value_attention.c",
    _CSRC / "sampling.c",
    _CSRC / "lora.c",
    _CSRC / "args.c",
)
# -fno-trapping-math: no FP exception is ever observed, so branch-free selects vectorize (the
# values are IEEE's either way; no -ffast-math, which would change them)
# included by the sources: in the hash
_HEADERS = tuple(_CSRC / h for h in ("simd.h", "hadamard.h", "tail_row.h", "decode_tiles.h",
                                      "decode_passes.h", "args.h"))  # fmt: skip
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-trapping-math")


def _cache_dir() -> Path:
    return cache_dir() / "native"


def cpu_features() -> str:
    """Return the CPU's feature flags (Linux: /proc/cpuinfo), sorted; the machine name elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):  # x86 / Arm
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return os.uname().machine


def compiler_id(cc: str) -> str:
    """Return the compiler's path and its version line."""
    try:
        result = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        version = result.stdout.splitlines()[0] if result.stdout else ""
    except (OSError, subprocess.TimeoutExpired):
        version = ""
    return f"{cc} {version}"


def build_tag(source: bytes, compiler: str, flags: tuple[str, ...], features: str) -> str:
    """Return the name of a build: what is compiled, by which compiler, how, for which CPU."""
    key = b"\0".join(
        [source, compiler.encode(), " ".join(flags).encode(), features.encode(),
         os.uname().machine.encode()]
    )  # fmt: skip
    return hashlib.sha256(key).hexdigest()[:16]


def build_library(out_dir: Path | None = None) -> Path:
    """Compile the kernels (once per source, compiler, flags and CPU) and return the .so path."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) found")
    source = b"".join(src.read_bytes() for src in (*_SOURCES, *_HEADERS))
    tag = build_tag(source, compiler_id(cc), _FLAGS, cpu_features())
    out_dir = out_dir or _cache_dir()
    lib = out_dir / f"fp8_gather-{tag}.so"
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        tmp_lib = Path(tmp) / lib.name
        cmd = [
            cc,
            *_FLAGS,
            "-shared",
            "-fPIC",
            "-o",
            str(tmp_lib),
            *map(str, _SOURCES),
        ]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(
                f"compiling the native kernels failed: {result.stderr.strip()[:500]}"
            )
        os.replace(tmp_lib, lib)  # atomic: concurrent builders end with one good file
    return lib
