"""Wall-clock timing of jitted calls, shared by the benchmarks."""

from __future__ import annotations

import statistics
import time

import jax


def median_seconds(fn, *args, reps: int, warmup: int = 3) -> float:
    """Median seconds per call of `fn(*args)` after `warmup` calls (block_until_ready around each)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
