"""Pipeline partition: which layers each pipeline stage runs.

`balanced_stages`: contiguous ranges minimising the heaviest sum of per-layer weights (compute
only: the baselines' and hand plans' default, Megatron's even split when layers are equal).

`min_max_partition`: contiguous ranges minimising the largest of any per-stage cost
cost(r, s, e) of stage r running layers [s, e) — the planner's cost prices each stage's time AND
memory together (a lower bound on the step that is infinite when the stage cannot fit, see
planner.py), so the layers of a stage are chosen with their strategies (Galvatron-BMW's
partition, solved exactly). Dynamic program over stage boundaries:
    best[r][e] = min_{s < e} max(best[r-1][s], cost(r, s, e)),   best[-1][0] = 0,
answer best[pp-1][L]. Exact for any cost; when cost(r, s, e) does not decrease as e grows (more
layers are never cheaper or smaller), the scan over e for a given (r, s) stops at the first value
that reaches the best answer known (`upper`), so only ranges near a feasible balance are costed.
The test suite checks it against enumeration of all splits.
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
    while hi > lo * (1 + 1e-9):  # about 30 probes; the split is a compute balance, 1e-9 is plenty
        mid = (lo + hi) / 2
        got = cut(mid)
        if got is None:
            lo = mid
        else:
            best, hi = got, mid
    starts = [0] + best[:-1]
    return tuple(zip(starts, best))


def min_max_partition(num_layers: int, stages: int, cost, upper: float = np.inf, rest=None
                      ) -> tuple[float, tuple[tuple[int, int], ...] | None]:
    """(min over splits of max_r cost(r, s_r, e_r), the split), or (inf, None) when no split has a
    value below `upper` (see the module docstring; `cost` must not decrease in e). `rest(r, e)`,
    if given, is a lower bound on the largest cost of stages r+1.. over layers [e, L): boundaries
    where it already reaches `upper` are dropped."""
    L = num_layers
    if not 1 <= stages <= L:
        raise ValueError(f"cannot cut {L} layers into {stages} pipeline stages")
    best = {0: 0.0}  # boundary -> best value of the stages before it
    back: list[dict[int, int]] = []
    for r in range(stages):
        nxt: dict[int, float] = {}
        arg: dict[int, int] = {}
        last = L - (stages - 1 - r)  # leave a layer for every later stage
        for s, before in sorted(best.items()):
            if before >= upper:
                continue
            for e in range(s + 1, last + 1) if r < stages - 1 else (L,):
                if rest is not None and r < stages - 1 and rest(r, e) >= upper:
                    continue  # too much left for the later stages
                value = max(before, cost(r, s, e))
                if value >= upper:
                    if r < stages - 1:
                        break  # a longer range only costs more
                    continue
                if value < nxt.get(e, np.inf):
                    nxt[e], arg[e] = value, s
        best, back = nxt, back + [arg]
        if not best:
            return np.inf, None
    value = best.get(L, np.inf)
    if not np.isfinite(value):
        return np.inf, None
    ends = [L]
    for r in range(stages - 1, 0, -1):
        ends.append(back[r][ends[-1]])
    ends.reverse()
    return value, tuple(zip([0] + ends[:-1], ends))
