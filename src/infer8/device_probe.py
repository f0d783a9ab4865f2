"""What this device's attention kernels can run: compute capability, ROCm architecture, whether
the FP8 exact tail's kernels exist (no infer8 imports: config.py asks it when resolving flags,
attention/ when picking a backend)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Triton's float8e4nv (E4M3) needs Ada or Hopper; E5M2 and 16-bit caches run on Ampere too.
MIN_CAPABILITY_FP8_E4M3 = (8, 9)
MIN_CAPABILITY_TRITON = (8, 0)
# ROCm GPUs whose FP8 is only the fnuz variant (float8_e4m3fnuz / e5m2fnuz: no negative zero,
# another bias), which infer8's kernels and scales do not read: MI300A/X (gfx942) and its
# predecessors. They report capability (9, 4), so the checks above would let them through.
FNUZ_ONLY_ARCHS = ("gfx940", "gfx941", "gfx942")


def device_arch(device: torch.device) -> str:
    """Return a ROCm device's gfx architecture ("gfx942:sramecc+:xnack-"), "" elsewhere."""
    import torch

    if device.type != "cuda" or torch.version.hip is None:
        return ""
    return str(getattr(torch.cuda.get_device_properties(device), "gcnArchName", ""))


def tail_kernels_available(device: torch.device, capability: tuple[int, int] | None = None) -> bool:
    """Return whether this device's attention reads an FP8 exact tail and rotated keys.

    The CPU backend does; the Triton kernels do where E4M3 runs (the residuals are E4M3).
    """
    import torch

    if device.type != "cuda":
        return True
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    return capability >= MIN_CAPABILITY_FP8_E4M3
