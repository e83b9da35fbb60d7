"""Quantize throughput (scale, clamp, cast) against ml_dtypes' astype alone, measured in the same run.

Goal (issue 2): >= 1.0x single-threaded, and near-linear scaling to both cores.
Prints ratios, never asserts: machines here are noisy (on the 2-core development VM the first touch
of fresh memory is several times slower than later ones), so each figure is the best of several repetitions after a warm-up.

    python bench/quantize.py [--elements 64000000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ProcessPoolExecutor

import ml_dtypes
import numpy as np
from timing import best_of

from hpu_fp8_loader.numerics import e4m3, scales


def _one_process(rows: int) -> float:
    x = np.random.default_rng(rows).standard_normal((rows, 4096), dtype=np.float32)
    return best_of(3, lambda: e4m3.quantize(x, 0.01, 240.0))


def process_ceiling(rows: int, cores: int) -> float:
    """Throughput of `cores` independent processes over one: what the machine's cores can give at all."""
    alone = _one_process(rows)
    with ProcessPoolExecutor(cores) as pool:
        together = max(pool.map(_one_process, [rows] * cores))
    return cores * alone / together


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=32_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = args.elements // 4096
    x32 = rng.standard_normal((rows, 4096), dtype=np.float32)
    x16 = x32.astype(ml_dtypes.bfloat16)
    scale = float(scales.weight_scale_from_amax(e4m3.abs_max(x32), 240.0))
    cores = os.cpu_count() or 1

    baseline = best_of(args.repeat, lambda: x32.astype(ml_dtypes.float8_e4m3fn))
    rate = x32.size / baseline / 1e6
    print(f"elements: {x32.size:,}; cores: {cores}")
    print(f"baseline ml_dtypes astype(float8_e4m3fn), float32 input, no scale/clamp: {baseline:.3f} s ({rate:.0f} M elem/s)")
    results = {}
    for label, data in (("float32", x32), ("bfloat16", x16)):
        for threads in sorted({1, cores}):
            t = best_of(args.repeat, lambda d=data, n=threads: e4m3.quantize(d, scale, 240.0, threads=n))
            results[(label, threads)] = t
            print(f"quantize {label:8s} input, {threads} thread(s): {t:.3f} s  -> {baseline / t:.2f}x the baseline")
    if cores > 1:
        for label in ("float32", "bfloat16"):
            print(f"scaling {label}: {results[(label, 1)] / results[(label, cores)]:.2f}x on {cores} threads")
        ceiling = process_ceiling(rows // cores, cores)
        print(f"machine ceiling: {cores} independent processes doing the same work give {ceiling:.2f}x one process")
    # The same bytes as the oracle, so the speed is not bought with a different answer.
    ref = np.clip(x32[:1000] / np.float32(scale), -240, 240).astype(ml_dtypes.float8_e4m3fn)
    assert np.array_equal(e4m3.quantize(x32[:1000], scale, 240.0).view(np.uint8), ref.view(np.uint8))


if __name__ == "__main__":
    main()
