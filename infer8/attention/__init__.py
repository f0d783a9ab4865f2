"""Attention backends, chosen once at start-up by `select_backend` (see backend.py)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from infer8.attention.backend import AttentionBackend
    from infer8.worker.kv_cache import KVCacheSpec

logger = logging.getLogger(__name__)

# Triton's float8e4nv (E4M3) needs Ada or Hopper; E5M2 and 16-bit caches run on Ampere too.
MIN_CAPABILITY_FP8_E4M3 = (8, 9)
MIN_CAPABILITY_TRITON = (8, 0)


def select_backend(
    device: torch.device,
    kv_spec: KVCacheSpec,
    enforce_eager: bool = False,
    capability: tuple[int, int] | None = None,
) -> AttentionBackend:
    """Return the attention backend for this device and cache, or refuse with one clear line.

    - CPU: the torch reference with the native C gather (FP8 dequantized in one pass), else
      torch.compile'd dequantization where no C compiler is present.
    - CUDA: the Triton paged kernels; a cache with an exact tail or rotated keys uses the
      reference backend on the GPU (the kernels read no tail yet); logged once.
    Raises ValueError for a combination no backend runs (an E4M3 cache before sm_89).
    """
    from infer8.attention.torch_ref import TorchRefAttention

    if device.type != "cuda":
        return TorchRefAttention(use_compile=kv_spec.is_fp8 and not enforce_eager, use_native=True)
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    name = f"sm_{capability[0]}{capability[1]}"
    if capability < MIN_CAPABILITY_TRITON:
        raise ValueError(
            f"this GPU ({name}) is older than Ampere (sm_80); infer8's CUDA kernels need sm_80+"
        )
    if kv_spec.dtype == torch.float8_e4m3fn and capability < MIN_CAPABILITY_FP8_E4M3:
        raise ValueError(
            f"--kv-cache-dtype fp8_e4m3 needs FP8 support (sm_89+, Ada or Hopper); this GPU is "
            f"{name}: use --kv-cache-dtype fp8_e5m2 (same capacity) or auto"
        )
    if kv_spec.exact_tail_tokens > 0 or kv_spec.hadamard:
        logger.warning(
            "FP8 exact tail / rotated keys: the Triton kernels read no tail yet; using the "
            "reference attention on CUDA (--kv-cache-exact-tail-tokens 0 for the kernels)"
        )
        return TorchRefAttention(use_compile=not enforce_eager)
    from infer8.attention.triton_paged import TritonAttention

    return TritonAttention(device)
