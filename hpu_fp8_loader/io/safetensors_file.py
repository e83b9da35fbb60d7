"""The safetensors container, parsed by us so that every defect gets a precise message.

The library's own reader reports a corrupt header or a truncated file with a generic error and its
numpy path cannot return F8 tensors (safetensors issue 682: ``numpy`` has no ``float8_e4m3fn``); this
module checks the header against the file size first and then hands out zero-copy, read-only views
of a memory map, so opening a checkpoint never modifies it and costs no RAM.
"""

from __future__ import annotations

import functools
import json
import math
import mmap
import os
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np

from hpu_fp8_loader.errors import SafetensorsFormatError
from hpu_fp8_loader.io.jsonfile import JsonFormatError, parse_json, printable

__all__ = [
    "BLOCK_ELEMENTS",
    "ITEMSIZES",
    "SafetensorsFile",
    "TensorInfo",
    "dtype_name",
    "numpy_dtype",
    "read_header",
    "row_blocks",
]

# Item size of every safetensors dtype code; numpy dtypes are made on demand (numpy_dtype), so code
# that only checks headers or reads F32/uint8 never imports ml_dtypes (its import costs ~0.7 s here).
ITEMSIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "U16": 2,
    "I16": 2,
    "U32": 4,
    "I32": 4,
    "U64": 8,
    "I64": 8,
    "F16": 2,
    "BF16": 2,
    "F32": 4,
    "F64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
_NUMPY_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "U32": "uint32",
    "I32": "int32",
    "U64": "uint64",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
_CODES = {name: code for code, name in _NUMPY_NAMES.items()}


