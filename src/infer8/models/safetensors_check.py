"""Check a .safetensors file's header against the file before any tensor is read.

The format: an 8-byte little-endian header length N, N bytes of JSON mapping each tensor name
to {"dtype", "shape", "data_offsets": [begin, end]} (offsets into the data section that
follows; an optional "__metadata__" of strings), then the data section. The Rust reader
refuses a bad file with an exception that names neither the file nor the tensor, after the
engine has spent seconds starting; this reads only the header and names both.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

# dtype -> bytes per element: the dtypes safetensors' torch reader maps to a torch dtype
DTYPE_BYTES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2": 1,
    "F8_E5M2FNUZ": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}
# The Rust reader's own limit on the JSON header (safetensors' MAX_HEADER_SIZE).
MAX_HEADER_BYTES = 100_000_000
_LENGTH_BYTES = 8
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def check_safetensors_files(model_path: Path) -> dict[Path, dict[str, Any]]:
    """Check every *.safetensors file of a model directory; return each one's tensor entries."""
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_path} has no *.safetensors weight files")
    return {file: check_safetensors_header(file) for file in files}


def check_num_layers(
    headers: dict[Path, dict[str, Any]], num_hidden_layers: int, config_path: Path
) -> None:
    """Refuse a config whose num_hidden_layers is not the number of layers the files hold
    (caught here, not after building the layers and loading every weight)."""
    names = (name for header in headers.values() for name in header)
    layers = {int(m.group(1)) for m in map(_LAYER_RE.match, names) if m}
    if layers != set(range(num_hidden_layers)):
        held = f"{len(layers)} layers" + (f" ({min(layers)}-{max(layers)})" if layers else "")
        raise ValueError(
            f"{config_path}: num_hidden_layers is {num_hidden_layers:,}, but the checkpoint's "
            f"*.safetensors files hold weights for {held}"
        )


def check_safetensors_header(path: Path) -> dict[str, Any]:
    """Return the header's tensor entries, or raise ValueError naming the file and the field."""
    file_bytes = path.stat().st_size
    if file_bytes == 0:
        raise ValueError(f"{path}: the file is empty (an interrupted download or copy?)")
    if file_bytes < _LENGTH_BYTES:
        raise ValueError(
            f"{path}: {file_bytes} bytes, too short for the 8-byte header length of a "
            ".safetensors file"
        )
    with path.open("rb") as f:
        header_bytes = int.from_bytes(f.read(_LENGTH_BYTES), "little", signed=True)
        if not 0 < header_bytes <= min(MAX_HEADER_BYTES, file_bytes - _LENGTH_BYTES):
            raise ValueError(
                f"{path}: header length {header_bytes} does not fit the file "
                f"({file_bytes} bytes; at most {MAX_HEADER_BYTES:,} bytes of header are read): "
                "truncated or not a .safetensors file"
            )
        raw = f.read(header_bytes)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, or nested too deep
        raise ValueError(f"{path}: the header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise ValueError(f"{path}: __metadata__ must map names to strings")
    data_bytes = file_bytes - _LENGTH_BYTES - header_bytes
    ranges = {name: _entry(path, name, info) for name, info in header.items()}
    _check_layout(path, ranges, data_bytes)
    return header


def _entry(path: Path, name: str, info: Any) -> tuple[int, int]:
    """Check one tensor's entry; return its byte range in the data section."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise ValueError(f"{where}: the entry is not a JSON object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"{where}: unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise ValueError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise ValueError(f"{where}: data_offsets {offsets!r} is not a [begin, end] byte range")
    begin, end = offsets
    nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
    if nbytes != end - begin:
        raise ValueError(
            f"{where}: shape {shape} x {dtype} is {nbytes:,} bytes, but data_offsets "
            f"[{begin}, {end}] hold {end - begin:,}"
        )
    return begin, end


def _check_layout(path: Path, ranges: dict[str, tuple[int, int]], data_bytes: int) -> None:
    """Refuse ranges outside the data section, overlapping or leaving gaps (as the reader does)."""
    position = 0
    for name, (begin, end) in sorted(ranges.items(), key=lambda item: item[1]):
        if end > data_bytes:
            raise ValueError(
                f"{path}: tensor {name!r}: data_offsets [{begin}, {end}] run past the data "
                f"section's {data_bytes:,} bytes (a truncated file?)"
            )
        if begin != position:
            what = "overlaps the tensor before it" if begin < position else "leaves a gap"
            raise ValueError(
                f"{path}: tensor {name!r}: data_offsets [{begin}, {end}] {what} (expected it to "
                f"start at byte {position})"
            )
        position = end
    if position != data_bytes:
        raise ValueError(
            f"{path}: the tensors cover {position:,} bytes of a {data_bytes:,}-byte data section"
        )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
