"""Grammar-constrained decoding on xgrammar: JSON schema, JSON object, regex, choice, EBNF.

`params` is pure Python (SamplingParams imports it); `manager` holds the xgrammar state.
"""

from __future__ import annotations

from infer8.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
