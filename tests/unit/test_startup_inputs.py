"""Start-up inputs that used to pass silently or die with a traceback (review finding 6): each is
one ValueError / RuntimeError line naming the file and the field, raised before anything is
allocated."""

from __future__ import annotations

import errno
import json
import struct
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from infer8.config import CacheConfig, EngineArgs
from infer8.host_memory import GiB, available_ram_bytes, check_host_tier
from infer8.models import gguf_loader
from infer8.models.loader import iter_safetensors, read_hf_config
from infer8.models.safetensors_check import (
    check_num_layers,
    check_safetensors_files,
    check_safetensors_header,
)
from infer8.worker.fit_check import check_fits_memory

# -- --kv-offloading-size ---------------------------------------------------------------------


@pytest.mark.parametrize("size", [float("inf"), float("nan"), 1e300, -1.0])
def test_kv_offloading_size_must_be_a_finite_byte_count(size: float) -> None:
    with pytest.raises(ValueError, match="kv_offloading_size") as info:
        CacheConfig(kv_offloading_size=size)
    assert "\n" not in str(info.value)


def test_a_host_tier_larger_than_ram_is_refused_with_both_numbers() -> None:
    with pytest.raises(ValueError) as info:
        check_host_tier(1000, model_ram_bytes=2 * GiB, available_bytes=int(23.5 * GiB))
    message = str(info.value)
    assert message.startswith("--kv-offloading-size 1000 GiB does not fit in RAM")
    assert "23.50 GiB available" in message and "the model needs 2.00 GiB" in message
    assert "leaving 21.50 GiB" in message
    check_host_tier(20, model_ram_bytes=2 * GiB, available_bytes=int(23.5 * GiB))  # fits


def test_available_ram_reads_meminfo_and_the_cgroup_limit(tmp_path: Path) -> None:
    meminfo = "MemTotal:       24641536 kB\nMemAvailable:   20000000 kB\n"
    no_cgroup = tmp_path / "none"
    assert available_ram_bytes(meminfo, no_cgroup) == 20000000 * 1024
    (tmp_path / "memory.max").write_text(f"{4 * GiB}\n")
    (tmp_path / "memory.current").write_text(f"{1 * GiB}\n")
    assert available_ram_bytes(meminfo, tmp_path) == 3 * GiB  # the container's limit is less
    (tmp_path / "memory.max").write_text("max\n")
    assert available_ram_bytes(meminfo, tmp_path) == 20000000 * 1024


def test_the_fit_check_refuses_a_host_tier_beyond_ram(tmp_path: Path) -> None:
    model = _config_dir(tmp_path)
    args = EngineArgs(model=str(model), device="cpu", kv_offloading_size=1 << 20)  # 1 PiB
    hf_config = read_hf_config(model)
    with pytest.raises(ValueError, match=r"--kv-offloading-size 1048576 GiB does not fit in RAM"):
        check_fits_memory(args.create_engine_config(str(model), hf_config), hf_config)


# -- safetensors headers --------------------------------------------------------------------


def _safetensors(
    path: Path, header: dict[str, Any], data: bytes, length: int | None = None
) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<q", len(raw) if length is None else length) + raw + data)
    return path


def _valid(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}, str(path))
    return path


def test_a_valid_file_passes(tmp_path: Path) -> None:
    assert set(check_safetensors_header(_valid(tmp_path))) == {"a", "b"}


@pytest.mark.parametrize("length", [-10, (1 << 63) - 1, 100_000_000, 10_000])
def test_header_lengths_that_do_not_fit_the_file(tmp_path: Path, length: int) -> None:
    path = _safetensors(tmp_path / "w.safetensors", {}, b"", length)
    with pytest.raises(ValueError, match=rf"{path}: header length {length} does not fit"):
        check_safetensors_header(path)


def test_empty_and_short_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"{empty}: the file is empty"):
        check_safetensors_header(empty)
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match=rf"{short}: 2 bytes, too short"):
        check_safetensors_header(short)


def test_a_truncated_file_names_the_tensor_past_the_end(tmp_path: Path) -> None:
    path = _valid(tmp_path)
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(ValueError, match=rf"{path}: tensor '\w': data_offsets .* run past"):
        check_safetensors_header(path)


@pytest.mark.parametrize(
    ("entry", "data", "match"),
    [
        ({"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}, b"..", "unknown dtype 'Q4'"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}, b"." * 8, "shape .* is 16 bytes"),
        ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, b"." * 4, "shape"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}, b"." * 4, "data_offsets"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}, b"." * 8, "leaves a gap"),
        ("F32", b"", "not a JSON object"),
    ],
)
def test_entries_that_lie(tmp_path: Path, entry: Any, data: bytes, match: str) -> None:
    path = _safetensors(tmp_path / "w.safetensors", {"model.norm.weight": entry}, data)
    with pytest.raises(ValueError, match=rf"{path}: tensor 'model.norm.weight': .*{match}") as e:
        check_safetensors_header(path)
    assert "\n" not in str(e.value)


def test_bytes_after_the_last_tensor(tmp_path: Path) -> None:
    entry = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
    path = _safetensors(tmp_path / "w.safetensors", {"a": entry}, b"." * 8)
    with pytest.raises(ValueError, match=rf"{path}: the tensors cover 4 bytes of a 8-byte"):
        check_safetensors_header(path)


def test_overlapping_tensors(tmp_path: Path) -> None:
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    path = _safetensors(tmp_path / "w.safetensors", header, b"." * 12)
    with pytest.raises(ValueError, match=rf"{path}: tensor 'b': .* overlaps"):
        check_safetensors_header(path)


