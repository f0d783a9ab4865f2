"""SpeculativeConfig: vLLM's `--speculative-config` JSON, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from infer8.utils import check_known_keys, json_object_flag

SUPPORTED_METHODS = ("ngram", "suffix")
# vLLM's methods that need a draft model or a draft head: refused by name.
_DRAFT_MODEL_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "draft_model", "mtp",
                        "deepseek_mtp")  # fmt: skip


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed (vLLM's SpeculativeConfig names and defaults: ngram, suffix)."""

    method: str = "ngram"
    num_speculative_tokens: int = 5  # suffix: defaults to suffix_decoding_max_tree_depth
    # ngram: the longest and shortest suffix of a request's tokens looked up earlier in them
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    # suffix: the tries' depth (the longest match and draft), the finished requests whose
    # outputs are kept, drafts up to this factor x the match length, and the least estimated
    # probability of a drafted continuation
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10_000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # vLLM's: stop proposing while more requests than this run (None: never)
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SUPPORTED_METHODS:
            raise ValueError(_method_error(self.method))
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests"):  # fmt: skip
            value = getattr(self, name)
            least = 0 if name == "suffix_decoding_max_cached_requests" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"--speculative-config: {name} must be an integer >= {least}, "
                                 f"got {value!r}")  # fmt: skip
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"--speculative-config: prompt_lookup_min ({self.prompt_lookup_min}) must not "
                f"exceed prompt_lookup_max ({self.prompt_lookup_max})"
            )
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
            raise ValueError(
                f"--speculative-config: suffix_decoding_max_spec_factor must be > 0, got {factor!r}"
            )
        if not isinstance(prob, (int, float)) or isinstance(prob, bool) or not 0 <= prob <= 1:
            raise ValueError(
                f"--speculative-config: suffix_decoding_min_token_prob must be in [0, 1], "
                f"got {prob!r}"
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
        values = json_object_flag("--speculative-config", text)
        method = values.pop("model", None) if values.get("method") is None else values["method"]
        # vLLM's older form: {"model": "[ngram]"}; any other model is a draft model
        if method in ("[ngram]", None):
            method = "ngram"
        if method not in SUPPORTED_METHODS:
            raise ValueError(_method_error(str(method)))
        values["method"] = method
        values.pop("model", None)
        check_known_keys("--speculative-config", values, (f.name for f in fields(cls)))
        if method == "suffix" and "num_speculative_tokens" not in values:
            depth = values.get("suffix_decoding_max_tree_depth", cls.suffix_decoding_max_tree_depth)
            values["num_speculative_tokens"] = depth
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
