"""How the magnitudes |x| of an activation are spread: a histogram by float32 exponent and the first three mantissa
bits, and the quantiles read from it.

An FP8 range problem is a question about the bulk of a tensor's values, not its max: E4M3's error is relative
while a value stays a normal number, so a per-tensor scale set by the amax serves every value within E4M3's
normal range of it and loses the rest to subnormals or zero. Judging that needs a typical magnitude (the
median of |x|) over the values calibration or eval sees. Keeping them is out of the question (a 300B
calibration sees terabytes). A value's bin is the top 11 bits of its float32 magnitude (8 exponent bits, 3
mantissa bits: an eighth of an octave, linear within it): read straight from the bits, with no logarithm (four
times faster than ``log2``, bench/engine.py), a fixed 2,048 counts per point, summed exactly over batches and
threads in any order (integers), and a quantile read to within half a bin: ``sqrt(9/8)``, 6.1%.
"""

from __future__ import annotations

import numpy as np

__all__ = ["QUANTILE_PRECISION", "MagnitudeHistogram"]

_MANTISSA_BITS_KEPT = 3
_SHIFT = np.uint32(23 - _MANTISSA_BITS_KEPT)  # the float32 bits below the kept ones
_BINS = 1 << (8 + _MANTISSA_BITS_KEPT)
_MAGNITUDE = np.uint32(0x7FFFFFFF)
QUANTILE_PRECISION = (1 + 1 / (1 << _MANTISSA_BITS_KEPT)) ** 0.5
"""The most a quantile read from the histogram is off, as a ratio: half of the widest bin (9/8) in log terms."""


class MagnitudeHistogram:
    """Counts of ``|x|`` per bin of the top 11 bits of its float32 magnitude; bin 0 holds zero and the smallest
    subnormals (below 2^-146).

    Example:
        >>> h = MagnitudeHistogram()
        >>> h.add(np.array([1.0, -2.0, 4.0, 1000.0], np.float32))
        >>> h.count, round(h.quantile(0.5), 2)
        (4, 2.12)
    """

    def __init__(self) -> None:
        self.counts = np.zeros(_BINS, np.int64)

    @property
    def count(self) -> int:
        return int(self.counts.sum())

    def add(self, values: np.ndarray) -> None:
        """Count every value of ``values`` (finite: the amax observer refuses NaN and inf before this sees them)."""
        bits = np.ascontiguousarray(values, np.float32).reshape(-1).view(np.uint32)
        self.counts += np.bincount((bits & _MAGNITUDE) >> _SHIFT, minlength=_BINS)

    def quantile(self, q: float) -> float:
        """The ``q`` quantile of the magnitudes counted, as its bin's geometric middle (within
        :data:`QUANTILE_PRECISION`); 0.0 when it falls in bin 0 (zero, or a subnormal below 2^-146)."""
        total = self.count
        if not total:
            raise ValueError("no magnitude counted")
        position = int(np.searchsorted(np.cumsum(self.counts), q * total, side="left"))
        if position == 0:
            return 0.0
        low, high = (np.array([position, position + 1], np.uint32) << _SHIFT).view(np.float32).astype(np.float64)
        return float((low * high) ** 0.5)
