"""The chat template's budget: runaway templates stop with a ChatTemplateError, real ones render."""

from __future__ import annotations

import threading
import time

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from infer8.chat_template import ChatTemplate, ChatTemplateError, TemplateBudget
from infer8.entrypoints.openai.serving import WorkPool
from tests.utils import CHATML

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
# Each case is refused before it allocates or loops for long (without the budget each wedges a
# thread for hours, raises a 500 or allocates gigabytes).
RUNAWAYS = {
    "nested loops": (NESTED_LOOPS, "steps"),
    "nested loops over a string": (
        "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
        "steps",
    ),
    "a shadowed loop helper": ("{% set metered_iter = 1 %}" + NESTED_LOOPS, "steps"),
    "a recursive macro": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed"),
    "a recursive loop": (
        "{% for x in [1] recursive %}{{ loop(range(100000)) }}{% endfor %}",
        "recursed",
    ),
    "a huge string": ("{{ 'x' * 300000000 }}", "300000000"),
    "a huge list": ("{{ ([1] * 300000000)|length }}", "300000000"),
    "a huge power": ("{{ 2 ** 100000000 }}", "bits"),
    "a huge %-width": ("{{ '%0999999999d' % 1 }}", "width"),
    "a huge format width": ("{{ '{:>999999999}'.format(1) }}", "width"),
    "a huge filter width": ("{{ 'x'|center(999999999) }}", "999999999"),
    "a huge method width": ("{{ 'x'.ljust(999999999) }}", "999999999"),
    "a huge join": ("{% set s = 'x' * 1000000 %}{{ s.join([s] * 100) }}", "joined"),
    "a huge replace": ("{% set s = 'x' * 100000 %}{{ s.replace('x', s) }}", "replaced"),
    "a huge indent": ("{{ ('\\n' * 1000000)|indent(1000) }}", "indented"),
    "a doubling namespace": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s|length }}",
        "characters",
    ),
    "a huge output": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "prompt"),
    "a range past the sandbox's": ("{% for i in range(10**6) %}{% endfor %}", "Range too big"),
    "a division by zero": ("{{ 1 / 0 }}", "ZeroDivisionError"),
    "raise_exception": ("{{ raise_exception('no system role') }}", "no system role"),
    "lipsum": ("{{ lipsum(1000000) }}", "undefined"),
    "a syntax error": ("{% for %}", "does not parse"),
}


@pytest.mark.parametrize("name", list(RUNAWAYS))
def test_runaway_templates_stop_with_a_template_error(name: str) -> None:
    source, message = RUNAWAYS[name]
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match=message):
        ChatTemplate(source).render(TemplateBudget(), messages=MESSAGES)
    assert time.monotonic() - t0 < TemplateBudget().max_time_s + 1


def test_the_time_budget_stops_slow_steps() -> None:
    # Each step sorts 100,000 items: the step budget is far off, the clock is not.
    source = (
        "{% set l = range(100000)|list %}{% for i in range(100000) %}{{ (l|sort)[0] }}{% endfor %}"
    )
    budget = TemplateBudget(max_time_s=0.5, max_steps=10**9)
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match="0.5 s"):
        ChatTemplate(source).render(budget, messages=MESSAGES)
    assert time.monotonic() - t0 < 2.0


def test_real_templates_render_as_the_plain_sandbox_does() -> None:
    tools_template = (
        "{% if tools %}{% for t in tools %}{{ t | tojson(indent=2) }}\n{% endfor %}{% endif %}"
        "{% for m in messages %}{{ '<|' ~ m['role'] ~ '|>' ~ m.content | trim }}"
        "{% if loop.last %}{{ '%s:%d' % ('n', loop.index) }}{% endif %}{% endfor %}"
        "{{ '{}-{}'.format(bos_token, messages|length) }}{{ 'a,b'.split(',')|join('+') }}"
    )
    variables = {
        "messages": MESSAGES * 50,
        "tools": [{"name": "f", "parameters": {"type": "object"}}],
        "bos_token": "<s>",
        "add_generation_prompt": True,
    }
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    plain.filters["tojson"] = ChatTemplate("").env.filters["tojson"]
    for source in (CHATML, tools_template):
        expected = plain.from_string(source).render(**variables)
        assert ChatTemplate(source).render(TemplateBudget(), **variables) == expected


def test_each_thread_renders_under_its_own_budget() -> None:
    template = ChatTemplate(NESTED_LOOPS)
    results: list[str] = []

    def render_small() -> None:
        results.append(ChatTemplate(CHATML).render(TemplateBudget(), messages=MESSAGES))

    thread = threading.Thread(target=render_small)
    with pytest.raises(ChatTemplateError):
        thread.start()
        template.render(TemplateBudget(max_steps=100_000), messages=MESSAGES)
    thread.join()
    assert results and "hello" in results[0]


def test_a_pool_whose_every_thread_is_stuck_reports_it() -> None:
    pool = WorkPool(max_workers=1, wedged_after_s=0.1)
    release = threading.Event()
    try:
        pool.executor.submit(pool._timed, release.wait)
        assert pool.wedged_reason() is None
        time.sleep(0.2)
        reason = pool.wedged_reason()
        assert pool.is_wedged() and reason is not None and "1 threads" in reason
    finally:
        release.set()
        pool.shutdown()
    deadline = time.monotonic() + 5
    while pool.is_wedged():
        assert time.monotonic() < deadline
        time.sleep(0.01)
