"""Host memory on CPU: large blocks reused instead of mapped afresh, and a lazily mapped cache
whose pages are faulted in ahead of use without changing it."""

from __future__ import annotations

import ctypes
import json
import mmap
import subprocess
import sys
import time

import pytest
import torch

from infer8.attention.kv_cache import KVCacheSpec, _zeros, allocate_kv_cache
from infer8.host_memory import HostMemory
from infer8.worker.kv_populate import StepGate, populate_in_background, populate_kv_cache

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


def _resident_pages(t: torch.Tensor) -> int:
    """Return how many pages of t's (page-aligned) memory are resident (mincore)."""
    libc = ctypes.CDLL(None)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    pages = -(-t.numel() * t.element_size() // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    assert t.data_ptr() % mmap.PAGESIZE == 0
    assert libc.mincore(t.data_ptr(), pages * mmap.PAGESIZE, vec) == 0
    return sum(v & 1 for v in vec)


def _anonymous_bytes(t: torch.Tensor) -> tuple[int, int]:
    """Return the private memory committed to the mapping that holds t (its VMA in
    /proc/self/smaps: not the process's RSS, which other threads' allocations move) and the
    bytes of that mapping beyond t's (the kernel may merge it with a neighbouring one)."""
    at, inside, size = t.data_ptr(), False, 0
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside, size = lo <= at < hi, hi - lo
        elif inside and head == "Anonymous:":
            extra = max(size - t.numel() * t.element_size(), 0)
            return int(line.split()[1]) * 1024, extra
    raise AssertionError("no mapping holds the tensor")


def test_cpu_cache_tensors_are_zero_and_mapped_on_first_write() -> None:
    t = _zeros((2, 4096, 16, 64), torch.float32, torch.device("cpu"))  # 32 MB
    start, neighbour = _anonymous_bytes(t)
    assert start < (1 << 20) + neighbour  # nothing of t's committed yet
    assert t.shape == (2, 4096, 16, 64) and not t.any()
    assert _anonymous_bytes(t)[0] - start < (1 << 20)  # read as zeros: still nothing
    t[0, :2048] = 1.0  # half of one layer's K: half of the first of two
    grown = _anonymous_bytes(t)[0] - start
    assert (7 << 20) < grown < (9 << 20), grown
    view = t[0]
    del t
    assert view.sum().item() == 2048 * 16 * 64  # the mapping lives as long as a view does


@pytest.mark.parametrize("background", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_populate_maps_the_whole_cache_and_keeps_what_it_holds(
    dtype: torch.dtype, background: bool
) -> None:
    """MADV_POPULATE_WRITE faults every page of K, V (and FP8 scales) in; written slots keep
    their values, the rest stay zero. Background: the same from the low-priority thread."""
    cpu = torch.device("cpu")
    spec = KVCacheSpec(3, 2, 64, 16, dtype)
    caches = allocate_kv_cache(spec, 1000, cpu)  # 3 layers x 2 x 2 MB (bf16) + scales
    caches[1].v[1, 700, 3] = 1.5
    caches[2].k[0, 999, 15] = -2.0
    if caches[0].k_scale is not None:
        caches[0].k_scale[1, 5, 3] = 0.25
    tensors = [t for c in caches for t in (c.k, c.v, c.k_scale, c.v_scale) if t is not None]
    assert max(_resident_pages(t) for t in tensors) <= 1  # a written slot's page at most
    if background:
        thread = populate_in_background(caches)
        assert thread is not None
        thread.join(timeout=60)
        assert not thread.is_alive()
    else:
        assert populate_kv_cache(caches, HostMemory())
    for t in tensors:
        assert _resident_pages(t) == -(-t.numel() * t.element_size() // mmap.PAGESIZE)
    assert caches[1].v[1, 700, 3].float().eq(1.5).all()
    assert caches[2].k[0, 999, 15].float().eq(-2.0).all()
    assert caches[1].v.float().abs().sum() == 1.5 * 64 and caches[2].k.float().abs().sum() == 2 * 64
    assert not caches[0].k.float().any() and not caches[2].v.float().any()
    if caches[0].k_scale is not None:
        assert caches[0].k_scale.float().sum() == 0.25 and not caches[0].v_scale.float().any()


def test_background_populate_waits_while_steps_run() -> None:
    """While a step runs (however long) and until the gate's idle time after the last one, the
    thread faults nothing in; once the steps stop it maps the whole cache."""
    cpu = torch.device("cpu")
    caches = allocate_kv_cache(KVCacheSpec(2, 2, 64, 16, torch.bfloat16), 1000, cpu)
    tensors = [t for c in caches for t in (c.k, c.v)]
    gate = StepGate(idle_s=0.2)
    with gate.step():  # one long step: longer than the idle time
        thread = populate_in_background(caches, gate)
        assert thread is not None
        time.sleep(0.5)
    until = time.monotonic() + 0.5
    while time.monotonic() < until:  # then short steps 20 ms apart
        with gate.step():
            time.sleep(0.01)
        time.sleep(0.02)
    assert thread.is_alive()
    assert sum(_resident_pages(t) for t in tensors) == 0
    thread.join(timeout=60)
    assert not thread.is_alive()
    for t in tensors:
        assert _resident_pages(t) == -(-t.numel() * t.element_size() // mmap.PAGESIZE)


_EXIT_WHILE_POPULATING = """
import torch
from infer8.attention.kv_cache import KVCacheSpec, allocate_kv_cache
from infer8.worker.kv_populate import populate_in_background
caches = allocate_kv_cache(KVCacheSpec(30, 3, 64, 16, torch.bfloat16), 2048, torch.device("cpu"))
thread = populate_in_background(caches)  # ~0.7 GB: still running at exit
caches[0].k[0, 0] = 1.0
print(thread.is_alive())
"""


def test_the_process_exits_cleanly_while_the_cache_is_populated() -> None:
    """At interpreter exit the thread is stopped and joined (it died with torch's thread pools
    torn down under it: `terminate called without an active exception`, now and then)."""
    for _ in range(3):
        run = subprocess.run(
            [sys.executable, "-c", _EXIT_WHILE_POPULATING],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.strip() == "True"  # it was populating when the script ended
