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
import re
from pathlib import Path

from infer8.kernels.cpu.build import build_library

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
    "hadamard_rows": (_P, _I64, _I64, _I64, _I64, _I64, _I32, _P),
    "rms_norm": (_P, _I64, _P, _P, _I64, _I64, _F32, _I32, _P),
    "silu_and_mul": (_P, _I64, _I64, _I32, _P),
    "greedy_rows": (_P, _I64, _I64, _F32, _P),
    "nucleus_candidates": (_P, _I64, _I64, _P, _P, _I64, _P, _P, _P, _P),
    "rope": (_P, _I64, _I64, _I64, _I64, _P, _P, _I32),
    "lora_add": (
        _P, _I64, _P, _I64, _P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _P, _I32,
    ),
    "band_attention": (
        _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _I32,
        _P, _P,
    ),
}  # fmt: skip
# The functions with long argument lists take one struct, whose fields csrc/args.h lists once
# (`#define INFER8_<NAME>_FIELDS(X)` of `X(type, name)` lines): read from there.
_ARGS_HEADER = Path(__file__).with_name("csrc") / "args.h"


def _ctype(c_type: str) -> type:
    """Return the ctypes type of an args.h field type (every pointer is a void pointer)."""
    if "*" in c_type:
        return _P
    return {"int64_t": _I64, "int": _I32, "float": _F32}[c_type.strip()]


def read_struct_fields(header: str) -> dict[str, tuple[tuple[str, type], ...]]:
    """Return each struct-argument function's (field, ctypes type) list from args.h's text."""
    structs: dict[str, tuple[tuple[str, type], ...]] = {}
    for m in re.finditer(r"#define INFER8_(\w+)_FIELDS\(X\)((?:\s*\\\n\s*X\(.*?\))+)", header):
        fields = re.findall(r"X\(([^,]+),\s*(\w+)\)", m.group(2))
        structs[m.group(1).lower()] = tuple((name, _ctype(c_type)) for c_type, name in fields)
    return structs


_STRUCTS = read_struct_fields(_ARGS_HEADER.read_text())


def _structure(name: str, fields: tuple[tuple[str, type], ...]) -> type[ctypes.Structure]:
    return type(f"{name}_args", (ctypes.Structure,), {"_fields_": list(fields)})


class NativeLibrary:
    """The loaded kernels: one typed ctypes function per entry of _SIGNATURES, by that name;
    the struct-argument functions of _STRUCTS through `call`, by field name."""

    def __init__(self, lib_path: Path) -> None:
        lib = ctypes.CDLL(str(lib_path))
        self.path = lib_path
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, f"infer8_{name}")
            fn.argtypes, fn.restype = list(argtypes), None
            setattr(self, name, fn)
        self.structs: dict[str, type[ctypes.Structure]] = {}
        self._struct_fns: dict[str, ctypes._CFuncPtr] = {}  # type: ignore[name-defined]
        for name, fields in _STRUCTS.items():
            struct = self.structs[name] = _structure(name, fields)
            fn = getattr(lib, f"infer8_{name}_struct")
            fn.argtypes, fn.restype = [ctypes.POINTER(struct)], None
            self._struct_fns[name] = fn
        self._layout = lib.infer8_args_layout
        self._layout.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int64), _I64]
        self._layout.restype = _I64

    def call(self, name: str, **fields: object) -> None:
        """Call the struct-argument function `name` with every one of its fields by name.

        A missing or unknown field raises TypeError before anything runs (a positional slip
        would pass a value into the wrong parameter)."""
        struct = self.structs[name]
        expected = {field for field, _ in struct._fields_}
        if fields.keys() != expected:
            missing, extra = sorted(expected - fields.keys()), sorted(fields.keys() - expected)
            raise TypeError(f"infer8_{name}: missing fields {missing}, unknown fields {extra}")
        self._struct_fns[name](ctypes.byref(struct(**fields)))

    def layout(self, name: str) -> tuple[list[int], int]:
        """Return the C struct's field offsets and size (what the Structure must match)."""
        out = (ctypes.c_int64 * 128)()
        count = self._layout(name.encode(), out, 128)
        if count < 0:
            raise KeyError(name)
        return list(out[:count]), out[count]

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
