"""The FP8 ranges and value bounds of the format: the one home of 240, 448 and the amax and scale ranges.

Every other module names these constants instead of spelling the numbers (docs/spec.md section 2,
"FP8 encoding"). Pure Python and numpy, so that the config schema and the measurement format can
check values without importing the casts.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "ACT_AMAX_RANGE",
    "E4M3FN_MAX",
    "E4M3_SMALLEST_NORMAL",
    "GAUDI2_FP8_MAX",
    "GAUDI3_FP8_MAX",
    "SCALE_RANGE",
    "SMALLEST_SCALE",
    "act_amax_problem",
]

E4M3FN_MAX = 448.0
"""The largest finite float8_e4m3fn (OCP) value: what compressed-tensors and torch quantize to."""
GAUDI2_FP8_MAX = 240.0
"""Gaudi2 saturates e4m3 at ±240 (its e4m3 has IEEE-style infinities); FastDeploy's HPU path assumes it."""
GAUDI3_FP8_MAX = E4M3FN_MAX
"""Gaudi3 runs the OCP float8_e4m3fn range."""

E4M3_SMALLEST_NORMAL = 2.0**-6
"""The smallest normal e4m3 magnitude (both ranges): below it a value keeps fewer than E4M3's 3 mantissa bits, and
below half of 2^-9 it is zero. With the amax at ±fp8_max, a value ``fp8_max / 2^-6`` times (15,360 at 240) smaller
than the amax is where a per-tensor scale stops serving it with E4M3's relative precision."""

# The smallest positive normal float32 (bf16-exact and a power of two): the floor of every scale, so
# that an amax of a few denormals never gives a scale that underflows to zero.
SMALLEST_SCALE = np.float32(np.finfo(np.float32).tiny)
# Every stored scale: at least the floor, at most the largest float32.
SCALE_RANGE = (float(SMALLEST_SCALE), float(np.finfo(np.float32).max))
# Every stored activation amax. Inside it, everything derived from an amax (amax / fp8_max, FastDeploy's
# multiplier fp8_max / amax, its softmax-scaled query scales, the legacy layout's bf16 amax) is a normal,
# finite float32 and bf16 for either FP8 range; outside it, at least one of them is inf or zero. Real
# activations lie many orders of magnitude inside.
ACT_AMAX_RANGE = (2.0**-100, 2.0**100)


def act_amax_problem(amax: float) -> str | None:
    """Why ``amax`` cannot be an activation amax of a checkpoint, or None when it can (zero is the caller's to judge).

    Example:
        >>> act_amax_problem(3.5) is None
        True
        >>> act_amax_problem(1e40)
        'amax 1e+40 is outside the range an activation amax may take, [7.88861e-31, 1.26765e+30] (2^-100 to 2^100)'
    """
    low, high = ACT_AMAX_RANGE
    if low <= amax <= high:
        return None
    return f"amax {float(amax):g} is outside the range an activation amax may take, [{low:g}, {high:g}] (2^-100 to 2^100)"
