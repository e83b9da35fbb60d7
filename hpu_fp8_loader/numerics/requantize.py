"""FP8 codes at one scale -> FP8 codes at another, exactly, by lookup tables over the 256 codes.

An FP8 source tensor (compressed-tensors: ``code x s_src``, one ``s_src`` per row or per tensor)
becomes a spec tensor ``fp8(clamp(code x s_src / s_dst))``. Within a row both scales are fixed, so
the row's 256 possible codes have 256 possible results: requantizing it is a table lookup, and its
amax and the error the requantization adds follow from its largest code and its code counts. The
tables are computed with the same float32 operations :func:`numerics.quantize` applies to the
dequantized values, so the codes are bit-identical to dequantize-then-quantize (tested), at a
fraction of the memory traffic: one byte per element instead of float32 passes over every element.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from hpu_fp8_loader.errors import NonFiniteError
from hpu_fp8_loader.numerics.e4m3 import FP8_DTYPE, cast_to_fp8, fp8_to_float32, locate_non_finite
from hpu_fp8_loader.spec.names import scale_name

__all__ = ["Requantized", "requantize_rows", "row_amax"]

_CODES = np.arange(256, dtype=np.uint8)
_NAN_MAGNITUDE = 0x7F
# Rows per lookup: row-in-group (high byte) and code (low byte) make one uint16 index into a 64K table.
_GROUP = 256


@functools.cache
def _code_values() -> np.ndarray:
    """float32 of every e4m3fn code, the two NaN codes as 0: :func:`row_amax` refuses them before any table is built."""
    values = fp8_to_float32(_CODES)
    values[(_CODES & _NAN_MAGNITUDE) == _NAN_MAGNITUDE] = 0
    return values


def row_amax(codes: np.ndarray, scale: np.ndarray, name: str, first_row: int, shape: tuple[int, ...]) -> np.ndarray:
    """max |code x scale| of each row (float32), ``scale`` one per row or one for all; a NaN code, or a row
    whose max overflows float32, raises :class:`NonFiniteError` naming the source tensor and the index.
    Exact: rounding is monotonic."""
    magnitude = np.bitwise_and(codes.view(np.uint8), _NAN_MAGNITUDE)
    peak = magnitude.max(axis=1) if magnitude.size else np.zeros(codes.shape[0], np.uint8)
    if (peak == _NAN_MAGNITUDE).any():
        raise locate_non_finite(name, fp8_to_float32(codes), first_row, shape)
    with np.errstate(over="ignore"):
        amax = fp8_to_float32(peak) * np.asarray(scale, np.float32)
    if not np.isfinite(amax).all():  # a huge source scale: code x scale overflows float32, and so would its new scale
        row = int(np.flatnonzero(~np.isfinite(amax))[0])
        raise NonFiniteError(
            f"'{name}' {list(shape)}: row {first_row + row} dequantizes to inf (its largest code times "
            f"'{scale_name(name)}' overflows float32); that weight_scale is out of range"
        )
    return amax


@dataclass(frozen=True)
class Requantized:
    """The codes of a block of rows at the new scale, and the two sums of its error report."""

    codes: np.ndarray
    squared_error: float  # sum of (new code x s_dst - code x s_src)^2
    squared_source: float  # sum of (code x s_src)^2


def requantize_rows(codes: np.ndarray, source_scale: np.ndarray, target_scale: np.ndarray, fp8_max: float) -> Requantized:
    """Rows of FP8 codes with ``source_scale`` (one per row, or one) -> codes at ``target_scale`` (one
    per row, or one). The caller has run :func:`row_amax` over these rows, which refuses NaN codes."""
    codes = codes.view(np.uint8)
    rows = codes.shape[0]
    source = np.asarray(source_scale, np.float32).reshape(-1)
    target = np.asarray(target_scale, np.float32).reshape(-1)
    if source.size == 1 and target.size == 1:  # one table for the whole block
        table, error, value = _tables(source, target, fp8_max)
        counts = np.bincount(codes.reshape(-1), minlength=256)
        return Requantized(np.take(table[0], codes).view(FP8_DTYPE), *_sums(counts, error, value))
    source, target = np.broadcast_to(source, (rows,)), np.broadcast_to(target, (rows,))
    out = np.empty(codes.shape, np.uint8)
    squared_error = squared_source = 0.0
    for first in range(0, rows, _GROUP):
        last = min(rows, first + _GROUP)
        table, error, value = _tables(source[first:last], target[first:last], fp8_max)
        index = codes[first:last].astype(np.uint16)
        index |= (np.arange(last - first, dtype=np.uint16) << 8)[:, None]
        np.take(table.reshape(-1), index, out=out[first:last])
        counts = np.bincount(index.reshape(-1), minlength=(last - first) * 256)
        block_error, block_source = _sums(counts, error, value)
        squared_error += block_error
        squared_source += block_source
    return Requantized(out.view(FP8_DTYPE), squared_error, squared_source)


def _tables(source: np.ndarray, target: np.ndarray, fp8_max: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: the new code of each of the 256 codes, its squared error and the squared source value.

    ``code x s_src`` then ``/ s_dst`` in float32, then the clamp-then-round cast: the operations
    numerics.dequantize and numerics.quantize apply element by element.
    """
    values = _code_values()[None, :] * source[:, None]
    new_codes = cast_to_fp8(values / target[:, None], fp8_max).view(np.uint8)
    difference = (fp8_to_float32(new_codes) * target[:, None] - values).astype(np.float64)
    return new_codes, difference * difference, values.astype(np.float64) ** 2


def _sums(counts: np.ndarray, error: np.ndarray, value: np.ndarray) -> tuple[float, float]:
    """Count-weighted sums, by einsum's own loop: a BLAS dot would wake OpenBLAS's thread pool, whose
    spinning threads slowed two converter worker processes on two cores to below one (measured)."""
    weights = counts.astype(np.float64)
    return float(np.einsum("i,i", weights, error.reshape(-1))), float(np.einsum("i,i", weights, value.reshape(-1)))
