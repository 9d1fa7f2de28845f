"""Brute-force optimum of the per-step SP-group problem on tiny instances (for tests only)."""
from __future__ import annotations

import itertools
import math

import numpy as np


def size_multisets(num_devices: int, largest: int | None = None) -> list[tuple[int, ...]]:
    """Every multiset of power-of-two sizes summing to num_devices, in non-increasing order."""
    largest = largest or 1 << (num_devices.bit_length() - 1)
    if num_devices == 0:
        return [()]
    out = []
    d = largest
    while d >= 1:
        if d <= num_devices:
            out += [(d,) + rest for rest in size_multisets(num_devices - d, d)]
        d //= 2
    return out


def best_micro_batch(costs, lens, seqs) -> float:
    """Optimal micro-batch time (with its ZeRO traffic) for the sequences `seqs`; `costs` is one
    SeqCostModel or a list of them (same working mode; each group picks one, its recompute)."""
    costs = costs if isinstance(costs, (list, tuple)) else [costs]
    slowest = best_slowest_group(costs, lens, seqs)
    return costs[0].micro_batch_time(slowest) if slowest < math.inf else math.inf


def best_slowest_group(costs, lens, seqs) -> float:
    """Optimal slowest-group time for the sequences `seqs` (micro-batch time grows with it)."""
    costs = costs if isinstance(costs, (list, tuple)) else [costs]
    lens = np.asarray(lens, dtype=np.float64)
    times = [c.seq_time(lens) for c in costs]
    first = costs[0]
    best = math.inf
    for sizes in size_multisets(first.num_devices):
        js = [int(np.searchsorted(first.degrees, d)) for d in sizes]
        for assign in itertools.product(range(len(sizes)), repeat=len(seqs)):
            worst = 0.0
            for g, j in enumerate(js):
                members = [s for s, a in zip(seqs, assign) if a == g]
                if not members:
                    continue
                group_best = math.inf  # the group's best class (recompute) that holds it
                for c, C in zip(costs, times):
                    if lens[members].sum() <= c.cap_tokens[j] * (1 + 1e-12):
                        group_best = min(group_best, c.alpha_s[j] + C[members, j].sum())
                worst = max(worst, group_best)
                if worst == math.inf:
                    break
            best = min(best, worst)
    return best


def set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]
        yield [[first]] + part


def best_step(cost, lens) -> float:
    """Optimal step time over every split into micro-batches under one working mode (run slowest
    last, which exposes the least of the gradient sync); `cost` one model or a list (recomputes)."""
    costs = cost if isinstance(cost, (list, tuple)) else [cost]
    cache: dict[tuple[int, ...], float] = {}
    best = math.inf
    for partition in set_partitions(list(range(len(lens)))):
        slowest = []
        for block in partition:
            key = tuple(sorted(block))
            if key not in cache:
                cache[key] = best_slowest_group(costs, lens, list(key))
            slowest.append(cache[key])
        if math.inf not in slowest:
            best = min(best, costs[0].step_time(sorted(slowest)))
    return best
