"""Load llama.cpp GGUF checkpoints (Llama, Qwen2) as Hugging Face-style config, weights and tokenizer.

GGUF stores what a Hugging Face checkpoint splits over several files: the config as `<arch>.*`
metadata, the tokenizer as `tokenizer.ggml.*` metadata, and the weights under llama.cpp's names,
possibly quantized, with the q/k projection rows of Llama reordered for llama.cpp's rotary
kernel. `load_gguf` undoes all of that, so its output equals what transformers' own GGUF loader
produces; `convert_gguf_to_hf` writes it out as a regular Hugging Face model directory.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderTensor
from gguf.quants import dequantize
from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers import Tokenizer as HFTokenizer
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from infer8.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"

SUPPORTED_TENSOR_TYPES = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
    }
)

# GGUF `general.architecture` -> (Hugging Face architecture class, model_type).
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
}

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

# llama.cpp `tokenizer.ggml.token_type` values.
_TOKEN_TYPE_NORMAL = 1
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer regexes, as llama.cpp's llama-vocab.cpp applies them per `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Single digits first, then the GPT-2 regex (StarCoder's tokenizer, which SmolLM reuses).
_DIGITS_THEN_GPT2_PRE = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}
)
_GPT2_PRE = frozenset({"default", "gpt-2", "gpt2", "mpt", "olmo", "jais", "trillion"})
_LLAMA3_PRE = frozenset(
    {"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3", "pixtral", "midm-2.0"}
)
_QWEN2_PRE = frozenset({"qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"})


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
    reader = _open_reader(path)
    metadata = _read_metadata(reader, path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    hf_config = _build_hf_config(metadata, tensors, path, dtype)
    _check_tensor_names(tensors, hf_config, path)
    model = GGUFModel(
        hf_config=hf_config,
        tokenizer_json=_build_tokenizer_json(metadata, path),
        tokenizer_config=_build_tokenizer_config(metadata, hf_config),
        generation_config=_build_generation_config(metadata),
        path=path,
        tensors=tensors,
        dtype=dtype,
    )
    if progress:  # the converter wants the whole state dict now, with a progress bar
        names = tqdm(total=len(tensors), desc=f"Loading {path.name}", unit="tensor")
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
    reader = _open_reader(path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    return _build_hf_config(_read_metadata(reader, path), tensors, path, torch.float32)


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
    reader = _open_reader(path)
    metadata = _read_metadata(reader, path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    hf_config = _build_hf_config(metadata, tensors, path, torch.float32)
    tokenizer_config = _build_tokenizer_config(metadata, hf_config)
    return Tokenizer(
        HFTokenizer.from_str(_build_tokenizer_json(metadata, path)),
        tokenizer_config,
        _eos_token_ids(metadata),
        tokenizer_config.get("chat_template"),
    )


def convert_gguf_to_hf(
    gguf_path: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    progress: bool = True,
) -> Path:
    """Write a GGUF checkpoint as a Hugging Face model directory, atomically, and return it."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    model = load_gguf(gguf_path, dtype=dtype, progress=progress)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Not mkdtemp: its 0700 mode would carry over to the final directory of a shared cache.
    tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex}"
    tmp_dir.mkdir()
    try:
        _write_json(tmp_dir / "config.json", model.hf_config)
        (tmp_dir / "tokenizer.json").write_text(model.tokenizer_json, encoding="utf-8")
        save_file(model.state_dict, str(tmp_dir / "model.safetensors"), metadata={"format": "pt"})
        # safetensors creates its file 0600; give it the umask-derived mode of its siblings.
        shutil.copymode(tmp_dir / "tokenizer.json", tmp_dir / "model.safetensors")
        _write_json(tmp_dir / "tokenizer_config.json", model.tokenizer_config)
        _write_json(tmp_dir / "generation_config.json", model.generation_config)
        _replace_dir(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def _open_reader(path: Path) -> GGUFReader:
    """Open a GGUF file, turning any parse failure into a ValueError that names the file."""
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(
            f"{path} is not a GGUF file: it starts with {magic!r}, not the magic bytes {GGUF_MAGIC!r}"
        )
    try:
        return GGUFReader(path)
    except Exception as e:  # gguf raises ValueError, IndexError, KeyError... on a bad file
        raise ValueError(
            f"{path} is a corrupt or truncated GGUF file ({path.stat().st_size} bytes): "
            f"{type(e).__name__}: {e}"
        ) from e


def _read_metadata(reader: GGUFReader, path: Path) -> dict[str, Any]:
    """Return the key/value metadata as plain Python values."""
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            value = field.contents()
        except (UnicodeDecodeError, IndexError, ValueError) as e:
            raise ValueError(f"{path} has corrupt metadata under {key!r}: {e}") from e
        if field.types and field.types[0] == GGUFValueType.BOOL:
            value = bool(value)
        metadata[key] = value
    return metadata


def _require(metadata: dict[str, Any], key: str, path: Path) -> Any:
    """Return a metadata value that must be present."""
    if key not in metadata:
        raise ValueError(f"{path} lacks the metadata key {key!r}")
    return metadata[key]


def _float32_to_float(value: float) -> float:
    """Return the shortest decimal that rounds to the same float32 (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _build_hf_config(
    metadata: dict[str, Any], tensors: dict[str, ReaderTensor], path: Path, dtype: torch.dtype
) -> dict[str, Any]:
    """Return a Hugging Face config.json dict from the `<arch>.*` metadata."""
    arch = _require(metadata, "general.architecture", path)
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{path} has architecture {arch!r}, which infer8 cannot load; "
            f"supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    hf_architecture, model_type = ARCHITECTURES[arch]
    hidden_size = int(_require(metadata, f"{arch}.embedding_length", path))
    num_heads = int(_require(metadata, f"{arch}.attention.head_count", path))
    num_kv_heads = metadata.get(f"{arch}.attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        if len(set(num_kv_heads)) != 1:
            raise ValueError(f"{path} has a per-layer KV head count {num_kv_heads}; unsupported")
        num_kv_heads = num_kv_heads[0]
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden_size // num_heads))
    rotary_dim = int(metadata.get(f"{arch}.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ValueError(
            f"{path} applies rotary embeddings to {rotary_dim} of {head_dim} head dims; "
            "partial rotary embeddings are unsupported"
        )
    if "rope_freqs.weight" in tensors:
        raise ValueError(
            f"{path} carries per-frequency rope factors (rope_freqs.weight, Llama 3.1-style rope "
            "scaling), which infer8 cannot load from GGUF"
        )
    vocab_size = metadata.get(f"{arch}.vocab_size")
    if vocab_size is None and "token_embd.weight" in tensors:
        vocab_size = int(tensors["token_embd.weight"].shape[-1])
    if vocab_size is None:
        vocab_size = len(_require(metadata, "tokenizer.ggml.tokens", path))
    config: dict[str, Any] = {
        "architectures": [hf_architecture],
        "model_type": model_type,
        "vocab_size": int(vocab_size),
        "hidden_size": hidden_size,
        "intermediate_size": int(_require(metadata, f"{arch}.feed_forward_length", path)),
        "num_hidden_layers": int(_require(metadata, f"{arch}.block_count", path)),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _float32_to_float(
            _require(metadata, f"{arch}.attention.layer_norm_rms_epsilon", path)
        ),
        "rope_theta": _float32_to_float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_require(metadata, f"{arch}.context_length", path)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if "tokenizer.ggml.padding_token_id" in metadata:
        config["pad_token_id"] = metadata["tokenizer.ggml.padding_token_id"]
    rope_scaling = _rope_scaling(metadata, arch, path)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    if model_type == "qwen2":
        config["attention_bias"] = True
        config["use_sliding_window"] = False
    return config


def _rope_scaling(metadata: dict[str, Any], arch: str, path: Path) -> dict[str, Any] | None:
    """Return Hugging Face `rope_scaling` for the supported GGUF rope scaling types."""
    scaling_type = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = metadata.get(f"{arch}.rope.scaling.factor", 1.0)
    if scaling_type == "none" or factor == 1.0:
        return None
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": _float32_to_float(factor)}
    raise ValueError(f"{path} uses rope scaling {scaling_type!r}; only 'linear' is supported")


def _expected_shapes(hf_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Return every Hugging Face parameter name this config needs, with its shape."""
    hidden = hf_config["hidden_size"]
    q_size = hf_config["num_attention_heads"] * hf_config["head_dim"]
    kv_size = hf_config["num_key_value_heads"] * hf_config["head_dim"]
    inter = hf_config["intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (hf_config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    if not hf_config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (hf_config["vocab_size"], hidden)
    for layer in range(hf_config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        shapes[prefix + "input_layernorm.weight"] = (hidden,)
        shapes[prefix + "post_attention_layernorm.weight"] = (hidden,)
        shapes[prefix + "self_attn.q_proj.weight"] = (q_size, hidden)
        shapes[prefix + "self_attn.k_proj.weight"] = (kv_size, hidden)
        shapes[prefix + "self_attn.v_proj.weight"] = (kv_size, hidden)
        shapes[prefix + "self_attn.o_proj.weight"] = (hidden, q_size)
        shapes[prefix + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[prefix + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[prefix + "mlp.down_proj.weight"] = (hidden, inter)
        if hf_config.get("attention_bias"):
            shapes[prefix + "self_attn.q_proj.bias"] = (q_size,)
            shapes[prefix + "self_attn.k_proj.bias"] = (kv_size,)
            shapes[prefix + "self_attn.v_proj.bias"] = (kv_size,)
    return shapes


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
    expected = _expected_shapes(hf_config)
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
    expected = _expected_shapes(hf_config)
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


@cache
def _bytes_to_unicode() -> dict[int, str]:
    """Return GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    byte_to_char = {b: chr(b) for b in printable}
    num_extra = 0
    for b in range(256):
        if b not in byte_to_char:
            byte_to_char[b] = chr(256 + num_extra)
            num_extra += 1
    return byte_to_char


def _build_tokenizer_json(metadata: dict[str, Any], path: Path) -> str:
    """Return a `tokenizers` tokenizer.json rebuilt from the `tokenizer.ggml.*` metadata."""
    tokenizer_model = metadata.get("tokenizer.ggml.model")
    if tokenizer_model != "gpt2":
        raise ValueError(
            f"{path} has tokenizer model {tokenizer_model!r}; infer8 can only rebuild byte-level "
            "BPE ('gpt2') tokenizers from GGUF"
        )
    tokens: list[str] = _require(metadata, "tokenizer.ggml.tokens", path)
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [
        _TOKEN_TYPE_NORMAL
    ] * len(tokens)
    merges = _parse_merges(_require(metadata, "tokenizer.ggml.merges", path), path)
    byte_to_char = _bytes_to_unicode()
    alphabet = set(byte_to_char.values())
    vocab: dict[str, int] = {}
    special: list[AddedToken] = []
    user_defined: list[AddedToken] = []
    for token_id, (token, token_type) in enumerate(zip(tokens, token_types, strict=True)):
        if token_type == _TOKEN_TYPE_CONTROL:
            special.append(AddedToken(token, special=True, normalized=False))
        elif token_type == _TOKEN_TYPE_USER_DEFINED:
            user_defined.append(AddedToken(token, special=False, normalized=False))
        elif not set(token) <= alphabet:
            # A regular token spelled in raw text: respell it in the byte alphabet.
            token = "".join(byte_to_char[b] for b in token.encode("utf-8"))
        # Added tokens keep their raw text as the vocab key, as in a Hugging Face tokenizer.json.
        vocab.setdefault(token, token_id)
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = metadata.get("tokenizer.ggml.pre", "default")
    tokenizer.normalizer = normalizers.NFC() if pre in _QWEN2_PRE else None
    tokenizer.pre_tokenizer = _pre_tokenizer(pre, path)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user_defined)
    post_processor = _post_processor(metadata, tokens)
    if post_processor is not None:
        tokenizer.post_processor = post_processor
    return tokenizer.to_str()


def _parse_merges(merges: Iterable[str], path: Path) -> list[tuple[str, str]]:
    """Split llama.cpp's "left right" merge strings into pairs."""
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise ValueError(f"{path} has a malformed BPE merge {merge!r}")
        pairs.append((left, right))
    return pairs


def _pre_tokenizer(pre: str, path: Path) -> pre_tokenizers.PreTokenizer:
    """Return the pre-tokenizer that splits text like llama.cpp does for this `ggml.pre` type."""
    byte_level_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    byte_level_only = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level_regex]
        )
    if pre in _LLAMA3_PRE or pre in _QWEN2_PRE:
        split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level_only]
        )
    if pre not in _GPT2_PRE:
        logger.warning(
            "%s: unknown pre-tokenizer type %r; splitting text with the GPT-2 regex", path, pre
        )
    return byte_level_regex


def _post_processor(metadata: dict[str, Any], tokens: list[str]) -> processors.PostProcessor | None:
    """Return a post-processor adding BOS/EOS when the file says llama.cpp adds them."""
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", False)
    add_eos = metadata.get("tokenizer.ggml.add_eos_token", False)
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    eos_id = metadata.get("tokenizer.ggml.eos_token_id")
    bos = [(tokens[bos_id], bos_id)] if add_bos and bos_id is not None else []
    eos = [(tokens[eos_id], eos_id)] if add_eos and eos_id is not None else []
    if not bos and not eos:
        return None

    def template(sequence: str, type_id: int) -> list[str]:
        pieces = [token for token, _ in bos] + [sequence] + [token for token, _ in eos]
        return [f"{piece}:{type_id}" for piece in pieces]

    return processors.TemplateProcessing(
        single=template("$A", 0),
        pair=template("$A", 0) + template("$B", 1),
        special_tokens=list(dict.fromkeys(bos + eos)),
    )


def _build_tokenizer_config(metadata: dict[str, Any], hf_config: dict[str, Any]) -> dict[str, Any]:
    """Return a tokenizer_config.json dict: special tokens, chat template, BOS/EOS policy."""
    tokens = metadata.get("tokenizer.ggml.tokens", [])

    def token_text(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and token_id < len(tokens) else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token_text("bos_token_id"),
        "eos_token": token_text("eos_token_id"),
        "pad_token": token_text("padding_token_id"),
        "unk_token": token_text("unknown_token_id"),
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": hf_config["max_position_embeddings"],
    }
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return config


def _eos_token_ids(metadata: dict[str, Any]) -> list[int]:
    """Return the ids that end a turn: EOS, plus end-of-turn/message tokens where distinct."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [metadata.get(f"tokenizer.ggml.{key}") for key in keys]
    return list(dict.fromkeys(i for i in ids if i is not None))


def _build_generation_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """Return a generation_config.json dict carrying the BOS/EOS/pad ids."""
    config: dict[str, Any] = {}
    if "tokenizer.ggml.bos_token_id" in metadata:
        config["bos_token_id"] = metadata["tokenizer.ggml.bos_token_id"]
    eos_ids = _eos_token_ids(metadata)
    if eos_ids:
        config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if "tokenizer.ggml.padding_token_id" in metadata:
        config["pad_token_id"] = metadata["tokenizer.ggml.padding_token_id"]
    return config


def _preview(names: list[str], limit: int = 5) -> str:
    """Return the first few names of a list, with a count of the rest."""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    """Write a dict as indented JSON."""
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _replace_dir(src: Path, dst: Path) -> None:
    """Move directory `src` to `dst`, replacing any old `dst` with renames only."""
    if not dst.exists():
        os.rename(src, dst)
        return
    old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex}"
    os.rename(dst, old)
    os.rename(src, dst)
    shutil.rmtree(old, ignore_errors=True)
