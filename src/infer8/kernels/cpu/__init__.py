"""The native CPU kernels: C sources (csrc/, built once per machine by build.py and loaded with
typed ctypes calls by library.py) and their Python faces by concern: the KV cache's writes and
gathers, decode and prefill attention passes (for attention/cpu/), the model's element-wise
passes, the sampler's. NativeKernels bundles them over one loaded library."""

from __future__ import annotations

from dataclasses import dataclass

from infer8.kernels.cpu.decode import DecodeKernels
from infer8.kernels.cpu.elementwise import NativeElementwise
from infer8.kernels.cpu.kv_kernels import KVKernels
from infer8.kernels.cpu.library import NativeLibrary, load_library
from infer8.kernels.cpu.prefill import PrefillKernels
from infer8.kernels.cpu.sampling import NativeSampling


@dataclass(frozen=True)
class NativeKernels:
    """Every native pass, grouped by what it works on, over one loaded library."""

    lib: NativeLibrary
    kv: KVKernels
    decode: DecodeKernels
    prefill: PrefillKernels
    elementwise: NativeElementwise
    sampling: NativeSampling

    @classmethod
    def from_library(cls, lib: NativeLibrary) -> NativeKernels:
        """Wrap a loaded library."""
        return cls(lib, KVKernels(lib), DecodeKernels(lib), PrefillKernels(lib),
                   NativeElementwise(lib), NativeSampling(lib))  # fmt: skip

    @classmethod
    def load(cls) -> NativeKernels | None:
        """Build (if needed) and load the library; None, with a warning, without a compiler."""
        lib = load_library()
        return None if lib is None else cls.from_library(lib)
