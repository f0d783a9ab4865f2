"""Host memory on CPU: large blocks reused instead of mapped afresh, and a lazily mapped cache."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from infer8.host_memory import HostMemory
from infer8.worker.kv_cache import _zeros

# A fresh interpreter (mallopt is process-wide): minor faults of filling a 64 MB tensor, a
# second time after freeing the first, with glibc's defaults or after reuse_large_blocks().
_FAULTS = """
import json, resource, sys
import torch
from infer8.host_memory import HostMemory
if sys.argv[1] == "reuse":
    HostMemory().reuse_large_blocks()
def fill():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(16 << 20)  # 64 MB: above glibc's largest mmap threshold (32 MB)
    t.fill_(1.0)
    del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
fill()
print(json.dumps(fill()))
"""


def _second_fill_faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not HostMemory().is_available, reason="glibc's allocator only")
def test_large_blocks_are_reused_not_faulted_in_again() -> None:
    pages = (64 << 20) // 4096
    assert _second_fill_faults("default") > pages // 2  # mapped afresh: every page faults
    assert _second_fill_faults("reuse") < pages // 20  # the freed block, already resident


def test_cpu_cache_tensors_are_zero_and_mapped_on_first_write() -> None:
    def rss() -> int:
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no RssAnon")

    before = rss()
    t = _zeros((2, 4096, 16, 64), torch.float32, torch.device("cpu"))  # 32 MB
    assert rss() - before < (4 << 20)  # nothing committed yet
    assert t.shape == (2, 4096, 16, 64) and not t.any()
    t[0, :2048] = 1.0  # half of one layer's K: half of the first of two
    grown = rss() - before
    assert (6 << 20) < grown < (12 << 20), grown
    view = t[0]
    del t
    assert view.sum().item() == 2048 * 16 * 64  # the mapping lives as long as a view does
