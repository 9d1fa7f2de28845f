"""Pipeline partition: which layers each pipeline stage runs.

`balanced_stages`: contiguous ranges minimising the heaviest sum of per-layer weights.
"""
from __future__ import annotations

from bisect import bisect_right

import numpy as np


def balanced_stages(weights: list[float], chunks: int) -> tuple[tuple[int, int], ...]:
    """Cut `weights` (per layer, in order) into `chunks` contiguous non-empty ranges minimising the
    heaviest range: bisection on the bound, each probe a greedy fill on prefix sums (the greedy
    that packs each range as full as the bound allows is optimal for a fixed bound)."""
    n = len(weights)
    if chunks > n:
        raise ValueError(f"cannot cut {n} layers into {chunks} pipeline chunks")
    prefix = [0.0] + np.cumsum(np.asarray(weights, dtype=float)).tolist()

    def cut(bound: float) -> list[int] | None:
        ends, start = [], 0
        for c in range(chunks - 1):
            # furthest end with sum <= bound, leaving a layer for each later range
            end = bisect_right(prefix, prefix[start] + bound * (1 + 1e-12)) - 1
            end = min(max(end, start + 1), n - (chunks - c - 1))
            if prefix[end] - prefix[start] > bound * (1 + 1e-12) and end - start > 1:
                return None
            ends.append(end)
            start = end
        if prefix[n] - prefix[start] > bound * (1 + 1e-12) and n - start > 1:
            return None
        return ends + [n]

    lo, hi = float(np.max(weights)), float(prefix[-1])
    best = cut(hi)
    for _ in range(40):
        mid = (lo + hi) / 2
        got = cut(mid)
        if got is None:
            lo = mid
        else:
            best, hi = got, mid
    starts = [0] + best[:-1]
    return tuple(zip(starts, best))
