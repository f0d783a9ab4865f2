"""A GGUF file's tokenizer as `tokenizers` JSON and Hugging Face tokenizer / generation configs,
rebuilt from its `tokenizer.ggml.*` metadata (byte-level BPE, llama.cpp's pre-tokenizers)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

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

from infer8.models.gguf_metadata import require

logger = logging.getLogger(__name__)

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


def build_tokenizer_json(metadata: dict[str, Any], path: Path) -> str:
    """Return a `tokenizers` tokenizer.json rebuilt from the `tokenizer.ggml.*` metadata."""
    tokenizer_model = metadata.get("tokenizer.ggml.model")
    if tokenizer_model != "gpt2":
        raise ValueError(
            f"{path} has tokenizer model {tokenizer_model!r}; infer8 can only rebuild byte-level "
            "BPE ('gpt2') tokenizers from GGUF"
        )
    tokens: list[str] = require(metadata, "tokenizer.ggml.tokens", path)
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [
        _TOKEN_TYPE_NORMAL
    ] * len(tokens)
    merges = _parse_merges(require(metadata, "tokenizer.ggml.merges", path), path)
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


def build_tokenizer_config(metadata: dict[str, Any], hf_config: dict[str, Any]) -> dict[str, Any]:
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


def eos_token_ids(metadata: dict[str, Any]) -> list[int]:
    """Return the ids that end a turn: EOS, plus end-of-turn/message tokens where distinct."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [metadata.get(f"tokenizer.ggml.{key}") for key in keys]
    return list(dict.fromkeys(i for i in ids if i is not None))


def build_generation_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """Return a generation_config.json dict carrying the BOS/EOS/pad ids."""
    config: dict[str, Any] = {}
    if "tokenizer.ggml.bos_token_id" in metadata:
        config["bos_token_id"] = metadata["tokenizer.ggml.bos_token_id"]
    eos_ids = eos_token_ids(metadata)
    if eos_ids:
        config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if "tokenizer.ggml.padding_token_id" in metadata:
        config["pad_token_id"] = metadata["tokenizer.ggml.padding_token_id"]
    return config
