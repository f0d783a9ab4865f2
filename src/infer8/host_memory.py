"""Keep the server's resident memory flat: bound glibc's arenas and hand freed pages back.

Under mixed load the process allocates tensors and token buffers of many sizes from several
threads. glibc keeps what is freed in per-thread arenas (and raises its mmap threshold after
each large free), so RSS climbs to the high-water mark of every size ever seen. Two arenas and
a periodic `malloc_trim(0)` between engine steps give those pages back without touching the hot
path. Elsewhere than glibc both calls are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap

logger = logging.getLogger(__name__)

_M_ARENA_MAX = -8  # mallopt parameter numbers in glibc's malloc.h
_M_MMAP_MAX = -4
_M_TRIM_THRESHOLD = -1
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14 (asm-generic/mman-common.h)


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
