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

__all__ = ["RESAMPLES", "SEED", "bootstrap_ratio_interval"]

RESAMPLES = 1000
SEED = 0


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
    picks = np.random.default_rng(seed).integers(0, numerators.size, size=(resamples, numerators.size))
    ratios = numerators[picks].sum(axis=1) / denominators[picks].sum(axis=1)
    low, high = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)
