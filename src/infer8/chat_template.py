"""ChatTemplate: a model's Jinja chat template, rendered in a sandbox under a budget.

A template is code from the model's repository, and its loops may run on request data. Each
rendering gets a time, step and size budget checked while it runs (every loop iteration, call,
operator, attribute lookup and output chunk counts a step), so a runaway stops with a
ChatTemplateError (a 400 naming the chat template) and frees its thread within the budget,
instead of wedging the tokenizer pool or allocating until the process aborts.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import _PassArg

# Integers a template computes stay below this many bits (a 10**10**10 never finishes).
MAX_INT_BITS = 4096
# A format width or precision of 7+ digits ("%0100000000d") would allocate that many characters.
_HUGE_FORMAT_WIDTH = re.compile(r"\d{7,}")
_TEXT = (str, bytes)
_CONTAINERS = (list, tuple, dict, set, frozenset)
_SIZED = _TEXT + _CONTAINERS
_SCALARS = (bool, float, type(None))
_MAX_JSON_INDENT = 64  # each nesting level repeats it on every line


@dataclass(frozen=True)
class TemplateBudget:
    """What one rendering may spend: wall time, steps, and characters or items per value."""

    max_time_s: float = 5.0
    # A real template takes tens of steps a message; 4M steps run ~1-2 s of Python.
    max_steps: int = 4_000_000
    # The rendered prompt and any string built on the way (16 Mi characters: more than any
    # context holds); lists, tuples and dicts hold at most max_items entries.
    max_chars: int = 1 << 24
    max_items: int = 1 << 20

    def __post_init__(self) -> None:
        if self.max_time_s <= 0 or min(self.max_steps, self.max_chars, self.max_items) < 1:
            raise ValueError(f"a template budget must be positive: {self}")


class ChatTemplateError(ValueError):
    """A chat template that failed or ran over its budget: the request's 400, never a 500."""


class _Meter:
    """One rendering's spending.

    The clock is read every 64 cheap steps (loop iterations, lookups, operators) and at every
    call, filter and output chunk, the steps that can take long.
    """

    def __init__(self, budget: TemplateBudget) -> None:
        self.budget = budget
        self.num_steps = 0
        self.deadline = time.monotonic() + budget.max_time_s

    def step(self, is_costly: bool = False) -> None:
        self.num_steps += 1
        if self.num_steps > self.budget.max_steps:
            raise ChatTemplateError(
                f"the chat template ran over its budget of {self.budget.max_steps} steps"
            )
        if (is_costly or self.num_steps & 63 == 0) and time.monotonic() > self.deadline:
            raise ChatTemplateError(
                f"the chat template ran over its budget of {self.budget.max_time_s:g} s"
            )

    def check_size(self, value: Any, what: str = "a value") -> None:
        """Refuse a value larger than the budget allows (after it exists)."""
        kind = type(value)
        if kind in _TEXT or (kind not in _SCALARS and isinstance(value, (str, bytes))):
            if len(value) > self.budget.max_chars:
                self.refuse(len(value), what)
        elif kind is int:
            if value.bit_length() > MAX_INT_BITS:
                raise ChatTemplateError(
                    f"the chat template made an integer over {MAX_INT_BITS} bits"
                )
        elif kind in _CONTAINERS or (kind not in _SCALARS and isinstance(value, _CONTAINERS)):
            if len(value) > self.budget.max_items:
                self.refuse(len(value), what)

    def check_planned(self, size: int, what: str) -> None:
        """Refuse an operation whose result would exceed max_chars (before it runs)."""
        if size > self.budget.max_chars:
            self.refuse(size, what)

    def refuse(self, size: int, what: str) -> None:
        raise ChatTemplateError(
            f"the chat template would build {what} of {size} characters or items; its budget "
            f"is {self.budget.max_chars} characters and {self.budget.max_items} items"
        )


class BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox, metered: loops, calls, operators, lookups and filters spend steps.

    Each thread renders with its own meter (`metered`); outside one nothing is metered.
    """

    # `+` is not metered (it is most of a template's work): its operands are, so a sum holds at
    # most a few times max_chars before the next lookup or call refuses it.
    intercepted_binops = frozenset({"*", "**", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._local = threading.local()
        self.globals.pop("lipsum", None)  # lipsum(n) writes n paragraphs
        self.filters = {name: self._metered_filter(f) for name, f in self.filters.items()}

    @property
    def meter(self) -> _Meter | None:
        return getattr(self._local, "meter", None)

    def metered(self, budget: TemplateBudget) -> _MeterScope:
        """Return a context manager that meters this thread's renderings under a budget."""
        return _MeterScope(self, budget)

    # -- every for loop iterates through `metered_iter` ----------------------------------------
    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            # An environment attribute, which no template variable can shadow.
            wrap = nodes.EnvironmentAttribute("metered_iter", lineno=loop.lineno)
            loop.iter = nodes.Call(wrap, [loop.iter], [], None, None, lineno=loop.lineno)
        tree.set_environment(self)
        return tree

    def metered_iter(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Yield a loop's items, one step each."""
        meter = self.meter
        if meter is None:
            yield from iterable
            return
        for item in iterable:
            meter.step()
            yield item

    # -- the sandbox's hooks -------------------------------------------------------------------
    def getattr(self, obj: Any, attribute: str) -> Any:
        meter = self.meter
        if meter is not None and attribute in ("format", "format_map"):
            _check_format(meter, obj)  # the sandbox wraps str.format here, not in `call`
        value = super().getattr(obj, attribute)
        if meter is not None:
            meter.step()
            meter.check_size(value)
        return value

    def getitem(self, obj: Any, argument: Any) -> Any:
        value = super().getitem(obj, argument)
        meter = self.meter
        if meter is not None:
            meter.step()
            meter.check_size(value)
        return value

    def call(
        __self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any
    ) -> Any:  # noqa: N805
        meter = __self.meter
        if meter is None:
            return super().call(__context, __obj, *args, **kwargs)
        meter.step(is_costly=True)
        _check_arguments(meter, args, kwargs)
        target = getattr(__obj, "__self__", None)
        if isinstance(target, str):
            _check_str_method(meter, target, getattr(__obj, "__name__", ""), args, kwargs)
        value = super().call(__context, __obj, *args, **kwargs)
        meter.check_size(value)
        return value

    def call_binop(
        self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any
    ) -> Any:
        meter = self.meter
        if meter is not None:
            meter.step()
            _check_binop(meter, operator, left, right)
        value = super().call_binop(context, operator, left, right)
        if meter is not None:
            meter.check_size(value)
        return value

    def _metered_filter(self, f: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap a filter to spend a step and check its sizes.

        The wrapper takes the context, which also keeps jinja from running the filter at
        compile time on constant arguments (unmetered: `'x'|center(10**9)` would run there).
        """
        pass_arg = _PassArg.from_obj(f)

        @jinja2.pass_context
        def metered(context: jinja2.runtime.Context, value: Any, *args: Any, **kwargs: Any) -> Any:
            lead: tuple[Any, ...] = ()
            if pass_arg is _PassArg.context:
                lead = (context,)
            elif pass_arg is _PassArg.eval_context:
                lead = (context.eval_ctx,)
            elif pass_arg is _PassArg.environment:
                lead = (context.environment,)
            meter = self.meter
            if meter is not None:
                meter.step(is_costly=True)
                _check_arguments(meter, args, kwargs)
                _check_filter(meter, f.__name__, value, args, kwargs)
            result = f(*lead, value, *args, **kwargs)
            if meter is not None:
                meter.check_size(result)
            return result

        return metered


class _MeterScope:
    def __init__(self, env: BudgetedEnvironment, budget: TemplateBudget) -> None:
        self.env = env
        self.budget = budget

    def __enter__(self) -> _Meter:
        meter = _Meter(self.budget)
        self.env._local.meter = meter
        return meter

    def __exit__(self, *exc: object) -> None:
        self.env._local.meter = None


def _check_arguments(meter: _Meter, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse over-large arguments, and counts or widths past max_chars (center(10**10))."""
    for value in (*args, *kwargs.values()):
        meter.check_size(value, "an argument")
        if isinstance(value, int) and not isinstance(value, bool):
            meter.check_planned(abs(value), "a width or count")


def _check_format(meter: _Meter, fmt: Any) -> None:
    if isinstance(fmt, str) and _HUGE_FORMAT_WIDTH.search(fmt):
        meter.refuse(10**6, "a formatted string with a width")


def _joined_chars(separator: str, items: Any) -> int:
    if not isinstance(items, (list, tuple, str)):
        return 0  # an iterator: its items are checked as it runs
    return len(separator) * len(items) + sum(len(i) for i in items if isinstance(i, str))


def _replaced_chars(text: str, old: Any, new: Any, count: Any = -1) -> int:
    if not isinstance(old, str) or not isinstance(new, str):
        return len(text)
    num = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        num = min(num, count)
    return len(text) + num * max(0, len(new) - len(old))


def _check_str_method(
    meter: _Meter, text: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Refuse str methods whose result would outgrow the budget before they allocate it."""
    if name == "join" and args:
        meter.check_planned(_joined_chars(text, args[0]), "a joined string")
    elif name == "replace" and len(args) >= 2:
        meter.check_planned(_replaced_chars(text, *args[:3]), "a replaced string")
    elif name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tabsize, int):
            meter.check_planned(len(text) + text.count("\t") * tabsize, "an expanded string")
    elif name in ("format", "format_map"):
        _check_format(meter, text)


def _check_filter(
    meter: _Meter, name: str, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Refuse filters whose result would outgrow the budget before they allocate it."""
    if name == "do_join":
        separator = args[0] if args else kwargs.get("d", "")
        if isinstance(separator, str):
            meter.check_planned(_joined_chars(separator, value), "a joined string")
    elif name == "do_replace" and isinstance(value, str) and len(args) >= 2:
        meter.check_planned(_replaced_chars(value, *args[:3]), "a replaced string")
    elif name == "do_indent" and isinstance(value, str):
        width = args[0] if args else kwargs.get("width", 4)
        width_chars = len(width) if isinstance(width, str) else width
        if isinstance(width_chars, int):
            lines = value.count("\n") + 1
            meter.check_planned(len(value) + lines * width_chars, "an indented string")
    elif name == "do_wordwrap" and isinstance(value, str):
        wrapstring = kwargs.get("wrapstring") or (args[3] if len(args) > 3 else None) or "\n"
        meter.check_planned(len(value) * (1 + len(str(wrapstring))), "a wrapped string")
    elif name == "do_format":
        _check_format(meter, value)
    elif name == "_tojson":
        indent = args[0] if args else kwargs.get("indent")
        if isinstance(indent, int) and indent > _MAX_JSON_INDENT:
            meter.refuse(indent, "JSON with an indent")


def _check_binop(meter: _Meter, operator: str, left: Any, right: Any) -> None:
    """Refuse `'x' * 10**9`, `2 ** 10**9` and `'%0999999999d' % 1` before they run."""
    left_int = isinstance(left, int) and not isinstance(left, bool)
    right_int = isinstance(right, int) and not isinstance(right, bool)
    if operator == "*":
        if left_int and right_int:
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                meter.check_size(1 << (MAX_INT_BITS + 1))
            return
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, _SIZED) and isinstance(times, int):
                meter.check_planned(len(seq) * max(0, times), "a repeated sequence")
    elif operator == "**" and left_int and right_int and right > 0:
        if max(1, abs(left).bit_length() - 1) * right > MAX_INT_BITS:
            meter.check_size(1 << (MAX_INT_BITS + 1))
    elif operator == "%" and isinstance(left, str):
        _check_format(meter, left)
        if "*" in left:
            _check_arguments(meter, right if isinstance(right, tuple) else (right,), {})


class ChatTemplate:
    """A compiled chat template and the budget each rendering runs under."""

    def __init__(self, source: str) -> None:
        env = BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = env._metered_filter(_tojson)
        self.env = env
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the chat template does not parse: {e}") from None

    def render(self, budget: TemplateBudget, **variables: Any) -> str:
        """Render under a budget; ChatTemplateError for any failure of the template's."""
        max_chars = budget.max_chars
        chunks: list[str] = []
        num_chars = 0
        with self.env.metered(budget) as meter:
            try:
                for chunk in self.template.generate(**variables):
                    meter.step(is_costly=True)
                    num_chars += len(chunk)
                    if num_chars > max_chars:
                        meter.refuse(num_chars, "a prompt")
                    chunks.append(chunk)
            except ChatTemplateError:
                raise
            except RecursionError:
                raise ChatTemplateError("the chat template recursed too deeply") from None
            except MemoryError:
                raise ChatTemplateError("the chat template ran out of memory") from None
            except (jinja2.TemplateError, ValueError, TypeError) as e:
                raise ChatTemplateError(str(e)) from None
            except Exception as e:  # noqa: BLE001 - whatever a template raises is its own failure
                raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from None
        return "".join(chunks)


def _raise(message: str) -> None:
    raise ChatTemplateError(f"chat template error: {message}")


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=False)
