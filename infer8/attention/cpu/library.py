"""The compiled CPU kernels (csrc/*.c) loaded with ctypes, every function's argument and result
types declared: a call with a wrong argument count or type raises instead of reading garbage.

Eager FP8 casts run at ~0.7 G elements/s on these CPUs and torch.compile's at ~8; plain C loops,
vectorized by the compiler, are several times faster and skip the FP8 gather buffer. The library
is built once per machine (build.py); without a C compiler the registry picks the reference
backend instead.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

from infer8.attention.cpu.build import build_library

logger = logging.getLogger(__name__)

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float

# Each function's arguments in order, as csrc declares them (all return void).
_SIGNATURES: dict[str, tuple[type, ...]] = {
    "gather_dequant_fp8": (_P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I32, _P, _P, _I32),
    "gather_blocks": (_P, _P, _I64, _I64, _I64, _I64, _P),
    "tail_residual": (_P, _I64, _I64, _I32, _I32, _F32, _F32, _P, _P, _P),
    "write_store": (_P, _P, _P, _P, _I64, _I64, _I64, _I64, _P, _P),
    "write_rows": (_P, _I64, _I64, _I64, _I64, _I32, _P, _I64, _P, _I32),
    "write_fp8": (_P, _I64, _I64, _I64, _I32, _I32, _F32, _P, _I64, _P, _P),
    "decode_attention": (
        _P, _P, _P, _P, _P, _I32, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _I32,
        _P, _P, _P, _P, _P, _I64, _I64, _P, _P, _I64, _P,
    ),
    "decode_layer": (
        _P, _I64, _P, _P, _I64, _P, _P, _P, _P, _P, _I32, _P, _I64, _P, _I64, _I64, _I64, _I64,
        _I64, _I64, _F32, _I32, _I32, _I32, _F32, _P, _P, _P, _I64, _I64, _P, _P, _I64, _F32,
        _P, _P, _I64, _P, _P, _I64, _P,
    ),
    "hadamard_rows": (_P, _I64, _I64, _I64, _I64, _I64, _I32, _P),
    "prefill_tail": (
        _P, _I64, _P, _I64, _I64, _I64, _I64, _I32, _I32, _I32, _I32, _F32, _F32, _P, _I64, _P,
        _P, _P, _P, _P, _P, _P, _P,
    ),
    "rms_norm": (_P, _I64, _P, _P, _I64, _I64, _F32, _I32, _P),
    "silu_and_mul": (_P, _I64, _I64, _I32, _P),
    "greedy_rows": (_P, _I64, _I64, _F32, _P),
    "nucleus_candidates": (_P, _I64, _I64, _P, _P, _I64, _P, _P, _P, _P),
    "rope": (_P, _I64, _I64, _I64, _I64, _P, _P, _I32),
    "band_attention": (_P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _I32, _P, _P),
    "two_value_attention": (
        _P, _I64, _I64, _P, _I64, _P, _I64, _P, _I64, _P, _I64, _I64, _I64, _P, _I64, _I64, _I64,
        _I64, _I64, _I64, _F32, _I32, _P, _I64, _I64, _I32, _I32,
    ),
    "two_value_prompts": (
        _P, _I64, _I64, _P, _I64, _P, _I64, _P, _I64, _P, _I64, _I64, _I64, _P, _I64, _P, _P,
        _I64, _I64, _I64, _F32, _I32, _P, _I64, _I64, _I32, _I32,
    ),
}  # fmt: skip


class NativeLibrary:
    """The loaded kernels: one typed ctypes function per entry of _SIGNATURES, by that name."""

    def __init__(self, lib_path: Path) -> None:
        lib = ctypes.CDLL(str(lib_path))
        self.path = lib_path
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, f"infer8_{name}")
            fn.argtypes, fn.restype = list(argtypes), None
            setattr(self, name, fn)

    def __getattr__(self, name: str) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
        raise AttributeError(f"the native library has no function {name!r}")


def load_library() -> NativeLibrary | None:
    """Build (if needed) and load the kernels; None, with a warning, if that fails."""
    try:
        return NativeLibrary(build_library())
    except (OSError, RuntimeError) as e:
        logger.warning(
            "native CPU kernels unavailable (%s); attention runs in the torch reference, the "
            "element-wise passes and the sampler in torch",
            e,
        )
        return None
