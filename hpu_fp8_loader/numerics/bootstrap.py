"""How far an accuracy figure could move on other text of the same kind: a bootstrap interval over windows.

Eval's top-1 agreement and mean KL are ratios of sums over tokens. The tokens of one window are not independent
(one context, one topic; an error early in a window shifts the predictions after it), so resampling tokens would
treat correlated tokens as independent and give an interval too narrow. Resampling whole windows (a block bootstrap
whose blocks are the windows) keeps each window's correlation inside its block. Percentile interval, fixed seed:
the same windows always give the same interval. A few lines of numpy rather than scipy.stats.bootstrap: scipy is
no dependency of the package, and the ratio-of-sums statistic needs no more.
"""

from __future__ import annotations

import numpy as np

__all__ = ["RESAMPLES", "SEED", "bootstrap_gap_closed", "bootstrap_ratio_interval"]

RESAMPLES = 1000
SEED = 0


def _picks(windows: int, resamples: int, seed: int) -> np.ndarray:
    """Each draw's windows: as many as there are, with replacement, from ``numpy.random.default_rng(seed)``."""
    return np.random.default_rng(seed).integers(0, windows, size=(resamples, windows))


def bootstrap_ratio_interval(
    numerators: np.ndarray, denominators: np.ndarray, level: float = 0.95, resamples: int = RESAMPLES, seed: int = SEED
) -> tuple[float, float]:
    """The ``level`` percentile bootstrap interval of ``sum(numerators) / sum(denominators)``, resampling windows.

    ``numerators[i]`` and ``denominators[i]`` are window ``i``'s sums (agreeing tokens and tokens; KL summed over
    its tokens and tokens). Each of ``resamples`` draws picks as many windows as there are, with replacement, from
    ``numpy.random.default_rng(seed)``; the interval is the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of
    the draws' ratios. When every window holds the same values, every draw is the point estimate, to the bit.

    Example:
        >>> bootstrap_ratio_interval(np.array([60, 62, 63, 50]), np.array([64, 64, 64, 64]))
        (0.828125, 0.9765625)
    """
    numerators, denominators = np.asarray(numerators, np.float64), np.asarray(denominators, np.float64)
    if numerators.shape != denominators.shape or numerators.ndim != 1 or not numerators.size:
        raise RuntimeError(f"bootstrap: per-window sums of shapes {numerators.shape} and {denominators.shape}")
    picks = _picks(numerators.size, resamples, seed)
    ratios = numerators[picks].sum(axis=1) / denominators[picks].sum(axis=1)
    low, high = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def bootstrap_gap_closed(
    floor: np.ndarray, method: np.ndarray, ceiling: np.ndarray, level: float = 0.95, resamples: int = RESAMPLES, seed: int = SEED
) -> tuple[float, tuple[float, float]]:
    """The fraction of the floor-to-ceiling gap a method closes, ``(F - M) / (F - C)`` over the windows' summed losses
    (say KL), and its ``level`` paired percentile bootstrap interval.

    ``floor[i]``, ``method[i]`` and ``ceiling[i]`` are one window's loss under each (the same windows, in the same
    order: paired). Each draw resamples windows once for all three, so what the windows share (a hard passage is
    hard for every row) cancels, as it does in the estimate. 1 closes the gap, 0 is no better than the floor, below 0
    worse. A draw whose floor and ceiling coincide has no gap to close and is left out; with none left, or when the
    estimate's own gap is not positive, this is refused.

    Example:
        >>> closed, interval = bootstrap_gap_closed(np.array([4.0, 6, 5, 5]), np.array([2.0, 3, 3, 2]), np.array([1.0, 1, 1, 1]))
        >>> round(closed, 3), [round(x, 3) for x in interval]
        (0.625, [0.533, 0.714])
    """
    f, m, c = (np.asarray(a, np.float64) for a in (floor, method, ceiling))
    if not (f.shape == m.shape == c.shape and f.ndim == 1 and f.size):
        raise RuntimeError(f"bootstrap: per-window losses of shapes {f.shape}, {m.shape} and {c.shape}")
    gap = f.sum() - c.sum()
    if not gap > 0:
        raise RuntimeError(f"bootstrap: the ceiling's loss {c.sum():.6g} is not below the floor's {f.sum():.6g}: no gap to close")
    picks = _picks(f.size, resamples, seed)
    gaps = f[picks].sum(axis=1) - c[picks].sum(axis=1)
    kept = gaps > 0
    closed = (f[picks].sum(axis=1) - m[picks].sum(axis=1))[kept] / gaps[kept]
    low, high = np.quantile(closed, [(1 - level) / 2, (1 + level) / 2])
    return float((f.sum() - m.sum()) / gap), (float(low), float(high))
