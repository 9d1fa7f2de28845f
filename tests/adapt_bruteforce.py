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


def best_micro_batch(cost, lens, seqs) -> float:
    """Optimal max group time (with the micro-batch floor) for the sequences `seqs`."""
    lens = np.asarray(lens, dtype=np.float64)
    C = cost.seq_time(lens)
    best = math.inf
    for sizes in size_multisets(cost.num_devices):
        js = [int(np.searchsorted(cost.degrees, d)) for d in sizes]
        for assign in itertools.product(range(len(sizes)), repeat=len(seqs)):
            worst = 0.0
            for g, j in enumerate(js):
                members = [s for s, a in zip(seqs, assign) if a == g]
                if not members:
                    continue
                if cost.act_bytes_per_token * lens[members].sum() / sizes[g] > cost.budget_bytes * (1 + 1e-12):
                    worst = math.inf
                    break
                worst = max(worst, cost.a2a_alpha_s[j] + C[members, j].sum())
            best = min(best, worst)
    return max(best, cost.micro_batch_floor_s) if best < math.inf else math.inf


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
    """Optimal step time over every split into micro-batches."""
    cache: dict[tuple[int, ...], float] = {}
    best = math.inf
    for partition in set_partitions(list(range(len(lens)))):
        total = cost.step_overhead_s
        for block in partition:
            key = tuple(sorted(block))
            if key not in cache:
                cache[key] = best_micro_batch(cost, lens, list(key))
            total += cache[key]
            if total >= best:
                break
        best = min(best, total)
    return best
