"""Refuse a model's config.json that cannot describe a model, before anything is built: one
line naming the field. (Whether it fits this machine is worker/fit_check.py's question.)"""

from __future__ import annotations

from typing import Any

# The shape fields every Llama-family config.json carries, and those it may leave out.
REQUIRED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
OPTIONAL_FIELDS = ("num_key_value_heads", "head_dim", "max_position_embeddings")


def check_hf_config_fields(cfg: dict[str, Any]) -> None:
    """Raise ValueError naming the first shape field that is missing or inconsistent."""
    for name in REQUIRED_FIELDS:
        if name not in cfg:
            raise ValueError(f"{name} is missing")
        _check_positive(cfg, name)
    for name in OPTIONAL_FIELDS:
        if cfg.get(name) is not None:
            _check_positive(cfg, name)
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    if cfg.get("head_dim") is None and hidden % heads:  # head_dim would be hidden // heads
        raise ValueError(
            f"num_attention_heads {heads} does not divide hidden_size {hidden} (and no head_dim "
            "is given)"
        )
    kv_heads = cfg.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ValueError(
            f"num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}"
        )


def _check_positive(cfg: dict[str, Any], name: str) -> None:
    value = cfg[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
