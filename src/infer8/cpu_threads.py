"""OpenMP worker threads: release the loading thread's pool before the engine thread computes.

torch's CPU ops run on OpenMP, and GNU OpenMP keeps one pool of worker threads per thread that
has opened a parallel region. The server loads the model on the main thread, then steps the
engine on its own thread, so two pools exist: more OpenMP threads than cores. libgomp then stops
spinning between parallel regions (its "throttled" wait of ~100 spins) and parks its workers in
the kernel after every region; each of the hundreds of regions of a decode step pays a wake-up.
On a 2-core machine a batch-32 decode step took 241 ms on a second thread against 158 ms on the
main thread, and 160 ms on the second thread once the main thread's pool was freed with OpenMP
5's `omp_pause_resource_all` (`python benchmarks/engine_thread.py`).
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep the settings
_OPENMP_LIBRARIES = ("libgomp", "libiomp", "libomp")


def loaded_openmp_library() -> str | None:
    """Return the path of the OpenMP runtime this process has loaded (torch's), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if os.path.basename(path).startswith(_OPENMP_LIBRARIES):
                    return path
    except OSError:  # not Linux
        return None
    return None


def release_openmp_workers() -> bool:
    """Free the calling thread's OpenMP worker threads; True if the runtime did.

    Call it on the thread that loaded the model, just before another thread takes over the
    compute. The next parallel region on this thread would start a new pool, so call it again
    if this thread computes later.
    """
    path = loaded_openmp_library()
    if path is None:
        return False
    try:
        pause = ctypes.CDLL(path).omp_pause_resource_all
    except (OSError, AttributeError):  # an OpenMP runtime older than 5.0
        return False
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    is_released = pause(_OMP_PAUSE_SOFT) == 0
    logger.debug("released this thread's OpenMP workers (%s): %s", path, is_released)
    return is_released
