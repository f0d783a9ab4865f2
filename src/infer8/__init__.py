"""infer8: dense LLM serving with continuous batching and an FP8 KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from infer8.lora.config import LoRARequest
from infer8.sampling_params import SamplingParams
from infer8.version import __version__

if TYPE_CHECKING:
    from infer8.entrypoints.llm import LLM

__all__ = ["LLM", "LoRARequest", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and the model code; import it on first use.
    if name == "LLM":
        from infer8.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
