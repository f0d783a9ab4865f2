"""Host memory on CPU: large blocks reused instead of mapped afresh, and a lazily mapped cache."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from infer8.host_memory import HostMemory
from infer8.worker.kv_cache import _zeros

# A fresh interpreter (mallopt is process-wide): is a 64 MB tensor inside the process heap
# ([heap] in /proc/self/maps, where freed blocks are kept for reuse) or a mapping of its own
# (made for it and unmapped when it is freed), with glibc's defaults or after
# reuse_large_blocks()?
_IN_HEAP = """
import json, sys
import torch
from infer8.host_memory import HostMemory
if sys.argv[1] == "reuse":
    HostMemory().reuse_large_blocks()
t = torch.empty(16 << 20)  # 64 MB: above glibc's largest mmap threshold (32 MB)
heap = [line.split()[0].split("-") for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]")]
lo, hi = (int(x, 16) for x in heap[0]) if heap else (0, 0)
print(json.dumps(lo <= t.data_ptr() < hi))
"""


def _in_heap(mode: str) -> bool:
    out = subprocess.run(
        [sys.executable, "-c", _IN_HEAP, mode], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not HostMemory().is_available, reason="glibc's allocator only")
def test_large_blocks_come_from_the_heap() -> None:
    """The mechanism behind 565 K -> 46-83 K minor faults per prefill step (benchmarks.md):
    the measured reuse depends on how a run's blocks fit, so the test checks where they live."""
    assert not _in_heap("default")
    assert _in_heap("reuse")


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
