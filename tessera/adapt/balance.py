"""Balanced data-parallel ranks for variable-length batches (as in OVERLORD / MegaScale-Omni).

Problem: the global batch's n sequences, with predicted cost w_s = lin * L_s + attn * L_s**2
(the attention term is quadratic, so one long document can outweigh hundreds of short ones), go to
R data-parallel ranks x M micro-batches. Micro-batches run in lock step (every rank's micro-batch m
meets the others at the gradient synchronisation of the step), so the step takes

    sum_m  max_r  W(r, m),      W(r, m) = sum of w_s assigned to rank r, micro-batch m

Minimising it is multiway number partitioning (NP-hard). We cut the batch into R*M parts whose
largest sum is as small as we can make it, and give micro-batch m the parts m*R .. m*R+R-1:

1. `lpt_partition`: longest processing time first: the heaviest remaining sequence goes to the
   lightest part (Graham 1969: makespan <= 4/3 OPT).
2. `karmarkar_karp_partition`: the k-way largest differencing method (Karmarkar & Karp 1982):
   repeatedly merge the two partial partitions with the largest spread, heaviest part of one with
   the lightest of the other; usually much closer to optimal than LPT when a few items dominate.
3. `balance_ranks` keeps whichever has the smaller largest part.

Packed rows (the data loader's windows, all of the same token count) must go R*M ways in equal
numbers: `balance_rows` is LPT with a cardinality cap (a part that has its share of rows takes no
more), then swaps of one row between the heaviest part and another while that lowers the heaviest.

Deterministic: ties break on the sequence index, so every rank computes the same assignment from
the same lengths, and balancing only permutes sequences within a global batch, which keeps the
data position (and so exact resume) unchanged. No torch import.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


def sequence_costs(seq_lens, lin: float = 1.0, attn: float = 0.0) -> np.ndarray:
    """w_s = lin * L + attn * L**2 (seconds, or any unit both coefficients share)."""
    lens = np.asarray(seq_lens, dtype=np.float64)
    return lin * lens + attn * lens * lens


def _order(costs: np.ndarray) -> np.ndarray:
    """Indices by decreasing cost, ties by increasing index (stable, deterministic)."""
    return np.lexsort((np.arange(len(costs)), -costs))


def lpt_partition(costs, num_parts: int) -> list[list[int]]:
    """Longest processing time first into `num_parts` parts; returns the item indices of each part."""
    costs = np.asarray(costs, dtype=np.float64)
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    heap = [(0.0, p) for p in range(num_parts)]
    for i in _order(costs):
        load, p = heapq.heappop(heap)
        parts[p].append(int(i))
        heapq.heappush(heap, (load + float(costs[i]), p))
    return parts


def karmarkar_karp_partition(costs, num_parts: int) -> list[list[int]]:
    """k-way largest differencing method.

    Each item starts as a partial partition (its own part plus k-1 empty ones). While more than one
    partial partition remains, take the two with the largest spread (max - min part sum) and merge
    them, pairing the heaviest part of one with the lightest of the other.
    """
    costs = np.asarray(costs, dtype=np.float64)
    k = num_parts
    heap = []
    for i in range(len(costs)):
        sums = [float(costs[i])] + [0.0] * (k - 1)
        members = [[i]] + [[] for _ in range(k - 1)]
        # heapq is a min-heap: key on -spread, then the index for determinism
        heap.append((-sums[0], i, sums, members))
    heapq.heapify(heap)
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, key_a, sums_a, mem_a = heapq.heappop(heap)
        _, key_b, sums_b, mem_b = heapq.heappop(heap)
        order_a = sorted(range(k), key=lambda j: -sums_a[j])  # heaviest first
        order_b = sorted(range(k), key=lambda j: sums_b[j])  # lightest first
        sums = [sums_a[ja] + sums_b[jb] for ja, jb in zip(order_a, order_b)]
        members = [mem_a[ja] + mem_b[jb] for ja, jb in zip(order_a, order_b)]
        heapq.heappush(heap, (-(max(sums) - min(sums)), min(key_a, key_b), sums, members))
    _, _, sums, members = heap[0]
    return [sorted(m) for m in members]


def part_loads(costs, parts: list[list[int]]) -> np.ndarray:
    costs = np.asarray(costs, dtype=np.float64)
    return np.array([costs[p].sum() if p else 0.0 for p in parts])


def best_partition(costs, num_parts: int) -> list[list[int]]:
    """The better (smaller largest part) of LPT and Karmarkar-Karp; LPT on ties."""
    lpt = lpt_partition(costs, num_parts)
    kk = karmarkar_karp_partition(costs, num_parts)
    return kk if part_loads(costs, kk).max() < part_loads(costs, lpt).max() else lpt


@dataclass(frozen=True)
class RankAssignment:
    """`parts[m][r]`: indices (into the batch) that rank r runs in micro-batch m."""

    parts: tuple[tuple[tuple[int, ...], ...], ...]
    loads: np.ndarray  # (M, R) predicted cost

    @property
    def step_cost(self) -> float:
        """sum over micro-batches of the slowest rank."""
        return float(self.loads.max(axis=1).sum())

    @property
    def imbalance(self) -> float:
        """max / mean of the per-rank totals (1.0 = perfectly balanced)."""
        totals = self.loads.sum(axis=0)
        return float(totals.max() / totals.mean()) if totals.mean() > 0 else 1.0


def _assignment(costs, parts_flat: list[list[int]], num_ranks: int, num_micro_batches: int) -> RankAssignment:
    loads = part_loads(costs, parts_flat).reshape(num_micro_batches, num_ranks)
    parts = tuple(tuple(tuple(parts_flat[m * num_ranks + r]) for r in range(num_ranks))
                  for m in range(num_micro_batches))
    return RankAssignment(parts=parts, loads=loads)


def strided_ranks(costs, num_ranks: int, num_micro_batches: int = 1) -> RankAssignment:
    """What a plain distributed sampler does: sequence i to part i mod (R*M)."""
    k = num_ranks * num_micro_batches
    flat = [list(range(p, len(costs), k)) for p in range(k)]
    return _assignment(costs, flat, num_ranks, num_micro_batches)


def token_split_ranks(seq_lens, costs, num_ranks: int, num_micro_batches: int = 1) -> RankAssignment:
    """What a static token-balanced split does: part p takes the p-th contiguous run of the batch
    holding 1/(R*M) of its tokens (the 'before' of balancing)."""
    lens = np.asarray(seq_lens, dtype=np.float64)
    k = num_ranks * num_micro_batches
    cum = np.cumsum(lens)
    owner = np.minimum((cum - lens / 2) * k // cum[-1], k - 1).astype(int)
    flat = [np.flatnonzero(owner == p).tolist() for p in range(k)]
    return _assignment(costs, flat, num_ranks, num_micro_batches)


def balance_ranks(seq_lens, num_ranks: int, num_micro_batches: int = 1, lin: float = 1.0,
                  attn: float = 0.0) -> RankAssignment:
    """Assign a global batch to `num_ranks` x `num_micro_batches` so the slowest rank is as fast
    as we can make it (see the module docstring). Costs: lin * L + attn * L**2."""
    if num_ranks < 1 or num_micro_batches < 1:
        raise ValueError(f"need at least one rank and one micro-batch (got {num_ranks} x {num_micro_batches})")
    costs = sequence_costs(seq_lens, lin, attn)
    flat = best_partition(costs, num_ranks * num_micro_batches)
    # Heaviest parts first, so that micro-batch m holds parts of similar weight across ranks.
    flat.sort(key=lambda p: (-float(costs[p].sum()) if p else 0.0, p[0] if p else len(costs)))
    return _assignment(costs, flat, num_ranks, num_micro_batches)


def balance_rows(costs, num_ranks: int, num_micro_batches: int = 1, swaps: int = 64) -> RankAssignment:
    """Rows of equal size (a global batch of packed windows, `len(costs)` divisible by R*M) to
    R ranks x M micro-batches, the same number each, the slowest part as fast as we can make it
    (module docstring); the parts of a micro-batch are of similar weight, and go to the ranks so
    that rank totals balance too (a step that synchronises only once sees those). Deterministic."""
    costs = np.asarray(costs, dtype=np.float64)
    k = num_ranks * num_micro_batches
    if num_ranks < 1 or num_micro_batches < 1 or len(costs) % k:
        raise ValueError(f"{len(costs)} rows do not split evenly over {num_ranks} ranks x "
                         f"{num_micro_batches} micro-batches")
    share = len(costs) // k
    parts: list[list[int]] = [[] for _ in range(k)]
    loads = np.zeros(k)
    heap = [(0.0, p) for p in range(k)]
    for i in _order(costs):  # heaviest first onto the lightest part that still has room
        load, p = heapq.heappop(heap)
        parts[p].append(int(i))
        loads[p] = load + float(costs[i])
        if len(parts[p]) < share:
            heapq.heappush(heap, (loads[p], p))
    for _ in range(swaps):  # one row from the heaviest part for a lighter row of another
        hi = int(np.argmax(loads))
        best = None
        for p in np.argsort(loads).tolist():
            if p == hi:
                continue
            for a in parts[hi]:
                for b in parts[p]:
                    delta = costs[a] - costs[b]
                    if delta <= 0:
                        continue
                    new_max = max(loads[hi] - delta, loads[p] + delta)
                    if new_max < loads[hi] - 1e-12 and (best is None or new_max < best[0]):
                        best = (new_max, p, a, b)
            if best is not None:
                break
        if best is None:
            break
        _, p, a, b = best
        parts[hi][parts[hi].index(a)], parts[p][parts[p].index(b)] = b, a
        delta = costs[a] - costs[b]
        loads[hi] -= delta
        loads[p] += delta
    parts = [sorted(part) for part in parts]
    parts.sort(key=lambda part: (-float(costs[part].sum()), part[0] if part else len(costs)))
    # Micro-batch m takes the next R parts (similar weights, so its lock-step maximum is low); within
    # it, the heaviest part goes to the rank with the least so far, so that rank totals balance too.
    totals = np.zeros(num_ranks)
    ordered: list[list[int]] = []
    for m in range(num_micro_batches):
        group = parts[m * num_ranks:(m + 1) * num_ranks]
        slots: list[list[int]] = [[] for _ in range(num_ranks)]
        for part, r in zip(group, np.lexsort((np.arange(num_ranks), totals)).tolist()):
            slots[r] = part
            totals[r] += float(costs[part].sum())
        ordered += slots
    return _assignment(costs, ordered, num_ranks, num_micro_batches)
