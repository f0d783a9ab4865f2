"""The CPU backend: the native kernels (csrc/, built once per machine by build.py and loaded
with typed ctypes calls by library.py), their Python wrappers by concern, and the attention
backend over them (backend.py). The registry (attention/__init__.py) chooses it; the model sees
only the backend protocol and the element-wise ops it is handed."""

from __future__ import annotations

from dataclasses import dataclass

from infer8.attention.cpu.decode import DecodeKernels
from infer8.attention.cpu.elementwise import NativeElementwise
from infer8.attention.cpu.kv_kernels import KVKernels
from infer8.attention.cpu.library import NativeLibrary, load_library
from infer8.attention.cpu.prefill import PrefillKernels
from infer8.attention.cpu.sampling import NativeSampling


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
