"""StructuredOutputsParams: the constraint a request's output must satisfy (vLLM's names)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# Deeper schemas are refused: compilers recurse over them (a C++ stack is no place to find out).
MAX_SCHEMA_DEPTH = 64
# Sizes past which a grammar is refused before compiling: compile time and memory grow with them
# (superlinearly for alternations: 100,000 of them, 1 MB of regex, took 20 s and 270 MB). At
# these bounds a grammar compiles in under 1 s on a 49k-token vocabulary (2 cores; measured in
# benchmarks/grammar_flood.py --sizes). What size cannot bound (`.{0,1000}` costs 4 s in 9
# characters) the compile time limit does (StructuredOutputManager).
MAX_REGEX_CHARS = 65_536
MAX_GRAMMAR_CHARS = 65_536
MAX_CHOICES = 1_000  # OpenAI's limit on enum values in a schema
MAX_CHOICE_CHARS = 65_536  # all choices together
MAX_SCHEMA_CHARS = 262_144  # the schema as canonical JSON (128 tools' schemas fit)


class GrammarTooLargeError(ValueError):
    """A constraint past a size limit; `field` names it (json, regex, choice or grammar)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass
class StructuredOutputsParams:
    """Exactly one of json (a JSON schema), json_object, regex, choice or grammar (EBNF)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's option: no free whitespace between JSON tokens (forces compact, bounded output).
    disable_any_whitespace: bool = False
    _key: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        kinds = [
            name
            for name, value in (
                ("json", self.json),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
                ("json_object", self.json_object or None),
            )
            if value is not None
        ]
        if len(kinds) != 1:
            raise ValueError(
                "structured outputs need exactly one of json, json_object, regex, choice, "
                f"grammar; got {kinds or 'none'}"
            )
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured outputs choice must be a non-empty list of strings")
            self.choice = list(self.choice)
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            except RecursionError:
                raise ValueError(
                    f"the JSON schema is nested deeper than {MAX_SCHEMA_DEPTH} levels"
                ) from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError("the JSON schema must be a JSON object")
        if isinstance(self.json, dict) and nesting_depth(self.json) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the JSON schema is nested deeper than {MAX_SCHEMA_DEPTH} levels")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured outputs {name} must be a non-empty string")
        self._check_size()

    def _check_size(self) -> None:
        """Refuse a constraint too large to compile in bounded time and memory."""
        limits = {"regex": MAX_REGEX_CHARS, "grammar": MAX_GRAMMAR_CHARS}
        for name, limit in limits.items():
            value = getattr(self, name)
            if value is not None and len(value) > limit:
                raise GrammarTooLargeError(
                    name, f"the {name} has {len(value)} characters; the limit is {limit}"
                )
        if self.choice is not None:
            num_chars = sum(len(c) for c in self.choice)
            if len(self.choice) > MAX_CHOICES or num_chars > MAX_CHOICE_CHARS:
                raise GrammarTooLargeError(
                    "choice",
                    f"the choice list has {len(self.choice)} entries of {num_chars} characters; "
                    f"the limits are {MAX_CHOICES} entries and {MAX_CHOICE_CHARS} characters",
                )
        if self.json is not None and len(self.key) > MAX_SCHEMA_CHARS:
            raise GrammarTooLargeError(
                "json",
                f"the JSON schema has {len(self.key)} characters as JSON; the limit is "
                f"{MAX_SCHEMA_CHARS}",
            )

    @property
    def kind(self) -> str:
        """Return which constraint this is: json, json_object, regex, choice or grammar."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @property
    def key(self) -> str:
        """Return a canonical string naming the compiled grammar (the compile cache key)."""
        if self._key is None:
            value: Any = getattr(self, self.kind)
            self._key = json.dumps(
                [self.kind, value, self.disable_any_whitespace], sort_keys=True, ensure_ascii=False
            )
        return self._key


def nesting_depth(value: Any) -> int:
    """Return how deeply JSON containers nest in value (iteratively: no recursion limit)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in item if isinstance(child, (dict, list)))
    return deepest