@functools.cache
def numpy_dtype(code: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype code (BF16 and F8 as ml_dtypes types)."""
    name = _NUMPY_NAMES[code]
    if code in ("BF16", "F8_E4M3", "F8_E5M2"):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


# A header larger than this is corrupt, not big: the safetensors library refuses it (MAX_HEADER_SIZE).
_MAX_HEADER_BYTES = 100_000_000
# serde_json, the library's parser, refuses a header nested 128 objects/lists deep.
_MAX_NESTING = 127
_ENTRY_FIELDS = frozenset({"dtype", "shape", "data_offsets"})
# Dtypes the library knows but numpy and hpu-fp8 do not: named as unsupported rather than unknown.
_UNSUPPORTED_DTYPES = frozenset({"F4", "F6_E2M3", "F6_E3M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "C64"})


def dtype_name(dtype: np.dtype) -> str:
    """The safetensors dtype code of a numpy dtype (``BF16``, ``F8_E4M3``, ...)."""
    try:
        return _CODES[np.dtype(dtype).name]
    except KeyError:
        raise TypeError(f"dtype {dtype} has no safetensors code") from None


class TensorInfo(NamedTuple):
    """Where one tensor lives: file, dtype code, shape and absolute byte range in the file.

    A named tuple, not a dataclass: a large MoE checkpoint has tens of thousands of tensors and
    opening it builds one of these per tensor (a third of the cost of a frozen dataclass).
    """

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _bad(path: Path, what: str) -> SafetensorsFormatError:
    return SafetensorsFormatError(f"{path}: {what}")


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and check a safetensors header against the file's real size.

    Returns the tensors (in file order) and the ``__metadata__`` dict. At least as strict as the
    safetensors library (which FastDeploy reads with): everything it refuses raises
    :class:`SafetensorsFormatError` naming the file (and tensor) — a short file, a header that is not
    UTF-8 JSON, duplicate keys, non-string metadata, an unknown dtype, a byte range that does not match
    the shape, tensors that overlap or leave a gap, bytes after the last tensor, or offsets beyond the
    end of the file (a truncated shard).
    """
    path = Path(path)
    size = path.stat().st_size
    if size < 8:
        raise _bad(path, f"file is {size} bytes, too short for a safetensors header (truncated?)")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > _MAX_HEADER_BYTES:
            raise _bad(path, f"header claims {header_len} bytes, over the format's limit of {_MAX_HEADER_BYTES} (corrupt)")
        if 8 + header_len > size:
            raise _bad(
                path, f"header claims {header_len} bytes but the file has {size - 8} after the length (truncated or corrupt)"
            )
        raw = f.read(header_len)
    try:
        header = parse_json(raw, parse_int=_header_int)
    except JsonFormatError as exc:
        raise _bad(path, f"header: {exc}") from None
    if not isinstance(header, dict):
        raise _bad(path, "header is not a JSON object")
    metadata = _metadata(path, header.pop("__metadata__", None))
    data_start = 8 + header_len
    tensors = sorted((_tensor_info(path, name, entry, data_start, size) for name, entry in header.items()), key=_extent)
    _check_coverage(path, tensors, data_start, size)
    return {t.name: t for t in tensors}, metadata


def _header_int(literal: str) -> int | float:
    """A header integer; ``-0`` stays a float, as serde_json reads it (and then refuses it as a size)."""
    return -0.0 if literal == "-0" else int(literal)


def _metadata(path: Path, metadata: object) -> dict[str, str]:
    """``__metadata__``: absent, null, or an object of strings (the library refuses any other value)."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise _bad(path, f"__metadata__ is {type(metadata).__name__}, not an object of strings")
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise _bad(path, f"__metadata__[{json.dumps(key)}] is {json.dumps(value)[:40]}, not a string")
    return metadata


def _extent(info: TensorInfo) -> tuple[int, int]:
    return info.begin, info.end


def _check_coverage(path: Path, tensors: list[TensorInfo], data_start: int, size: int) -> None:
    """Tensors (sorted by offsets) tile the data area exactly, as the library demands: no overlap, gap or tail."""
    position, previous = data_start, None
    for t in tensors:
        if t.begin < position:
            raise _bad(path, f"tensor '{t.name}' overlaps '{previous}'")
        if t.begin > position:
            raise _bad(path, f"{t.begin - position} unused bytes before tensor '{t.name}' (a gap between tensors)")
        position, previous = t.end, t.name
    if position != size:
        raise _bad(path, f"{size - position} bytes after the last tensor's data (trailing bytes)")


_INT = {int}


def _naturals(values: object) -> bool:
    """A JSON list of non-negative integers (JSON booleans excluded)."""
    return type(values) is list and set(map(type, values)) <= _INT and (not values or min(values) >= 0)


def _nesting(value: object) -> int:
    """How many JSON objects/lists deep ``value`` is (0 for a scalar), without recursion."""
    depth, level = 0, [value]
    while level := [v for v in level if isinstance(v, (dict, list))]:
        depth += 1
        level = [child for v in level for child in (v.values() if isinstance(v, dict) else v)]
    return depth


def _tensor_info(path: Path, name: str, entry: object, data_start: int, size: int) -> TensorInfo:
    """One header entry, checked as the library checks it, with its byte range made absolute.

    Stricter in one way: a name with a control character (it would break our one-line messages) is refused.
    """
    if not printable(name):
        raise _bad(path, f"tensor name {name!r} holds a control character")
    if not isinstance(entry, dict) or not entry.keys() >= _ENTRY_FIELDS:
        raise _bad(path, f"tensor '{name}': header entry lacks dtype/shape/data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    extra = {k: v for k, v in entry.items() if k not in _ENTRY_FIELDS}
    if extra and 1 + _nesting(extra) > _MAX_NESTING:  # the header object, then the entry (standing in for extra)
        raise _bad(path, f"tensor '{name}': header entry is nested deeper than the safetensors library parses")
    if type(dtype) is not str or dtype not in ITEMSIZES:
        kind = "unsupported" if type(dtype) is str and dtype in _UNSUPPORTED_DTYPES else "unknown"
        raise _bad(path, f"tensor '{name}': {kind} dtype {dtype!r}")
    if not _naturals(shape):
        raise _bad(path, f"tensor '{name}': shape {json.dumps(shape)[:80]} is not a list of non-negative integers")
    if not _naturals(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise _bad(path, f"tensor '{name}': data_offsets {offsets!r} are not [begin, end]")
    expected = math.prod(shape) * ITEMSIZES[dtype]
    if offsets[1] - offsets[0] != expected:
        raise _bad(path, f"tensor '{name}': {offsets[1] - offsets[0]} bytes for shape {shape} of {dtype} (needs {expected})")
    begin, end = data_start + offsets[0], data_start + offsets[1]
    if end > size:
        raise _bad(path, f"tensor '{name}' ends at byte {end} but the file has {size} bytes (truncated)")
    return TensorInfo(name, path, dtype, tuple(shape), begin, end)


# Elements per row block when a tensor is streamed (row_blocks' usual budget): ~16 MB of float32 working memory.
BLOCK_ELEMENTS = 1 << 22


def row_blocks(rows: int, row_elements: int, budget: int = BLOCK_ELEMENTS, start: int = 0):
    """``(first, stop)`` row ranges of ``start:rows`` holding about ``budget`` elements each (at least one row)."""
    step = max(1, budget // max(1, row_elements))
    for first in range(start, rows, step):
        yield first, min(rows, first + step)


class SafetensorsFile:
    """A read-only memory map of one checked safetensors file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.tensors, self.metadata = read_header(self.path)
        self._map: mmap.mmap | None = None
        self._fd: int | None = None

    def _buffer(self) -> mmap.mmap:
        if self._map is None:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                self._map = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
        return self._map

    def get(self, name: str) -> np.ndarray:
        """A zero-copy read-only array of the tensor (F8 and BF16 as ml_dtypes arrays)."""
        info = self.tensors[name]
        dtype = numpy_dtype(info.dtype)
        if info.nbytes == 0:
            return np.zeros(info.shape, dtype)
        flat = np.frombuffer(self._buffer(), dtype=dtype, count=info.numel, offset=info.begin)
        return flat.reshape(info.shape)

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of axis 0, read with pread into a fresh array (no mapping stays resident).

        The converter uses this instead of :meth:`get` so that what it has read is freed as soon as
        it is processed: mapped pages would count against the process for the whole run.
        """
        info = self.tensors[name]
        dtype = numpy_dtype(info.dtype)
        row_elements = math.prod(info.shape[1:])
        out = np.empty((stop - start, *info.shape[1:]), dtype)
        if out.size == 0:
            return out
        offset = info.begin + start * row_elements * dtype.itemsize
        view = out.reshape(-1).view(np.uint8).data  # .data: the array's bytes as a writable memoryview
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n == 0:
                raise _bad(self.path, f"tensor '{name}': file ended while reading (truncated since it was opened?)")
            done += n
        return out

    def close(self) -> None:
        """Drop our reference to the map; arrays still alive keep it mapped until they go."""
        self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
