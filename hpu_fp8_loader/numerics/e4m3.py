"""FP8 arithmetic: amax, the saturating round-to-nearest-even cast, dequantization (scale math: scales.py).

Pure functions on numpy arrays; no I/O. Every scale here is a *dequantization* scale
(``real ~= fp8 * scale``, ``scale = amax / fp8_max``), the one meaning the spec gives the word.

The cast is clamp-then-round, as Gaudi does it (Gaudi saturates out-of-range values at ±240 on Gaudi2,
per the ``test_cast_to_fp8_v2_out_of_range`` test of Habana's ``gaudi-pytorch-bridge``): clamping first
keeps 248 at 240 on Gaudi2, where round-then-clamp would produce 256. It is computed with a
131072-entry lookup table indexed by the top 16 bits of the float32 value plus one "sticky" bit
that records whether any of the low 16 bits is set. Every e4m3fn rounding boundary (including the
subnormal ones and the saturation point) lies on a value whose low 16 bits are zero, so the top
bits plus the sticky bit decide the rounding exactly; the table itself is filled by ml_dtypes, so
the result is bit-identical to ``ml_dtypes`` casting the clamped value. Working through the array
in cache-sized chunks makes this pure-numpy path faster than ``ml_dtypes.astype`` alone
(bench/quantize.py), so no compiled helper is needed.
"""

from __future__ import annotations

import functools
import itertools
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np

from hpu_fp8_loader.errors import NonFiniteError
from hpu_fp8_loader.numerics.scales import max_code

__all__ = [
    "BF16_DTYPE",
    "FP8_DTYPE",
    "abs_max",
    "cast_to_fp8",
    "channel_abs_max",
    "dequantize",
    "fp8_to_float32",
    "locate_non_finite",
    "quantize",
]

FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
BF16_DTYPE = np.dtype(ml_dtypes.bfloat16)
_FP8_NAN_MAGNITUDE = 0x7F
# Elements per chunk. Measured (bench/quantize.py): 2^18 is fastest on one core and scales best to two;
# smaller chunks pay more per-call overhead under the GIL, larger ones fall out of cache.
_CHUNK = 1 << 18


@functools.lru_cache(maxsize=4)
def _cast_table(fp8_max: float) -> np.ndarray:
    """Map (float32 bits >> 15 | sticky) to the e4m3fn code of the clamped value; NaN/inf -> NaN code."""
    index = np.arange(1 << 17, dtype=np.uint32)
    representative = ((index >> 1) << 16) | (index & 1)
    values = representative.view(np.float32)
    table = np.clip(values, -fp8_max, fp8_max).astype(FP8_DTYPE).view(np.uint8).copy()
    non_finite = ~np.isfinite(values)
    table[non_finite] = _FP8_NAN_MAGNITUDE | (table[non_finite] & 0x80)
    return table


def _as_float32_into(src: np.ndarray, buf: np.ndarray) -> np.ndarray:
    """Widen a chunk of bf16/f16/f32 values into ``buf`` (float32) without a temporary."""
    if src.dtype == BF16_DTYPE:
        wide = buf.view(np.uint32)
        wide[...] = src.view(np.uint16)
        np.left_shift(wide, 16, out=wide)
        return buf
    if src.dtype == np.float32:
        return src
    buf[...] = src
    return buf


def _first_non_finite(flat: np.ndarray, start: int, stop: int) -> int:
    """The flat index of the first NaN/inf in ``flat[start:stop]``; callers have already seen one there."""
    chunk = np.asarray(flat[start:stop], dtype=np.float32)
    bad = np.flatnonzero(~np.isfinite(chunk))
    assert bad.size, "no NaN/inf in a chunk whose max was not finite"
    return start + int(bad[0])


def _non_finite_error(name: str, shape: tuple[int, ...], flat_index: int, value: float) -> NonFiniteError:
    where = tuple(int(i) for i in np.unravel_index(flat_index, shape)) if shape else ()
    return NonFiniteError(
        f"tensor '{name}' holds {value} at index {list(where)} (flat {flat_index}); "
        "FP8 casts must never see NaN or inf (Paddle's CPU cast would silently turn them into ±448). "
        "Fix the source checkpoint."
    )


