"""Static sequence parallelism, the baselines of the per-step solvers: one degree for every group.

`solve_static(degree)`: all groups of one degree. balance="cost": sequences spread over the N/d
groups longest first (LPT with a memory cap), fewest micro-batches memory allows (and one more);
balance="tokens": what a static system does, each group takes a contiguous run of the batch with
an equal share of the tokens. `best_static`: the best degree.

No torch import.
"""
from __future__ import annotations

import math

import numpy as np

from .seqitems import Items, StepSolution, _lpt_with_capacity, _split_micro_batches

_STATIC_EXTRA_MICRO_BATCHES = 1


def solve_static(b: Items, degree: int, balance: str = "cost") -> StepSolution | None:
    """All groups of `degree` units (N // degree of them); None if a sequence needs more.

    balance="cost": LPT by predicted time with a memory cap, fewest micro-batches memory allows
    (and one more). balance="tokens": group g takes the g-th contiguous run of the batch holding
    1/(N/d) of its tokens, cut into micro-batches of consecutive sequences that fill memory."""
    j = b.class_of(degree)
    if j < 0 or not b.fit[:, j].all():
        return None
    groups = b.N // degree
    if balance == "tokens":
        return _static_token_split(b, j, groups)
    idx = np.arange(b.n)
    first = max(1, math.ceil(b.lens.sum() / (groups * b.cap[j]) - 1e-9))
    best = None
    for parts in range(first, first + _STATIC_EXTRA_MICRO_BATCHES + 1):
        split = _split_micro_batches(b, idx, parts, b.C[:, j], groups * b.cap[j])
        if split is None:
            continue
        mbs = []
        for part in split:
            members = _lpt_with_capacity(part, b.C[part, j], b.lens[part], groups, b.cap[j])
            if members is None:
                break
            mbs.append(b.micro_batch([b.group(j, m) for m in members if m]))
        else:
            sol = b.step(mbs, f"static{degree}")
            if best is not None and sol.time_s >= best.time_s:
                break
            best = sol
    return best


def _static_token_split(b: Items, j: int, groups: int) -> StepSolution:
    order = np.argsort([m[0] for m in b.members], kind="stable")  # data order
    cum = np.cumsum(b.lens[order])
    owner = np.minimum((cum - b.lens[order] / 2) * groups // cum[-1], groups - 1).astype(int)
    per_group: list[list[list[int]]] = []
    for g in range(groups):
        runs, used = [[]], 0.0
        for i in order[owner == g].tolist():
            if runs[-1] and used + b.lens[i] > b.cap[j]:
                runs.append([])
                used = 0.0
            runs[-1].append(i)
            used += b.lens[i]
        per_group.append(runs)
    depth = max(len(r) for r in per_group)
    mbs = [b.micro_batch([b.group(j, runs[m]) for runs in per_group if m < len(runs) and runs[m]])
           for m in range(depth)]
    return b.step(mbs, f"static{int(b.degrees[j])}")


def best_static(b: Items, balance: str = "cost") -> StepSolution | None:
    """The best single degree under the first model (the run's own strategy)."""
    sols = [solve_static(b, int(d), balance) for d in b.cost.degrees]
    return min((s for s in sols if s is not None), key=lambda s: s.time_s, default=None)
