"""Structured outputs on the default model: validity with and without a grammar, cost per step.

    python benchmarks/structured_outputs.py schema     # 100 JSON-schema requests, t=0 and t=1
    python benchmarks/structured_outputs.py tools      # 100 tool_choice=required requests
    python benchmarks/structured_outputs.py throughput # batch of 32: constrained vs not
    python benchmarks/structured_outputs.py compile    # compile time per schema, cache hits

Each part prints a table and, with --json PATH, writes its numbers. Any engine flag (`--model`,
`--dtype`, `--max-num-seqs`, ...) applies. Outputs are checked with `jsonschema`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import jsonschema

from infer8.engine import LLMEngine
from infer8.entrypoints.args import add_engine_args, engine_args_from
from infer8.entrypoints.openai.tool_calls import render_tools, resolve_tools
from infer8.sampling_params import SamplingParams
from infer8.structured_output.manager import StructuredOutputManager
from infer8.structured_output.params import StructuredOutputsParams

JOBS = ["teacher", "baker", "pilot", "nurse", "farmer", "painter", "engineer", "chef"]
CITIES = ["Paris", "Lagos", "Lima", "Osaka", "Oslo", "Cairo", "Quito", "Perth", "Pune", "Rome"]
COUNTRIES = ["France", "Nigeria", "Peru", "Japan", "Norway", "Egypt", "Ecuador", "Australia"]
PERSON = {  # required fields, enums, arrays, a nested object, bounded strings and integers
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "job": {"enum": JOBS},
        "skills": {
            "type": "array",
            "items": {"type": "string", "maxLength": 16},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "country": {"enum": COUNTRIES},
            },
            "required": ["city", "country"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "job", "skills", "address"],
    "additionalProperties": False,
}


def without_bounds(schema: Any) -> Any:
    """Return a schema without maxLength / maxItems / minimum / maximum (as a new user writes it)."""
    if isinstance(schema, list):
        return [without_bounds(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    bounds = ("maxLength", "maxItems", "minimum", "maximum")
    return {k: without_bounds(v) for k, v in schema.items() if k not in bounds}


PERSON_OPEN = without_bounds(PERSON)  # free-length strings and lists: outputs can run long
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "book_table",
            "description": "Book a restaurant table",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "people": {"type": "integer", "minimum": 1, "maximum": 12},
                    "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                },
                "required": ["city", "people", "time"],
                "additionalProperties": False,
            },
        },
    },
]


def person_prompt(i: int) -> list[dict[str, Any]]:
    """Return a chat asking for one JSON profile, described in words (short prompts)."""
    job, city = JOBS[i % len(JOBS)], CITIES[(i // len(JOBS)) % len(CITIES)]
    return [
        {
            "role": "system",
            "content": "Reply with one JSON object only, with keys name, age (18-99), job, "
            "skills (a list of 1-3 strings) and address (an object with city and country).",
        },
        {"role": "user", "content": f"Invent a {job} who lives in {city}. Profile #{i}."},
    ]


def tool_prompt(i: int) -> list[dict[str, Any]]:
    """Return a chat that calls for one of the tools."""
    city = CITIES[i % len(CITIES)]
    asks = [f"What's the weather in {city}?", f"Book a table for {i % 6 + 2} in {city} at 19:30."]
    return [{"role": "user", "content": asks[i % 2]}]


def run(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[list[Any], float]:
    """Run requests to completion; return outputs in order and the wall time.

    One 1-token request first puts the shared system prompt in the prefix cache (requests
    admitted in the same step cannot share blocks that are not computed yet).
    """
    warm = engine.add_request(prompts[0], SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    del warm
    t0 = time.perf_counter()
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done: dict[str, Any] = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [done[i] for i in ids], time.perf_counter() - t0


def validity(texts: list[str], schema: dict[str, Any]) -> tuple[float, float]:
    """Return the fractions of texts that parse as JSON, and that also validate."""
    parsed = valid = 0
    for text in texts:
        try:
            obj = json.loads(text)
        except ValueError:
            continue
        parsed += 1
        try:
            jsonschema.validate(obj, schema)
            valid += 1
        except jsonschema.ValidationError:
            pass
    return parsed / len(texts), valid / len(texts)


def longest_whitespace_run(text: str) -> int:
    """Return the length of the longest run of JSON whitespace outside strings."""
    longest = run = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            in_string = escaped or ch != '"'
            escaped = not escaped and ch == "\\"
            continue
        in_string = ch == '"'
        run = run + 1 if ch in " \t\n\r" else 0
        longest = max(longest, run)
    return longest


def part_schema(engine: LLMEngine, n: int, max_tokens: int, only: str | None) -> dict[str, Any]:
    tok = engine.tokenizer
    prompts = [tok.encode_chat(person_prompt(i)) for i in range(n)]
    so = StructuredOutputsParams(json=PERSON)
    compact = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    open_so = StructuredOutputsParams(json=PERSON_OPEN)
    rows = {}
    for name, constraint, temperature in (
        ("unconstrained t=0", None, 0.0),
        ("json_schema t=0", so, 0.0),
        ("json_schema t=1.0", so, 1.0),
        ("json_schema compact t=1.0", compact, 1.0),
        ("json_schema unbounded t=1.0", open_so, 1.0),
    ):
        if only and only not in name:
            continue
        params = [
            SamplingParams(
                temperature=temperature,
                seed=i,
                max_tokens=max_tokens,
                structured_outputs=constraint,
            )
            for i in range(n)
        ]
        outs, elapsed = run(engine, prompts, params)
        print(f"{name}: {elapsed:.1f} s", file=sys.stderr, flush=True)
        schema = PERSON_OPEN if constraint is open_so else PERSON
        parsed, valid = validity([o.text for o in outs], schema)
        stopped = [o for o in outs if o.finish_reason == "stop"]
        rows[name] = {
            "parse_rate": parsed,
            "valid_rate": valid,
            "num_length_capped": sum(o.finish_reason == "length" for o in outs),
            # of the outputs the grammar ended (not cut by max_tokens), how many validate
            "stopped_valid_rate": validity([o.text for o in stopped], schema)[1]
            if stopped
            else 1.0,
            "max_whitespace_run": max(longest_whitespace_run(o.text) for o in outs),
            "mean_output_tokens": sum(len(o.token_ids) for o in outs) / n,
            "elapsed_s": elapsed,
            "example": outs[0].text,
        }
    return rows


def part_tools(engine: LLMEngine, n: int, max_tokens: int, only: str | None) -> dict[str, Any]:
    tok = engine.tokenizer
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    rows = {}
    for parallel in (False, True):
        ctx = resolve_tools(TOOLS, "required", parallel, None)
        assert ctx is not None
        prompts = []
        for i in range(n):
            conv, kwargs = render_tools(tool_prompt(i), tok.chat_template, ctx.tools)
            prompts.append(tok.encode_chat(conv, **kwargs))
        for temperature in (0.0, 1.0):
            name = f"tool_choice=required parallel_tool_calls={parallel} t={temperature}"
            if only and only not in name:
                continue
            params = [
                SamplingParams(
                    temperature=temperature,
                    seed=i,
                    max_tokens=max_tokens,
                    structured_outputs=ctx.constraint(),
                )
                for i in range(n)
            ]
            outs, elapsed = run(engine, prompts, params)
            print(f"{name}: {elapsed:.1f} s", file=sys.stderr, flush=True)
            num_valid = num_calls = 0
            for out in outs:
                _, calls = ctx.extract(out.text)  # the calls the server would return
                num_calls += len(calls)
                try:
                    for call in calls:
                        args = json.loads(call.function.arguments)
                        jsonschema.validate(args, schemas[call.function.name])
                    num_valid += bool(calls)
                except (ValueError, jsonschema.ValidationError):
                    pass
            rows[name] = {
                "valid_rate": num_valid / n,  # >= 1 call, every call's arguments validate
                "stop_rate": sum(o.finish_reason == "stop" for o in outs) / n,
                "num_length_capped": sum(o.finish_reason == "length" for o in outs),
                "mean_calls": num_calls / n,
                "mean_output_tokens": sum(len(o.token_ids) for o in outs) / n,
                "elapsed_s": elapsed,
                "example": outs[0].text,
            }
    return rows


def part_throughput(engine: LLMEngine, batch: int, max_tokens: int) -> dict[str, Any]:
    """Same batch, same prompts, greedy, same number of tokens per request (equal work).

    The constrained requests must write a list of at least 50 person records (strings, enums,
    integers), so none can end before max_tokens; the unconstrained ones ignore EOS.
    """
    tok = engine.tokenizer
    story = {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "job": {"enum": JOBS},
                "age": {"type": "integer", "minimum": 18, "maximum": 99},
            },
            "required": ["name", "job", "age"],
            "additionalProperties": False,
        },
        "minItems": 50,
    }
    prompts = [
        tok.encode_chat(
            [
                {
                    "role": "user",
                    "content": f"List people who work as {JOBS[i % 8]}s in "
                    f"{CITIES[i % 10]}, as a JSON array of objects with name, job and age.",
                }
            ]
        )
        for i in range(batch)
    ]
    rows = {}
    step_times: list[tuple[int, float]] = []
    engine.stat_loggers.append(
        lambda s: step_times.append((len(s.scheduled_req_ids), s.step_time_s))
    )
    so_stats = engine.structured_output.stats
    # warm-up: compile once and touch both paths
    run(
        engine,
        prompts[:2],
        [
            SamplingParams(
                temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(json=story)
            )
        ]
        * 2,
    )
    for name, constraint in (
        ("unconstrained", None),
        ("json_schema", StructuredOutputsParams(json=story)),
        ("unconstrained (again)", None),
    ):
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                ignore_eos=constraint is None,
                structured_outputs=constraint,
            )
            for _ in range(batch)
        ]
        step_times.clear()
        mask0 = so_stats.mask_time_s + so_stats.accept_time_s
        outs, elapsed = run(engine, prompts, params)
        full = [t for b, t in step_times if b == batch][1:]  # decode steps at the full batch
        num_tokens = sum(len(o.token_ids) for o in outs)
        rows[name] = {
            "output_tokens": num_tokens,
            "output_tokens_per_s": num_tokens / elapsed,
            "mean_full_batch_step_ms": 1000 * sum(full) / max(1, len(full)),
            "num_full_batch_steps": len(full),
            "grammar_time_s": so_stats.mask_time_s + so_stats.accept_time_s - mask0,
            "num_length_capped": sum(o.finish_reason == "length" for o in outs),
        }
    engine.stat_loggers.pop()
    return rows


def part_compile(engine: LLMEngine) -> dict[str, Any]:
    """Compile distinct schemas on a fresh manager; then the same ones again (cache hits)."""
    manager = StructuredOutputManager(engine.tokenizer, engine.vocab_size)
    t0 = time.perf_counter()
    manager._get_compiler()  # noqa: SLF001 - the one-time tokenizer-info build, timed apart
    init_s = time.perf_counter() - t0
    constraints = {
        "person schema": StructuredOutputsParams(json=PERSON),
        "tools required": resolve_tools(TOOLS, "required", True, None).constraint(),  # type: ignore[union-attr]
        "json_object": StructuredOutputsParams(json_object=True),
        "regex (date)": StructuredOutputsParams(regex=r"\d{4}-\d{2}-\d{2}"),
        "choice (3)": StructuredOutputsParams(choice=["positive", "negative", "neutral"]),
    }
    rows: dict[str, Any] = {"compiler_init_s": init_s}
    for name, so in constraints.items():
        assert so is not None
        t0 = time.perf_counter()
        manager.compile(so)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(100):
            manager.compile(so)
        hit = (time.perf_counter() - t0) / 100
        rows[name] = {"compile_ms": 1000 * cold, "cache_hit_us": 1e6 * hit}
    rows["stats"] = vars(manager.stats)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["schema", "tools", "throughput", "compile"])
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", type=str, default=None)
    parser.add_argument(
        "--only",
        type=str,
        default=None,
        help="schema / tools: only the configs whose name contains this",
    )
    add_engine_args(parser)
    ns = parser.parse_args(argv)
    engine = LLMEngine(engine_args_from(ns))
    if ns.part == "schema":
        result = part_schema(engine, ns.num_requests, ns.max_tokens, ns.only)
    elif ns.part == "tools":
        result = part_tools(engine, ns.num_requests, ns.max_tokens, ns.only)
    elif ns.part == "throughput":
        result = part_throughput(engine, ns.batch, ns.max_tokens)
    else:
        result = part_compile(engine)
    print(json.dumps(result, indent=2))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
