"""Keep the server's resident memory flat: bound glibc's arenas and hand freed pages back.

Under mixed load the process allocates tensors and token buffers of many sizes from several
threads. glibc keeps what is freed in per-thread arenas (and raises its mmap threshold after
each large free), so RSS climbs to the high-water mark of every size ever seen. Two arenas and
a periodic `malloc_trim(0)` between engine steps give those pages back without touching the hot
path. Elsewhere than glibc both calls are no-ops.

It also reads how much RAM is available (the kernel's MemAvailable, bounded by the cgroup's
limit in a container), so that the host KV tier of --kv-offloading-size is refused at start-up
when it cannot fit beside the model.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
from pathlib import Path

logger = logging.getLogger(__name__)

_M_ARENA_MAX = -8  # mallopt parameter numbers in glibc's malloc.h
_M_MMAP_MAX = -4
_M_TRIM_THRESHOLD = -1
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14 (asm-generic/mman-common.h)
GiB = 1 << 30
_CGROUP = Path("/sys/fs/cgroup")  # cgroup v2: memory.max and memory.current


class HostMemory:
    """Owns the handle on the C library's allocator (glibc only)."""

    def __init__(self) -> None:
        self._libc: ctypes.CDLL | None = None
        name = ctypes.util.find_library("c")
        if name is None:
            return
        try:
            libc = ctypes.CDLL(name)
            libc.malloc_trim  # noqa: B018 - probe: glibc has it, musl and macOS do not
            libc.mallopt  # noqa: B018
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            return
        self._libc = libc
        self._page = mmap.PAGESIZE

    @property
    def is_available(self) -> bool:
        """Return whether the allocator can be tuned here (glibc)."""
        return self._libc is not None

    def limit_arenas(self, max_arenas: int = 2) -> None:
        """Cap glibc's malloc arenas for threads started from now on."""
        if self._libc is not None and not self._libc.mallopt(_M_ARENA_MAX, max_arenas):
            logger.warning("mallopt(M_ARENA_MAX, %d) failed", max_arenas)

    def reuse_large_blocks(self, trim_threshold: int = 1 << 30) -> None:
        """Serve large allocations from the heap, where freed blocks are reused, not from
        mmap (glibc maps every block of >= 32 MB afresh and unmaps it on free).

        A prefill step's activations are such blocks (a [4,096, 3,072] float32 product is
        50 MB), so each step faulted in and zeroed ~2.3 GB of new pages: 565 K minor faults and
        2.7 s of system CPU in a 10.3 s step of 2 x 2,048 tokens, against 4 K faults and 0.6 s
        from the heap (a `/tmp` run with glibc's MALLOC_MMAP_MAX_=0; benchmarks.md). `trim`
        still hands freed pages back, between steps. A freed block is reused when a later
        request fits it; an aligned request of the same size sometimes does not (one 64 MB
        tensor filled, freed and filled again faulted in again in about half the fresh runs),
        and the heap grows instead.
        """
        if self._libc is None:
            return
        if not (
            self._libc.mallopt(_M_MMAP_MAX, 0)
            and self._libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold)
        ):
            logger.warning("mallopt(M_MMAP_MAX / M_TRIM_THRESHOLD) failed")

    def trim(self) -> bool:
        """Return freed heap pages to the OS; True if any were released."""
        return bool(self._libc is not None and self._libc.malloc_trim(0))

    def populate(self, address: int, nbytes: int) -> bool:
        """Fault in the pages of [address, address + nbytes) of an anonymous mapping as a write
        would, without changing what they hold (MADV_POPULATE_WRITE, Linux >= 5.14; the range
        widened to whole pages). The GIL is released meanwhile. False where it is unavailable."""
        if self._libc is None or nbytes <= 0:
            return False
        start = address - address % self._page
        end = address + nbytes
        end += -end % self._page
        return self._libc.madvise(start, end - start, _MADV_POPULATE_WRITE) == 0


def available_ram_bytes(meminfo: str | None = None, cgroup: Path = _CGROUP) -> int | None:
    """Return the RAM this process can still take: MemAvailable (free plus reclaimable page
    cache), no more than the cgroup's limit leaves; None where neither can be read."""
    available: int | None = None
    if meminfo is None:
        try:
            meminfo = Path("/proc/meminfo").read_text()
        except OSError:
            meminfo = ""
    for line in meminfo.splitlines():
        key, _, value = line.partition(":")
        if key == "MemAvailable" and value.split() and value.split()[0].isdigit():
            available = int(value.split()[0]) * 1024  # kB
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit.isdigit():
            used = int((cgroup / "memory.current").read_text().strip())
            left = max(0, int(limit) - used)
            available = left if available is None else min(available, left)
    except (OSError, ValueError):
        pass
    return available


def check_host_tier(
    size_gib: float, model_ram_bytes: int, available_bytes: int | None = None
) -> None:
    """Refuse a host KV tier of `size_gib` GiB that RAM cannot hold beside the model's
    `model_ram_bytes` (weights, activations and KV cache when they live in RAM)."""
    if available_bytes is None:
        available_bytes = available_ram_bytes()
    if available_bytes is None or not size_gib:
        return
    room = available_bytes - model_ram_bytes
    if size_gib * GiB >= room:
        shown = f"{size_gib:.0f}" if size_gib == int(size_gib) else f"{size_gib:g}"
        raise ValueError(
            f"--kv-offloading-size {shown} GiB does not fit in RAM: "
            f"{available_bytes / GiB:.2f} GiB available, of which the model needs "
            f"{model_ram_bytes / GiB:.2f} GiB, leaving {max(0, room) / GiB:.2f} GiB for the tier"
        )
