"""What a compiled kernel asks of the GPU, read from its cubin with the cuobjdump that ships with
Triton: registers and stack per thread, and the instructions of its main loop (SASS)."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass


def _cuobjdump(cubin: bytes, *flags: str) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *flags, f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """Return (registers, stack bytes) per thread of the cubin's kernel."""
    usage = _cuobjdump(cubin, "--dump-resource-usage")
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    assert m, usage
    return int(m.group(1)), int(m.group(2))


@dataclass(frozen=True)
class Loop:
    """One loop of a kernel's SASS: its instructions, by opcode."""

    opcodes: collections.Counter[str]

    @property
    def instructions(self) -> int:
        """Return the instructions one warp issues per iteration."""
        return sum(self.opcodes.values())

    @property
    def sync_global_loads(self) -> int:
        """Return the loads from global memory into registers (LDG: the warp waits for the data
        before using it); asynchronous copies into shared memory are LDGSTS."""
        return sum(n for op, n in self.opcodes.items() if op.startswith("LDG."))

    @property
    def async_copies(self) -> int:
        """Return the asynchronous global-to-shared copies (cp.async)."""
        return sum(n for op, n in self.opcodes.items() if op.startswith("LDGSTS"))


def loops(cubin: bytes) -> list[Loop]:
    """Return the kernel's loops (a backward branch and what it jumps over), largest first.

    Instructions predicated never to run (`@!PT`, `@!UPT`: the scheduler's fillers) are not
    counted.
    """
    code = []
    for line in _cuobjdump(cubin, "-sass").splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            code.append((int(m.group(1), 16), m.group(2).split()))
    found = []
    for addr, words in code:
        if words[0].startswith("@"):
            words = words[1:]
        if not words[0].startswith("BRA") or len(words) < 2 or not words[1].startswith("0x"):
            continue
        target = int(words[1], 16)
        if target < addr:
            body = [w for a, w in code if target <= a <= addr and w[0] not in ("@!PT", "@!UPT")]
            ops = collections.Counter(w[1] if w[0].startswith("@") else w[0] for w in body)
            found.append(Loop(ops))
    return sorted(found, key=lambda loop: -loop.instructions)
