"""SpeculativeConfig: vLLM's `--speculative-config` JSON, validated once at start-up."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

SUPPORTED_METHODS = ("ngram",)
# vLLM's methods that need a draft model or a draft head: refused by name.
_DRAFT_MODEL_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "draft_model", "mtp",
                        "deepseek_mtp")  # fmt: skip


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed (vLLM's SpeculativeConfig names and defaults, n-gram method)."""

    method: str = "ngram"
    num_speculative_tokens: int = 5
    # the longest and shortest suffix of a request's tokens looked up earlier in them
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    # vLLM's: stop proposing while more requests than this run (None: never)
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SUPPORTED_METHODS:
            raise ValueError(_method_error(self.method))
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--speculative-config: {name} must be an integer >= 1, "
                                 f"got {value!r}")  # fmt: skip
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"--speculative-config: prompt_lookup_min ({self.prompt_lookup_min}) must not "
                f"exceed prompt_lookup_max ({self.prompt_lookup_max})"
            )
        batch = self.disable_by_batch_size
        if batch is not None and (not isinstance(batch, int) or isinstance(batch, bool)
                                  or batch < 1):  # fmt: skip
            raise ValueError(
                f"--speculative-config: disable_by_batch_size must be an integer >= 1, "
                f"got {batch!r}"
            )

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> SpeculativeConfig:
        """Parse `--speculative-config` as vLLM takes it; unknown keys and methods fail."""
        if isinstance(text, dict):
            values = dict(text)
        else:
            try:
                values = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from e
        if not isinstance(values, dict):
            raise ValueError("--speculative-config must be a JSON object")
        method = values.get("method")
        if method is None and "model" in values:
            method = values["model"]  # vLLM's older form: {"model": "[ngram]"} or a draft model
        if method in ("[ngram]", None):
            method = "ngram"
        if method not in SUPPORTED_METHODS:
            raise ValueError(_method_error(str(method)))
        values["method"] = method
        values.pop("model", None)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"--speculative-config: unknown key(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        # vLLM's rule: one bound given sets the other; neither gives 5 and 5
        lo, hi = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5
        values["prompt_lookup_min"] = hi if lo is None else lo
        values["prompt_lookup_max"] = lo if hi is None else hi
        return cls(**values)


def _method_error(method: str) -> str:
    """Return the one-line refusal of a method infer8 does not run."""
    why = " (it needs a draft model or head)" if method in _DRAFT_MODEL_METHODS else ""
    return (
        f"--speculative-config: method {method!r} is not supported{why}; supported: "
        f"{', '.join(SUPPORTED_METHODS)} (drafts from the request's own tokens)"
    )
