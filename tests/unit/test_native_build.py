"""The native kernels' build cache: one build per source, compiler, flags and CPU feature set."""

from __future__ import annotations

from pathlib import Path

import pytest

from infer8.kernels.cpu import build as native_build


def test_the_build_name_changes_with_the_cpu_compiler_flags_and_source() -> None:
    base = ("src", "gcc 12.2", ("-O3", "-march=native"), "avx avx2 avx512f fma")
    tag = native_build.build_tag(base[0].encode(), *base[1:])
    assert tag == native_build.build_tag(base[0].encode(), *base[1:])
    for i, other in enumerate(["src2", "gcc 13.1", ("-O2", "-march=native"), "avx avx2 fma"]):
        changed = list(base)
        changed[i] = other
        assert native_build.build_tag(changed[0].encode(), *changed[1:]) != tag, other


def test_the_cpu_features_are_read_sorted() -> None:
    features = native_build.cpu_features()
    assert features and features.split() == sorted(features.split())


def test_a_cache_shared_with_another_cpu_builds_its_own_library(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An AVX2 host must never load the AVX-512 host's build from a shared cache directory."""
    built: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: object) -> object:
        class Result:
            returncode = 0
            stdout = "gcc (Debian 12.2.0-14) 12.2.0\n"
            stderr = ""

        if "--version" not in cmd:
            built.append(cmd)
            Path(cmd[cmd.index("-o") + 1]).write_bytes(b"ELF")
        return Result()

    monkeypatch.setattr(native_build.subprocess, "run", fake_run)
    monkeypatch.setattr(native_build, "cpu_features", lambda: "avx avx2 avx512f")
    first = native_build.build_library(tmp_path)
    assert native_build.build_library(tmp_path) == first and len(built) == 1  # cached
    monkeypatch.setattr(native_build, "cpu_features", lambda: "avx avx2")
    second = native_build.build_library(tmp_path)
    assert second != first and len(built) == 2
