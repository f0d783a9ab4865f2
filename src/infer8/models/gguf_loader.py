"""Load llama.cpp GGUF checkpoints (Llama, Qwen2) as Hugging Face-style config, weights and tokenizer.

GGUF stores what a Hugging Face checkpoint splits over several files: the config as `<arch>.*`
metadata, the tokenizer as `tokenizer.ggml.*` metadata, and the weights under llama.cpp's names,
possibly quantized, with the q/k projection rows of Llama reordered for llama.cpp's rotary
kernel. `load_gguf` undoes all of that, so its output equals what transformers' own GGUF loader
produces; `convert_gguf_to_hf` writes it out as a regular Hugging Face model directory. The
header's config is gguf_metadata.py's, the tokenizer gguf_tokenizer.py's.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, ReaderTensor
from gguf.quants import dequantize
from safetensors import SafetensorError
from tokenizers import Tokenizer as HFTokenizer

from infer8.models.gguf_metadata import (
    build_hf_config,
    expected_shapes,
    open_reader,
    read_metadata,
)
from infer8.models.gguf_tokenizer import (
    build_generation_config,
    build_tokenizer_config,
    build_tokenizer_json,
    eos_token_ids,
)
from infer8.progress import progress_bar

if TYPE_CHECKING:
    from infer8.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

SUPPORTED_TENSOR_TYPES = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)

_GLOBAL_TENSOR_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_LAYER_TENSOR_TO_HF = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class GGUFModel:
    """Owns one GGUF checkpoint read as Hugging Face form: config, tokenizer, lazy weights.

    The weights stay in the memory-mapped file until `iter_weights` dequantizes them one
    tensor at a time (loading never holds a second full copy); `state_dict` materializes all.
    """

    hf_config: dict[str, Any]
    tokenizer_json: str
    tokenizer_config: dict[str, Any]
    generation_config: dict[str, Any]
    path: Path
    tensors: dict[str, ReaderTensor]
    dtype: torch.dtype = torch.float32

    def iter_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (Hugging Face name, tensor in `dtype`), dequantizing one tensor at a time."""
        return _iter_weights(self.tensors, self.hf_config, self.path, dtype or self.dtype)

    @functools.cached_property
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Return every weight, dequantized to the dtype the file was loaded with."""
        return dict(self.iter_weights())


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = False
) -> GGUFModel:
    """Read a Llama or Qwen2 GGUF file; its weights dequantize to `dtype` when iterated."""
    path = Path(path)
    reader = open_reader(path)
    metadata = read_metadata(reader, path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    hf_config = build_hf_config(metadata, tensors, path, dtype)
    _check_tensor_names(tensors, hf_config, path)
    model = GGUFModel(
        hf_config=hf_config,
        tokenizer_json=build_tokenizer_json(metadata, path),
        tokenizer_config=build_tokenizer_config(metadata, hf_config),
        generation_config=build_generation_config(metadata),
        path=path,
        tensors=tensors,
        dtype=dtype,
    )
    if progress:  # the converter wants the whole state dict now, with a progress bar
        names = progress_bar(total=len(tensors), desc=f"Loading {path.name}", unit="tensor")
        state_dict = {}
        for name, tensor in model.iter_weights():
            state_dict[name] = tensor
            names.update()
        names.close()
        model.__dict__["state_dict"] = state_dict
    return model


def gguf_hf_config(path: str | Path) -> dict[str, Any]:
    """Return a GGUF file's config.json dict from its header, without reading the weights."""
    path = Path(path)
    reader = open_reader(path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    return build_hf_config(read_metadata(reader, path), tensors, path, torch.float32)


def tokenizer_from_gguf(model: GGUFModel) -> Tokenizer:
    """Build infer8's Tokenizer from an already loaded GGUF checkpoint (no second file read)."""
    from infer8.tokenizer import Tokenizer

    eos = model.generation_config.get("eos_token_id")
    eos_ids = [] if eos is None else (list(eos) if isinstance(eos, list) else [eos])
    return Tokenizer(
        HFTokenizer.from_str(model.tokenizer_json),
        model.tokenizer_config,
        eos_ids,
        model.tokenizer_config.get("chat_template"),
    )


def load_gguf_tokenizer(path: str | Path) -> Tokenizer:
    """Build infer8's Tokenizer from a GGUF file's metadata, without loading its weights."""
    from infer8.tokenizer import Tokenizer

    path = Path(path)
    reader = open_reader(path)
    metadata = read_metadata(reader, path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    hf_config = build_hf_config(metadata, tensors, path, torch.float32)
    tokenizer_config = build_tokenizer_config(metadata, hf_config)
    return Tokenizer(
        HFTokenizer.from_str(build_tokenizer_json(metadata, path)),
        tokenizer_config,
        eos_token_ids(metadata),
        tokenizer_config.get("chat_template"),
    )


def convert_gguf_to_hf(
    gguf_path: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    progress: bool = True,
    generation_defaults: dict[str, Any] | None = None,
) -> Path:
    """Write a GGUF checkpoint as a Hugging Face model directory, atomically, and return it.

    `generation_defaults` (e.g. a model card's temperature) join the generation_config.json.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    model = load_gguf(gguf_path, dtype=dtype, progress=progress)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Not mkdtemp: its 0700 mode would carry over to the final directory of a shared cache.
    tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex}"
    tmp_dir.mkdir()
    try:
        state_dict = model.state_dict  # dequantized: what model.safetensors will hold
        need_bytes = sum(t.numel() * t.element_size() for t in state_dict.values())
        with disk_full_as_error(out_dir, need_bytes):
            _write_json(tmp_dir / "config.json", model.hf_config)
            (tmp_dir / "tokenizer.json").write_text(model.tokenizer_json, encoding="utf-8")
            weights_path = tmp_dir / "model.safetensors"
            try:
                save_file(state_dict, str(weights_path), metadata={"format": "pt"})
            except SafetensorError as e:  # the Rust writer's I/O errors, ENOSPC among them
                raise _as_os_error(e, weights_path) from None
            # safetensors creates its file 0600; give it the umask-derived mode of its siblings.
            shutil.copymode(tmp_dir / "tokenizer.json", weights_path)
            _write_json(tmp_dir / "tokenizer_config.json", model.tokenizer_config)
            generation_config = {**model.generation_config, **(generation_defaults or {})}
            _write_json(tmp_dir / "generation_config.json", generation_config)
        _replace_dir(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def hf_tensor_name(gguf_name: str) -> str | None:
    """Return the Hugging Face name of a llama.cpp tensor name, or None if it has none."""
    if gguf_name in _GLOBAL_TENSOR_TO_HF:
        return _GLOBAL_TENSOR_TO_HF[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    _, layer, leaf, suffix = parts
    if leaf not in _LAYER_TENSOR_TO_HF or suffix not in ("weight", "bias"):
        return None
    return f"model.layers.{layer}.{_LAYER_TENSOR_TO_HF[leaf]}.{suffix}"


def _check_tensor_names(
    tensors: dict[str, ReaderTensor], hf_config: dict[str, Any], path: Path
) -> None:
    """Refuse a file whose tensors are not exactly those the config's model needs."""
    expected = expected_shapes(hf_config)
    gguf_to_hf = {name: hf_tensor_name(name) for name in tensors}
    unknown = sorted(name for name, hf_name in gguf_to_hf.items() if hf_name not in expected)
    if unknown:
        raise ValueError(
            f"{path} has tensors a {hf_config['model_type']} model with this config does not "
            f"use: {_preview(unknown)}"
        )
    missing = sorted(set(expected) - set(gguf_to_hf.values()))
    if missing:
        raise ValueError(f"{path} lacks the tensors for {_preview(missing)}")
    for tensor in tensors.values():  # refused now, not halfway through loading the weights
        _check_tensor_type(tensor, path)


def _iter_weights(
    tensors: dict[str, ReaderTensor], hf_config: dict[str, Any], path: Path, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantize, rename, un-permute and shape-check each tensor of the file, one at a time."""
    expected = expected_shapes(hf_config)
    # llama.cpp interleaves q/k rows per head for its rotary kernel; Qwen2 is converted as is.
    permute_rotary = hf_config["model_type"] == "llama"
    for gguf_name, reader_tensor in tensors.items():
        hf_name = hf_tensor_name(gguf_name)
        assert hf_name is not None
        tensor = torch.from_numpy(_dequantize(reader_tensor, path))
        if tuple(tensor.shape) != expected[hf_name]:
            raise ValueError(
                f"{path}: tensor {gguf_name!r} has shape {tuple(tensor.shape)}, but the config "
                f"needs {expected[hf_name]} for {hf_name}"
            )
        if permute_rotary and ".self_attn.q_proj." in hf_name:
            tensor = unpermute_rotary_rows(tensor, hf_config["num_attention_heads"])
        elif permute_rotary and ".self_attn.k_proj." in hf_name:
            tensor = unpermute_rotary_rows(tensor, hf_config["num_key_value_heads"])
        yield hf_name, tensor.to(dtype).contiguous()


def _check_tensor_type(tensor: ReaderTensor, path: Path) -> None:
    """Refuse a tensor type infer8 cannot dequantize, naming the tensor and the type."""
    if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
        raise ValueError(
            f"{path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which infer8 "
            f"cannot load; supported types: {supported}"
        )


def _dequantize(tensor: ReaderTensor, path: Path) -> np.ndarray:
    """Return a tensor's values as a fresh float32 array in PyTorch's (reversed GGUF) shape."""
    _check_tensor_type(tensor, path)
    # GGUF lists dimensions innermost first; PyTorch outermost first.
    shape = tuple(int(dim) for dim in reversed(tensor.shape.tolist()))
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except (ValueError, NotImplementedError) as e:
        raise ValueError(f"{path}: cannot dequantize tensor {tensor.name!r}: {e}") from e
    # np.array copies: the reader's arrays are read-only views of the memory-mapped file.
    return np.array(values, dtype=np.float32).reshape(shape)


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head rotary row interleaving of a q/k weight or bias."""
    half_head_dim = weight.shape[0] // num_heads // 2
    # llama.cpp wrote rows as [head, half_head_dim, 2]; Hugging Face wants [head, 2, half_head_dim].
    grouped = weight.reshape(num_heads, half_head_dim, 2, *weight.shape[1:])
    return grouped.transpose(1, 2).reshape(weight.shape)


def _preview(names: list[str], limit: int = 5) -> str:
    """Return the first few names of a list, with a count of the rest."""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    """Write a dict as indented JSON."""
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def disk_full_as_error(path: Path, need_bytes: int | None = None) -> Iterator[None]:
    """Answer a full disk (or quota) while writing `path` with one line: the path and the space
    its file system has free (and what the write needs, when known)."""
    try:
        yield
    except OSError as e:
        if e.errno not in _DISK_FULL_ERRNOS:
            raise
        existing = next(p for p in (path, *path.parents) if p.exists())
        free = shutil.disk_usage(existing).free
        need = f"; it needs about {need_bytes / (1 << 20):,.0f} MiB" if need_bytes else ""
        raise RuntimeError(
            f"no space left to write {path}: {free / (1 << 20):,.1f} MiB free on its file "
            f"system{need} ({e.strerror or e}); free some space or set INFER8_CACHE elsewhere"
        ) from None


def _as_os_error(error: Exception, path: Path) -> Exception:
    """Return the OSError a safetensors write error reports ("(os error 28)"), else one line."""
    match = re.search(r"\(os error (\d+)\)", str(error))
    if match is None:
        return RuntimeError(f"cannot write {path}: {error}")
    code = int(match.group(1))
    return OSError(code, os.strerror(code), str(path))


def _replace_dir(src: Path, dst: Path) -> None:
    """Move directory `src` to `dst`, replacing any old `dst` with renames only."""
    if not dst.exists():
        os.rename(src, dst)
        return
    old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex}"
    os.rename(dst, old)
    os.rename(src, dst)
    shutil.rmtree(old, ignore_errors=True)