def test_a_header_that_is_not_json(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    path.write_bytes(struct.pack("<q", 4) + b"\xff{[x")
    with pytest.raises(ValueError, match=rf"{path}: the header is not valid JSON"):
        check_safetensors_header(path)
    path.write_bytes(struct.pack("<q", 20_000) + b"[" * 20_000)  # nested past the recursion limit
    with pytest.raises(ValueError, match="not valid JSON"):
        check_safetensors_header(path)


def test_the_loader_refuses_a_corrupt_shard_before_reading_any(tmp_path: Path) -> None:
    _valid(tmp_path)
    bad = tmp_path / "model-2.safetensors"
    bad.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"{bad}: the file is empty"):
        next(iter_safetensors(tmp_path))


def test_layer_count_against_the_checkpoint(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    headers = {
        tmp_path / "m.safetensors": {f"model.layers.{i}.mlp.up_proj.weight": {} for i in (0, 1)}
    }
    check_num_layers(headers, 2, config)
    with pytest.raises(
        ValueError, match=rf"{config}: num_hidden_layers is 100,000, but .* 2 layers"
    ):
        check_num_layers(headers, 100_000, config)


def test_a_directory_without_weights(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no \\*.safetensors"):
        check_safetensors_files(tmp_path)


# -- config.json ----------------------------------------------------------------------------

_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def _config_dir(tmp_path: Path, **overrides: Any) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    cfg = {k: v for k, v in {**_CONFIG, **overrides}.items() if v is not None}
    (model / "config.json").write_text(json.dumps(cfg))
    return model


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
        ({"num_hidden_layers": -1}, "num_hidden_layers must be a positive integer, got -1"),
        ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),
        ({"hidden_size": "64"}, "hidden_size must be a positive integer, got '64'"),
        ({"intermediate_size": True}, "intermediate_size must be a positive integer, got True"),
        ({"vocab_size": None}, "vocab_size is missing"),
        ({"num_attention_heads": 5}, "num_attention_heads 5 does not divide hidden_size 64"),
        ({"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads"),
    ],
)
def test_config_fields_are_named(tmp_path: Path, overrides: dict[str, Any], match: str) -> None:
    model = _config_dir(tmp_path, **overrides)
    with pytest.raises(ValueError, match=rf"^{model / 'config.json'}: {match}"):
        read_hf_config(model)


def test_config_that_is_not_an_object(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json is not a JSON object"):
        read_hf_config(model)


def test_head_dim_given_need_not_divide_hidden_size(tmp_path: Path) -> None:
    cfg = read_hf_config(_config_dir(tmp_path, num_attention_heads=6, num_key_value_heads=2,
                                     head_dim=16))  # fmt: skip
    assert cfg["num_attention_heads"] == 6


def test_a_config_too_large_for_memory_is_refused_without_allocating(tmp_path: Path) -> None:
    # Llama-3-8B's layer, 100,000 times: ~40 TB of weights
    model = _config_dir(
        tmp_path, hidden_size=4096, intermediate_size=14336, num_hidden_layers=100_000,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
    )  # fmt: skip
    start = time.perf_counter()
    with pytest.raises(ValueError) as info:
        hf_config = read_hf_config(model)
        args = EngineArgs(model=str(model), device="cpu")
        check_fits_memory(args.create_engine_config(str(model), hf_config), hf_config)
    assert time.perf_counter() - start < 5
    message = str(info.value)
    assert message.startswith(f"{model / 'config.json'}: num_hidden_layers 100,000")
    assert "usable of RAM" in message and "\n" not in message


def test_a_kv_block_larger_than_the_budget_is_refused(tmp_path: Path) -> None:
    model = _config_dir(tmp_path, num_hidden_layers=64)
    args = EngineArgs(model=str(model), device="cpu", kv_cache_memory_bytes=1 << 16)
    hf_config = read_hf_config(model)
    with pytest.raises(ValueError, match=r"num_hidden_layers 64 x num_key_value_heads 2 .* KV"):
        check_fits_memory(args.create_engine_config(str(model), hf_config), hf_config)


# -- a full disk during conversion ------------------------------------------------------------


def _fake_gguf(monkeypatch: pytest.MonkeyPatch) -> None:
    model = SimpleNamespace(
        hf_config={"model_type": "llama"},
        tokenizer_json="{}",
        tokenizer_config={},
        generation_config={},
        state_dict={"w": torch.zeros(4)},
    )
    monkeypatch.setattr(gguf_loader, "load_gguf", lambda *a, **k: model)


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        ),
    ],
)
def test_a_full_disk_during_conversion_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    _fake_gguf(monkeypatch)

    def full(*args: Any, **kwargs: Any) -> None:
        raise error

    monkeypatch.setattr("safetensors.torch.save_file", full)
    out = tmp_path / "cache" / "SmolLM2-135M-Instruct"
    with pytest.raises(RuntimeError) as info:
        gguf_loader.convert_gguf_to_hf(tmp_path / "x.gguf", out, progress=False)
    message = str(info.value)
    assert message.startswith(f"no space left to write {out}: ") and "MiB free" in message
    assert "\n" not in message
    assert list((tmp_path / "cache").iterdir()) == []  # the temporary directory is gone


def test_other_write_errors_are_not_hidden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gguf(monkeypatch)

    def denied(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("safetensors.torch.save_file", denied)
    with pytest.raises(PermissionError):
        gguf_loader.convert_gguf_to_hf(tmp_path / "x.gguf", tmp_path / "out", progress=False)
