"""LoRAConfig and LoRARequest: vLLM's LoRA settings and a request's adapter, as plain data."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoRAConfig:
    """How many adapters a step holds (device slots), their largest rank, and how many the
    host keeps loaded (vLLM's --max-loras, --max-lora-rank, --max-cpu-loras)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be a positive integer, got {value!r}"
                )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras "
                f"({self.max_loras})"
            )

    @property
    def num_cpu_loras(self) -> int:
        """Return how many loaded adapters the host keeps (slots' adapters included)."""
        return self.max_cpu_loras or self.max_loras


@dataclass(frozen=True)
class LoRARequest:
    """One adapter a request runs with: its name (the `model` clients send), a positive id
    unique per adapter in the engine, and its PEFT directory (vLLM's LoRARequest)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None  # the parent /v1/models lists (None: the served model)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("a LoRA adapter needs a non-empty name")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} needs a path")


@dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` entry: `name=path`, or vLLM's JSON form with base_model_name."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoRAModulePath:
        """Parse `name=path` or `{"name": ..., "path": ..., "base_model_name": ...}`."""
        text = text.strip()
        if text.startswith("{"):
            try:
                values: Any = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules: invalid JSON {text!r} ({e.msg})") from None
            if not isinstance(values, dict):
                raise ValueError(f"--lora-modules: expected a JSON object, got {text!r}")
            unknown = sorted(set(values) - {"name", "path", "base_model_name"})
            if unknown:
                raise ValueError(
                    f"--lora-modules: unknown keys {unknown} (known: name, path, base_model_name)"
                )
            name, path = values.get("name"), values.get("path")
            base = values.get("base_model_name")
        else:
            name, sep, path = text.partition("=")
            if not sep:
                raise ValueError(
                    f"--lora-modules: expected name=path or a JSON object, got {text!r}"
                )
            base = None
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules: {text!r} needs both a name and a path")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules: base_model_name must be a string in {text!r}")
        return cls(name, path, base)
