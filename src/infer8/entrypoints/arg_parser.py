"""ArgumentParser whose errors are one line: the offending flag or value and a "did you mean".

argparse prints the whole usage above an error (80 lines for `infer8 serve`), names no close
flag for a typo, and reports `--promt x` as "--prompt is required". Here the usage is left to
`--help`, unknown flags and bad choices get the nearest valid spelling (difflib), and a missing
required flag that a given unknown one resembles says so. The exit status stays argparse's 2.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

_REQUIRED_PREFIX = "the following arguments are required: "


def closest(word: str, candidates: Iterable[str]) -> str | None:
    """Return the candidate closest to `word` (difflib), or None when none is close."""
    matches = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """Return ' (did you mean X?)' for the closest candidate, or '' when none is close."""
    match = closest(word, candidates)
    return f" (did you mean {match}?)" if match else ""


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser (subcommands included) that answers mistakes in one line, exit 2."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        # kept so that a "required" error can point at the typo that was given instead
        self._given_args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            # the subcommand's parser knows the flags the user meant
            parser = self._innermost_parser(ns)
            parser.error(parser._unrecognized_message(extras))
        return ns

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        """Print `prog: error: message` on one line (no usage) and exit with status 2."""
        if message.startswith(_REQUIRED_PREFIX):
            message += self._typo_of_required(message.removeprefix(_REQUIRED_PREFIX))
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        """Refuse a value outside `choices`, naming the closest choice."""
        choices = action.choices
        if choices is None or value in choices:
            return
        names = [str(choice) for choice in choices]
        hint = did_you_mean(str(value), names)
        if isinstance(action, argparse._SubParsersAction):
            raise argparse.ArgumentError(
                None, f"unknown command {value!r}{hint}; commands: {', '.join(names)}"
            )
        raise argparse.ArgumentError(
            action, f"invalid choice {value!r}{hint}; choose from {', '.join(names)}"
        )

    def _long_flags(self) -> list[str]:
        return [flag for flag in self._option_string_actions if flag.startswith("--")]

    def _unrecognized_message(self, extras: list[str]) -> str:
        """Return 'unrecognized argument(s): ...' with a suggestion per unknown flag."""
        flags = [arg for arg in extras if arg.startswith("-") and arg != "-"]
        if not flags:
            return f"unrecognized arguments: {' '.join(extras)}"
        parts = []
        for flag in flags:
            name = flag.split("=", 1)[0]
            parts.append(f"{name}{did_you_mean(name, self._long_flags())}")
        noun = "argument" if len(parts) == 1 else "arguments"
        return f"unrecognized {noun}: " + ", ".join(parts)

    def _typo_of_required(self, missing: str) -> str:
        """Return '; --promt was given: a typo of --prompt?' for each look-alike given flag."""
        known = set(self._option_string_actions)
        given = [
            arg.split("=", 1)[0]
            for arg in getattr(self, "_given_args", [])
            if arg.startswith("--") and arg.split("=", 1)[0] not in known
        ]
        hints = []
        for flag in missing.split(", "):
            match = closest(flag, given)
            if match:
                hints.append(f" ({match} was given: a typo of {flag}?)")
        return "".join(hints)

    def _innermost_parser(self, ns: argparse.Namespace) -> ArgumentParser:
        """Return the parser of the subcommand (and sub-subcommand) that was chosen."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(ns, action.dest, None))
                if isinstance(chosen, ArgumentParser):
                    return chosen._innermost_parser(ns)
        return self
