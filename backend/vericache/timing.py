"""Timing a piece of work on a shared, noisy machine: the fastest of several runs."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn`` (after one warm-up call), in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
