"""Best-of-N wall time of a call, after one warm-up (the first touch of fresh memory is slow here)."""

from __future__ import annotations

import time


def best_of(repeat: int, fn) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
