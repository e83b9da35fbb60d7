"""Timing helpers: best-of-N of a call, and measurements that take turns."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def best_of(repeat: int, fn) -> float:
    """Best wall time of ``repeat`` calls, after one warm-up (the first touch of fresh memory is slow here)."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def taking_turns(measures: list[Callable[[], T]], runs: int) -> list[list[T]]:
    """Every measure's result per run, the measures taking turns run after run: this machine's load
    drifts over minutes, and taking turns lets the drift hit every one alike."""
    results: list[list[T]] = [[] for _ in measures]
    for _ in range(runs):
        for mine, measure in zip(results, measures, strict=True):
            mine.append(measure())
    return results