def locate_non_finite(name: str, block: np.ndarray, first_row: int, shape: tuple[int, ...]) -> NonFiniteError:
    """The error for the first NaN/inf of rows ``first_row:`` of a source tensor, naming its full index."""
    wide = block.astype(np.float32)
    bad = np.argwhere(~np.isfinite(wide))[0]
    index = [first_row + int(bad[0]), *(int(i) for i in bad[1:])]
    return NonFiniteError(
        f"tensor '{name}' {list(shape)} holds {float(wide[tuple(bad)])} at index {index}; FP8 casts must never see "
        "NaN or inf (Paddle's CPU cast would silently turn them into ±448). Fix the source checkpoint."
    )


def _rows_per_chunk(row_length: int) -> int:
    return max(1, _CHUNK // max(1, row_length))


def _check_float(x: np.ndarray, name: str) -> None:
    if x.dtype not in (np.dtype(np.float32), np.dtype(np.float16), BF16_DTYPE):
        raise TypeError(f"tensor '{name}': unsupported dtype {x.dtype} (expected bfloat16, float16 or float32)")


def abs_max(x: np.ndarray, name: str = "tensor") -> float:
    """Whole-tensor max |x| in float32, refusing NaN/inf with the tensor's name and first bad index."""
    _check_float(x, name)
    flat = x.reshape(-1)
    buf = np.empty(min(_CHUNK, max(1, flat.size)), np.float32)
    result = np.float32(0.0)
    for start in range(0, flat.size, _CHUNK):
        stop = min(start + _CHUNK, flat.size)
        chunk = _as_float32_into(flat[start:stop], buf[: stop - start])
        hi, lo = chunk.max(), chunk.min()
        peak = max(hi, -lo)
        if not np.isfinite(peak):
            bad = _first_non_finite(chunk, 0, chunk.size)
            raise _non_finite_error(name, x.shape, start + bad, float(chunk[bad]))
        result = max(result, peak)
    return float(result)


def channel_abs_max(x: np.ndarray, name: str = "tensor") -> np.ndarray:
    """max |x| over every axis but the last: the per-output-channel amax of a Paddle ``[in, out]`` weight."""
    _check_float(x, name)
    rows = x.reshape(-1, x.shape[-1])
    step = _rows_per_chunk(rows.shape[1])
    buf = np.empty((min(step, rows.shape[0]), rows.shape[1]), np.float32)
    hi = np.zeros(rows.shape[1], np.float32)
    for start in range(0, rows.shape[0], step):
        stop = min(start + step, rows.shape[0])
        chunk = _as_float32_into(rows[start:stop], buf[: stop - start])
        peak = np.maximum(chunk.max(axis=0), -chunk.min(axis=0))
        if not np.isfinite(peak).all():
            bad = _first_non_finite(chunk.reshape(-1), 0, chunk.size)
            raise _non_finite_error(name, x.shape, start * rows.shape[1] + bad, float(chunk.reshape(-1)[bad]))
        np.maximum(hi, peak, out=hi)
    return hi


def _cast_rows(
    rows: np.ndarray,
    divisor: np.ndarray | None,
    table: np.ndarray,
    table_max: float,
    out_rows: np.ndarray,
    name: str,
    shape: tuple[int, ...],
    row_offset: int,
) -> None:
    """Cast rows[i] / divisor to fp8 codes, chunk by chunk, into out_rows (uint8)."""
    width = rows.shape[1]
    step = _rows_per_chunk(width)
    n = min(step, rows.shape[0]) * width
    buf = np.empty(n, np.float32)
    work = np.empty(n, np.uint32)
    sticky = np.empty(n, np.bool_)
    for start in range(0, rows.shape[0], step):
        stop = min(start + step, rows.shape[0])
        size = (stop - start) * width
        src = _as_float32_into(rows[start:stop].reshape(-1), buf[:size])
        scaled = buf[:size]
        if divisor is not None:
            with np.errstate(over="ignore"):  # overflow saturates; see _resolve_nan_codes
                np.divide(src.reshape(stop - start, width), divisor, out=scaled.reshape(stop - start, width))
        elif src is not scaled:
            scaled[...] = src
        bits = scaled.view(np.uint32)
        w, s = work[:size], sticky[:size]
        np.bitwise_and(bits, 0x7FFF, out=w)
        np.not_equal(w, 0, out=s)
        np.right_shift(bits, 15, out=w)
        np.bitwise_or(w, s, out=w)
        codes = out_rows[start:stop].reshape(-1)
        np.take(table, w, out=codes)
        nan_like = (codes & 0x7F) == _FP8_NAN_MAGNITUDE
        if nan_like.any():
            _resolve_nan_codes(
                rows[start:stop].reshape(-1),
                scaled,
                codes,
                nan_like,
                max_code(float(table_max)),
                name,
                shape,
                (row_offset + start) * width,
            )


def _resolve_nan_codes(src, scaled, codes, nan_like, saturated_code, name, shape, flat_offset) -> None:
    """NaN codes come from a non-finite input (an error) or from a finite value whose scaling overflowed."""
    for i in np.flatnonzero(nan_like):
        original = float(np.asarray(src[i], np.float32))
        if not np.isfinite(original):
            raise _non_finite_error(name, shape, flat_offset + int(i), original)
        codes[i] = saturated_code | (0x80 if scaled[i] < 0 else 0)


def cast_to_fp8(y: np.ndarray, fp8_max: float, name: str = "tensor") -> np.ndarray:
    """Saturate to ±fp8_max, then round to nearest even e4m3fn; NaN/inf raise :class:`NonFiniteError`."""
    return quantize(y, None, fp8_max, name)


def quantize(
    x: np.ndarray,
    scale: float | np.ndarray | None,
    fp8_max: float,
    name: str = "tensor",
    threads: int = 1,
) -> np.ndarray:
    """fp8(clamp(x / scale, ±fp8_max)) with round-to-nearest-even, as a float8_e4m3fn array.

    ``scale`` is a scalar (tensor-wise) or a vector over the last axis (channel-wise), or None for
    values that are already scaled. ``threads`` > 1 splits the rows between threads; numpy releases
    the GIL inside each chunk's kernels.
    """
    _check_float(x, name)
    table = _cast_table(float(fp8_max))
    width = x.shape[-1] if x.ndim else 1
    rows = x.reshape(-1, width)
    divisor = None
    if scale is not None:
        divisor = np.asarray(scale, np.float32)
        if divisor.ndim and divisor.shape != (width,) and divisor.size != 1:
            raise ValueError(f"tensor '{name}': scale shape {divisor.shape} does not fit last axis {width}")
        if divisor.size == 1:
            divisor = divisor.reshape(())
        if not (np.isfinite(divisor).all() and (divisor > 0).all()):
            raise ValueError(f"tensor '{name}': scales must be finite and > 0")
    out = np.empty(rows.shape, np.uint8)
    if threads <= 1 or rows.shape[0] < 2 * threads:
        _cast_rows(rows, divisor, table, float(fp8_max), out, name, x.shape, 0)
    else:
        bounds = np.linspace(0, rows.shape[0], threads + 1).astype(int)
        with ThreadPoolExecutor(threads) as pool:
            jobs = [
                pool.submit(_cast_rows, rows[a:b], divisor, table, float(fp8_max), out[a:b], name, x.shape, int(a))
                for a, b in itertools.pairwise(bounds)
                if b > a
            ]
            for job in jobs:
                job.result()
    return out.view(FP8_DTYPE).reshape(x.shape)


@functools.lru_cache(maxsize=1)
def _decode_table() -> np.ndarray:
    return np.arange(256, dtype=np.uint8).view(FP8_DTYPE).astype(np.float32)


def fp8_to_float32(q: np.ndarray) -> np.ndarray:
    """The float32 values of e4m3fn codes, through a 256-entry table (ml_dtypes' astype is ~10x slower)."""
    return np.take(_decode_table(), np.asarray(q).view(np.uint8))


def dequantize(q: np.ndarray, scale: float | np.ndarray) -> np.ndarray:
    """float32(q) * scale: the real value a spec weight stands for."""
    values = fp8_to_float32(q)
    values *= np.asarray(scale, np.float32)
    return values
