"""Scale arithmetic: amax -> dequantization scale, bf16 and power-of-two round-ups. Pure numpy.

Every scale here is a *dequantization* scale (``real ~= fp8 * scale``, ``scale = amax / fp8_max``),
the one meaning the spec gives the word. Kept apart from the casts (numerics.py) so that code that
only checks scales, like ``validate``, never imports ml_dtypes.
"""

from __future__ import annotations

import math

import numpy as np

from hpu_fp8_loader.spec.fp8 import SMALLEST_SCALE

__all__ = [
    "act_scale_from_amax",
    "is_bf16_exact",
    "max_code",
    "round_up_to_bf16",
    "round_up_to_pow2",
    "scale_from_amax",
    "weight_scale_from_amax",
]


def max_code(fp8_max: float) -> int:
    """The e4m3fn code (sign bit clear) of ``fp8_max``: the largest magnitude a checkpoint may contain.

    A normal e4m3fn value is (1 + m/8) * 2^(e - 7) with code e << 3 | m: 240 -> 0x77, 448 -> 0x7E.
    """
    mantissa, exponent = math.frexp(fp8_max)  # fp8_max = mantissa * 2^exponent, mantissa in [0.5, 1)
    m = round((mantissa * 2 - 1) * 8)
    if not 0 <= m < 8 or (mantissa * 2 - 1) * 8 != m:
        raise ValueError(f"{fp8_max} is not an e4m3fn value")
    return ((exponent - 1 + 7) << 3) | m


def scale_from_amax(amax: float | np.ndarray, fp8_max: float) -> np.ndarray:
    """``max(amax / fp8_max, smallest normal float32)`` in float32: the dequantization scale before rounding."""
    return np.maximum(np.asarray(amax, np.float32) / np.float32(fp8_max), SMALLEST_SCALE).astype(np.float32)


def round_up_to_bf16(scale: np.ndarray) -> np.ndarray:
    """Smallest bf16-representable float32 >= each positive finite scale.

    FastDeploy holds weight scales in bf16; rounding up before quantizing makes its dequantization
    use exactly the scale the converter used, and rounding *up* keeps |w / scale| <= fp8_max.
    """
    s = np.asarray(scale, np.float32)
    bits = np.ascontiguousarray(s).view(np.uint32)
    rounded = ((bits.astype(np.uint64) + 0xFFFF) & 0xFFFF0000).astype(np.uint32)
    return rounded.view(np.float32).reshape(s.shape)


def round_up_to_pow2(scale: np.ndarray) -> np.ndarray:
    """Smallest power of two >= each positive finite scale (exact; via frexp)."""
    s = np.asarray(scale, np.float32)
    mantissa, exponent = np.frexp(s)
    exponent = np.where(mantissa == 0.5, exponent - 1, exponent)
    return np.ldexp(np.float32(1.0), exponent).astype(np.float32)


def is_bf16_exact(values: np.ndarray) -> np.ndarray:
    """True where a float32 value has no bits below bf16 precision."""
    values = np.asarray(values, np.float32)
    return ((np.ascontiguousarray(values).view(np.uint32) & 0xFFFF) == 0).reshape(values.shape)


def weight_scale_from_amax(amax: float | np.ndarray, fp8_max: float, rounding: str = "none") -> np.ndarray:
    """Weight dequantization scale: amax / fp8_max, optionally up to a power of two, then up to bf16.

    A zero amax (an all-zero tensor or channel) gets scale 1.0: any positive scale represents zeros
    exactly, and the spec requires every scale to be positive.
    """
    amax = np.asarray(amax, np.float32)
    scale = np.where(amax > 0, scale_from_amax(amax, fp8_max), np.float32(1.0)).astype(np.float32)
    if rounding == "pow2":
        scale = round_up_to_pow2(scale)
    return round_up_to_bf16(scale)


def act_scale_from_amax(amax: float | np.ndarray, fp8_max: float, rounding: str = "none") -> np.ndarray:
    """Activation dequantization scale: float32(amax / fp8_max), or its power-of-two round-up."""
    scale = scale_from_amax(amax, fp8_max)
    return round_up_to_pow2(scale) if rounding == "pow2" else scale
