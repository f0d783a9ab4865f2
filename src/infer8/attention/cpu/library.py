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
    "hadamard_rows": (_P, _I64, _I64, _I64, _I64, _I64, _I32, _P),
    "rms_norm": (_P, _I64, _P, _P, _I64, _I64, _F32, _I32, _P),
    "silu_and_mul": (_P, _I64, _I64, _I32, _P),
    "greedy_rows": (_P, _I64, _I64, _F32, _P),
    "nucleus_candidates": (_P, _I64, _I64, _P, _P, _I64, _P, _P, _P, _P),
    "rope": (_P, _I64, _I64, _I64, _I64, _P, _P, _I32),
    "band_attention": (
        _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _I32, _P,
        _P,
    ),
}  # fmt: skip
# The functions with long argument lists take one struct (csrc/args.h), fields in its order.
_STRUCTS: dict[str, tuple[tuple[str, type], ...]] = {
    "decode_attention": (
        ("q", _P), ("k_cache", _P), ("v_cache", _P), ("k_scale", _P), ("v_scale", _P),
        ("kind", _I32), ("table", _P), ("table_stride", _I64), ("seq_lens", _P), ("batch", _I64),
        ("num_kv_heads", _I64), ("group", _I64), ("num_blocks", _I64), ("block_size", _I64),
        ("d", _I64), ("sm_scale", _F32), ("x_f32", _I32), ("new_k", _P), ("new_v", _P),
        ("store", _P), ("store_scale", _P), ("read_rows", _P), ("seats", _I64), ("stride", _I64),
        ("pos", _P), ("valid", _P), ("width", _I64), ("out", _P),
    ),
    "decode_layer": (
        ("q", _P), ("q_stride", _I64), ("k", _P), ("v", _P), ("kv_stride", _I64),
        ("slot_mapping", _P), ("k_cache", _P), ("v_cache", _P), ("k_scale", _P), ("v_scale", _P),
        ("kind", _I32), ("table", _P), ("table_stride", _I64), ("seq_lens", _P), ("batch", _I64),
        ("num_kv_heads", _I64), ("group", _I64), ("num_blocks", _I64), ("block_size", _I64),
        ("d", _I64), ("sm_scale", _F32), ("x_f32", _I32), ("rotate_keys", _I32),
        ("rotate_values", _I32), ("cache_per_amax", _F32), ("store", _P), ("store_scale", _P),
        ("read_rows", _P), ("seats", _I64), ("stride", _I64), ("pos", _P), ("valid", _P),
        ("width", _I64), ("e4m3_per_amax", _F32), ("sink_ids", _P), ("sink_slots", _P),
        ("num_sinks", _I64), ("ring_ids", _P), ("ring_slots", _P), ("num_rings", _I64),
        ("out", _P),
    ),
    "prefill_tail": (
        ("k", _P), ("k_stride", _I64), ("v", _P), ("v_stride", _I64), ("n", _I64), ("kvh", _I64),
        ("d", _I64), ("x_f32", _I32), ("rotate_keys", _I32), ("rotate_values", _I32),
        ("block_is_e5m2", _I32), ("block_per_amax", _F32), ("e4m3_per_amax", _F32),
        ("slot_mapping", _P), ("num_slots", _I64), ("k_cache", _P), ("k_scale", _P),
        ("v_cache", _P), ("v_scale", _P), ("res_q", _P), ("res_scale", _P), ("tail", _P),
        ("block", _P),
    ),
    "two_value_attention": (
        ("q", _P), ("q_tok", _I64), ("q_head", _I64), ("k1", _P), ("k1_head", _I64), ("k2", _P),
        ("k2_head", _I64), ("v1", _P), ("v1_head", _I64), ("v2", _P), ("v2_head", _I64),
        ("k_row", _I64), ("v_row", _I64), ("second", _P), ("num_heads", _I64),
        ("num_kv_heads", _I64), ("q_len", _I64), ("n", _I64), ("d", _I64), ("q_start", _I64),
        ("scale", _F32), ("bf16", _I32), ("out", _P), ("o_tok", _I64), ("o_head", _I64),
        ("rotate_q", _I32), ("rotate_out", _I32),
    ),
    "two_value_prompts": (
        ("q", _P), ("q_tok", _I64), ("q_head", _I64), ("k1", _P), ("k1_head", _I64), ("k2", _P),
        ("k2_head", _I64), ("v1", _P), ("v1_head", _I64), ("v2", _P), ("v2_head", _I64),
        ("k_row", _I64), ("v_row", _I64), ("seconds", _P), ("num_seqs", _I64), ("starts", _P),
        ("lens", _P), ("num_heads", _I64), ("num_kv_heads", _I64), ("d", _I64), ("scale", _F32),
        ("bf16", _I32), ("out", _P), ("o_tok", _I64), ("o_head", _I64), ("rotate_q", _I32),
        ("rotate_out", _I32),
    ),
}  # fmt: skip


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
