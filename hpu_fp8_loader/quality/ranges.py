"""Whether E4M3 at ±240 holds each quantization point's values: its amax against its typical magnitude.

FastDeploy's HPU format gives each activation point one per-tensor scale, set so the amax lands on ±240. E4M3's
error is relative while a value is a normal number, so what that scale costs depends on one ratio: the amax over a
typical magnitude. Up to about 10^3 the choice of scale formula buys almost nothing; once the median |x| falls
below E4M3's smallest normal at that scale (a ratio of ``240 / 2^-6`` = 15,360), half the values keep fewer than
three mantissa bits, and beyond ``240 / 2^-10`` they round to zero: static per-tensor FP8 collapses there, which
real models show at ``down_proj`` inputs and in a few sink tokens.

The ratio is read on the text a run sees (calibrate: the calibration text with the amax it measured; eval: the
held-out text against the amax the checkpoint is served with) from :class:`~hpu_fp8_loader.numerics.magnitudes.
MagnitudeHistogram` counts, so the median is within 6.1%.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from hpu_fp8_loader.numerics.magnitudes import MagnitudeHistogram
from hpu_fp8_loader.spec import names
from hpu_fp8_loader.spec.fp8 import E4M3_SMALLEST_NORMAL, GAUDI2_FP8_MAX

__all__ = ["NAMED_IN_WARNING", "NORMAL_SPAN", "PointRange", "point_ranges", "range_warning"]

NORMAL_SPAN = GAUDI2_FP8_MAX / E4M3_SMALLEST_NORMAL
"""15,360: the widest amax / median ratio at which the median value is still an E4M3 normal with the amax at ±240."""
# Points a warning names by module, the largest ratio first; the rest are counted.
NAMED_IN_WARNING = 5


@dataclass(frozen=True)
class PointRange:
    """One quantization point's range: the amax its scale is made from, and the median and 99th percentile of |x|.

    ``ratio`` is ``amax / median`` (inf when the median is zero), ``beyond`` whether it exceeds :data:`NORMAL_SPAN`.
    """

    module: str
    amax: float
    median: float
    p99: float
    values: int

    @property
    def ratio(self) -> float:
        return self.amax / self.median if self.median > 0 else math.inf

    @property
    def beyond(self) -> bool:
        return self.ratio > NORMAL_SPAN

    def to_dict(self) -> dict:
        """report.json's row: the ratios as numbers, None for an infinite one (JSON has no inf)."""
        return {
            "module": self.module,
            "amax": self.amax,
            "median": self.median,
            "p99": self.p99,
            "values": self.values,
            "ratio": None if math.isinf(self.ratio) else self.ratio,
            "p99_ratio": self.amax / self.p99 if self.p99 > 0 else None,
            "beyond": self.beyond,
        }


def point_ranges(histograms: Mapping[str, MagnitudeHistogram], amax: Mapping[str, float]) -> list[PointRange]:
    """Every point that has both counted values and an amax, the largest ratio first (then by name).

    ``amax`` is the one the point's scale is made from: calibrate's own, or eval's checkpoint's ``act_scale x 240``.
    A point without one (kept in BF16) is left out, and so is the attention probability point ``s``: its scale is
    fixed at 1 (docs/fastdeploy.md section 10), and the engine records it as that one value, not as the scores.
    """
    ranges = [
        PointRange(module, float(amax[module]), h.quantile(0.5), h.quantile(0.99), h.count)
        for module, h in histograms.items()
        if h.count and amax.get(module) and names.attention_point_of(module) != "s"
    ]
    return sorted(ranges, key=lambda r: (-r.ratio, r.module))


def _where(module: str) -> str:
    """A point as a user would look for it: an attention point by what it is, a linear input by the linear."""
    point = names.attention_point_of(module)
    if point is not None:
        return f"{module} (FP8 attention)"
    if module.endswith(f".experts.{names.UP_GATE}"):
        return f"{module} (every routed expert's input)"
    return module


def range_warning(ranges: list[PointRange], text: str) -> str | None:
    """The warning when a point's ratio exceeds what E4M3 at ±240 holds, naming the worst points; else None.

    ``text`` says which text the ratios were read on (such as ``"held-out text"``).
    """
    beyond = [r for r in ranges if r.beyond]
    if not beyond:
        return None
    shown = ", ".join(f"{_where(r.module)} {r.ratio:.3g}" for r in beyond[:NAMED_IN_WARNING])
    more = f" and {len(beyond) - NAMED_IN_WARNING} more" if len(beyond) > NAMED_IN_WARNING else ""
    return (
        f"{len(beyond)} quantization point(s) span more than E4M3 at ±240 holds (amax / median |x| on {text} above "
        f"{NORMAL_SPAN:,.0f}): {shown}{more}. Their typical values fall below E4M3's smallest normal at the "
        "per-tensor scale; --report lists every point's range (docs/guide.md, 'FP8 range')"
    )
