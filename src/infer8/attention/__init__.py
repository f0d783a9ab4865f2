"""Attention over the paged KV cache: the cache (kv_cache.py), the backend protocol
(backend.py), the backends (reference.py; cpu/ over the native kernels; triton/ on CUDA), and
the registry that picks one at start-up (select_backend, below)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from infer8.attention.backend import AttentionBackend
    from infer8.attention.kv_cache import KVCacheSpec
    from infer8.kernels.cpu import NativeKernels

from infer8.device_probe import (
    FNUZ_ONLY_ARCHS,
    MIN_CAPABILITY_FP8_E4M3,
    MIN_CAPABILITY_TRITON,
    device_arch,
    tail_kernels_available,
)

logger = logging.getLogger(__name__)


def select_backend(
    device: torch.device,
    kv_spec: KVCacheSpec,
    native: NativeKernels | None = None,
    capability: tuple[int, int] | None = None,
    arch: str | None = None,
) -> AttentionBackend:
    """Return the attention backend for this device and cache, or refuse with one clear line.

    - CPU: the native backend (cpu/) where the kernels loaded (`native`) and it runs the
      cache's format (not static scales), else the reference.
    - CUDA: the Triton kernels, exact tail and rotated keys included; before sm_89 (no E4M3 for
      the tail's residuals) a cache with a tail or rotated keys uses the reference, logged once.
    Raises ValueError for a combination no backend runs (an E4M3 cache before sm_89, an FP8
    cache on a ROCm GPU with only fnuz FP8). `capability` and `arch` (ROCm's gfx name) are
    read from the device when not given.
    """
    import torch

    from infer8.attention.reference import ReferenceAttention

    fmt = kv_spec.format
    if device.type != "cuda":
        from infer8.attention.cpu.backend import CpuAttention

        if native is not None and CpuAttention.supports(fmt, kv_spec.head_dim):
            return CpuAttention(native)
        logger.info("attention: the torch reference (%s)", "no native kernels" if native is None
                    else f"the native backend does not run {fmt}")  # fmt: skip
        return ReferenceAttention()
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    name = f"sm_{capability[0]}{capability[1]}"
    if arch is None:
        arch = device_arch(device)
    if fmt.is_fp8 and arch.split(":")[0] in FNUZ_ONLY_ARCHS:
        raise ValueError(
            f"--kv-cache-dtype {'fp8_e4m3' if fmt.dtype == torch.float8_e4m3fn else 'fp8_e5m2'}"
            f" needs OCP FP8 (float8_e4m3fn / float8_e5m2); this GPU ({arch.split(':')[0]}, "
            f"MI300-class) has only float8_e4m3fnuz, which infer8's kernels do not read: use "
            f"--kv-cache-dtype auto"
        )
    if capability < MIN_CAPABILITY_TRITON:
        raise ValueError(
            f"this GPU ({name}) is older than Ampere (sm_80); infer8's CUDA kernels need sm_80+"
        )
    if fmt.dtype == torch.float8_e4m3fn and capability < MIN_CAPABILITY_FP8_E4M3:
        raise ValueError(
            f"--kv-cache-dtype fp8_e4m3 needs FP8 support (sm_89+, Ada or Hopper); this GPU is "
            f"{name}: use --kv-cache-dtype fp8_e5m2 (same capacity) or auto"
        )
    if (fmt.has_tail or fmt.hadamard) and not tail_kernels_available(device, capability):
        logger.warning(
            "FP8 exact tail / rotated keys on %s: the Triton kernels need E4M3 (sm_89+) for "
            "the tail; using the reference attention (--kv-cache-exact-tail-tokens 0 and "
            "--no-kv-cache-hadamard for the kernels)",
            name,
        )
        return ReferenceAttention()
    from infer8.attention.triton.backend import TritonAttention

    return TritonAttention(device)
