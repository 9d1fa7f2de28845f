"""The exact mixed-integer form of one micro-batch's sequence-parallel groups (HiGHS via scipy).

Slots: for each class c (a degree d_c with a recompute, `seqpar.Items`), min(N/d_c, n) possible
groups; y[q] = 1 when slot q is open, x[s, q] = 1 when item s runs in slot q (only where the
class's memory holds the item).

    min T
    sum_q x[s, q] = 1                                  every item runs once
    x[s, q] <= y[q]                                    only in an open group
    sum_q d_q * y[q] <= N                              devices
    alpha_{d_q} y[q] + sum_s c(s, d_q) x[s, q] <= T    time of every group
    sum_s L_s x[s, q] <= cap_{d_q}                     memory of every group
    y[d, t] <= y[d, t-1]                               symmetry: open slots of a degree first

No torch import.
"""
from __future__ import annotations

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from .seqpar import Items, MicroBatchSolution, milp_slots


def milp_micro_batch(b: Items, idx: np.ndarray, time_limit_s: float = 1.0) -> MicroBatchSolution | None:
    """Optimal groups for the items `idx` (within the time limit: else HiGHS's best found, or None)."""
    n = len(idx)
    slots = milp_slots(b, n)
    pairs = [(s, q) for s in range(n) for q, (c, _) in enumerate(slots) if b.fit[idx[s], c]]
    nx, ny = len(pairs), len(slots)
    nv = nx + ny + 1
    T = nv - 1
    rows, cols, vals, lower, upper = [], [], [], [], []

    def add(entries, lo, hi):
        r = len(lower)
        for col, val in entries:
            rows.append(r)
            cols.append(col)
            vals.append(val)
        lower.append(lo)
        upper.append(hi)

    by_seq: list[list[int]] = [[] for _ in range(n)]
    by_slot: list[list[int]] = [[] for _ in range(ny)]
    for v, (s, q) in enumerate(pairs):
        by_seq[s].append(v)
        by_slot[q].append(v)
    for s in range(n):
        add([(v, 1.0) for v in by_seq[s]], 1.0, 1.0)
    for v, (s, q) in enumerate(pairs):
        add([(v, 1.0), (nx + q, -1.0)], -np.inf, 0.0)
    add([(nx + q, float(b.degrees[c])) for q, (c, _) in enumerate(slots)], -np.inf, float(b.N))
    for q, (c, t) in enumerate(slots):
        add([(v, float(b.C[idx[pairs[v][0]], c])) for v in by_slot[q]]
            + [(nx + q, float(b.alpha[c])), (T, -1.0)], -np.inf, 0.0)
        add([(v, float(b.lens[idx[pairs[v][0]]])) for v in by_slot[q]], -np.inf, float(b.cap[c]))
        if t > 0:
            add([(nx + q, 1.0), (nx + q - 1, -1.0)], -np.inf, 0.0)
    A = coo_matrix((vals, (rows, cols)), shape=(len(lower), nv)).tocsr()
    objective = np.zeros(nv)
    objective[T] = 1.0
    integrality = np.ones(nv)
    integrality[T] = 0
    ub = np.ones(nv)
    ub[T] = np.inf
    res = milp(objective, constraints=LinearConstraint(A, lower, upper), integrality=integrality,
               bounds=Bounds(np.zeros(nv), ub),
               options={"time_limit": max(time_limit_s, 1e-3), "disp": False})
    if res.x is None:
        return None
    members: dict[int, list[int]] = {}
    for v, (s, q) in enumerate(pairs):
        if res.x[v] > 0.5:
            members.setdefault(q, []).append(int(idx[s]))
    return b.micro_batch([b.group(slots[q][0], m) for q, m in sorted(members.items())])
