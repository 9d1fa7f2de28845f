"""Layer-wise dynamic program for one pipeline rank: each layer's strategy under a memory budget.

Problem (layers l = 1..L of one rank in model order, chunk starts marked):
    minimise   sum_l time_l(s_l) + sum_{l not a chunk start} trans(layout(s_{l-1}), layout(s_l))
    subject to sum_l mem_l(s_l) + max_l buf_l(s_l) <= budget
with time_l = m (f + b) + step (seconds per step), mem_l = states + in_flight * act, and
trans = m * re-sharding time between layouts (planner.py builds these).

Method. The max-term is removed by enumerating a cap c on the buffer: only strategies with
buf <= c are allowed and the additive budget becomes budget - c (the optimum is found at the cap
equal to its own largest buffer). Caps are the distinct buffer sizes, or at most `max_caps`
representatives with each buffer rounded up to the next one (conservative). For each cap, a
dynamic program over layers with state (layout of the previous layer, memory used in bins of
budget / bins):
    V_l[g', q'] = min_{s: layout(s) = g'} ( min_g V_{l-1}[g, q' - w_s] + trans[g, g'] ) + time_l(s)
where w_s is the strategy's memory above the layer's smallest option, in bins of
(budget - sum of the smallest options) / Q, rounded to nearest. The solution's exact memory is then
checked; if rounding let it overshoot, the program is re-run rounding up, which is always safe.
Caps run in ascending order, each bounded by the best time found so far. Cost per layer: O(S Q + G^2 Q) for S candidates, G
layouts, Q bins, vectorised with numpy; identical layers share their precomputed arrays.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, eq=False)
class Slot:
    """One layer position: its candidates' objective terms (arrays, one per candidate)."""

    time: np.ndarray
    mem: np.ndarray
    buf: np.ndarray
    layout: np.ndarray  # int layout ids (index into the rank's transition matrix)
    chunk_start: bool = False
    _order: np.ndarray = field(default=None, repr=False)  # candidates sorted by layout


@dataclass(frozen=True)
class RankSolution:
    time: float
    mem: float
    buf: float
    choice: tuple[int, ...]  # candidate index per slot
    states_explored: int


def _fastest_if_it_fits(slots: list[Slot], trans: np.ndarray, budget: float) -> RankSolution | None:
    """Each layer's fastest strategy: optimal outright when it fits and no two adjacent picks
    differ in layout (sum of per-layer minima is a lower bound on any assignment)."""
    picks = [int(np.argmin(s.time)) for s in slots]
    for k in range(1, len(slots)):
        if not slots[k].chunk_start and trans[slots[k - 1].layout[picks[k - 1]], slots[k].layout[picks[k]]] > 0:
            return None
    mem = sum(float(s.mem[j]) for s, j in zip(slots, picks))
    buf = max(float(s.buf[j]) for s, j in zip(slots, picks))
    if mem + buf > budget:
        return None
    return RankSolution(sum(float(s.time[j]) for s, j in zip(slots, picks)), mem, buf, tuple(picks), len(slots))


def _caps(slots: list[Slot], max_caps: int) -> np.ndarray:
    values = np.unique(np.concatenate([s.buf for s in slots]))
    if len(values) <= max_caps:
        return values
    pick = np.unique(np.round(np.linspace(0, len(values) - 1, max_caps)).astype(int))
    return values[pick]


def solve_rank(slots: list[Slot], trans: np.ndarray, budget: float, bins: int = 256,
               max_caps: int = 3, upper_bound: float = np.inf) -> RankSolution | None:
    """The best assignment found (see the module docstring), or None if nothing fits.

    Partial assignments whose time plus the remaining layers' fastest times reaches
    `upper_bound` are dropped (a plan already found is at least as fast), so None also means
    "nothing fits that beats upper_bound"."""
    fastest = _fastest_if_it_fits(slots, trans, budget)
    if fastest is not None:
        return fastest
    best: RankSolution | None = None
    explored = 0
    for cap in _caps(slots, max_caps):
        room = budget - cap
        if room <= 0:
            continue
        if sum(float(np.min(np.where(s.buf <= cap, s.mem, np.inf))) for s in slots) > room:
            continue
        bound = min(upper_bound, best.time) if best is not None else upper_bound
        for mode in ("nearest", "up"):  # rounding up is always within the budget
            sol = _solve_capped(slots, trans, cap, room, bins, mode, bound)
            if sol is None:
                break
            explored += sol.states_explored
            if sol.mem <= room * (1 + 1e-12):
                if best is None or sol.time < best.time:
                    best = sol
                break
    if best is None:
        return None
    return RankSolution(best.time, best.mem, best.buf, best.choice, explored)


def _prepare(slot: Slot, cap: float, delta: float, mode: str, cache: dict):
    """Per distinct slot (identical layers share one): allowed candidates sorted by layout,
    their bins, times, and the layout groups."""
    key = (id(slot.time), id(slot.mem), id(slot.buf))
    if key in cache:
        return cache[key]
    allowed = np.flatnonzero(slot.buf <= cap)
    allowed = allowed[np.argsort(slot.layout[allowed], kind="stable")]
    base = slot.mem[allowed].min() if len(allowed) else 0.0
    raw = (slot.mem[allowed] - base) / delta
    w = np.maximum(np.ceil(raw - 1e-9) if mode == "up" else np.round(raw), 0).astype(np.int64)
    lay = slot.layout[allowed]
    t = slot.time[allowed]
    groups, counts = np.unique(lay, return_counts=True)
    # Pad each layout's candidates to the same count (padding: infinite time) so one gather and
    # one min over an axis replace a per-layout loop.
    width = int(counts.max()) if len(counts) else 0
    pad_w = np.zeros((len(groups), width), dtype=np.int64)
    pad_t = np.full((len(groups), width), np.inf)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    for i in range(len(groups)):
        n = counts[i]
        pad_w[i, :n] = w[offsets[i]:offsets[i + 1]]
        pad_t[i, :n] = t[offsets[i]:offsets[i + 1]]
    out = (allowed, w, t, lay, (pad_w, pad_t), groups)
    cache[key] = out
    return out


def _solve_capped(slots: list[Slot], trans: np.ndarray, cap: float, room: float, bins: int,
                  mode: str, upper_bound: float = np.inf) -> RankSolution | None:
    # Every layer spends at least its smallest memory: discretise only what is above it.
    base = sum(float(np.min(np.where(s.buf <= cap, s.mem, np.inf))) for s in slots)
    if base > room:
        return None
    delta = max(room - base, room * 1e-9) / bins
    fastest = [float(np.min(np.where(s.buf <= cap, s.time, np.inf))) for s in slots]
    rest = np.concatenate([np.cumsum(fastest[::-1])[::-1], [0.0]])
    G = trans.shape[0]
    inf = np.inf
    q_axis = np.arange(bins + 1)
    cache: dict = {}
    V = None  # V[g, q]: best time so far with the last layer in layout g using q bins
    ins: list[np.ndarray] = []  # per layer, the best time before it, per (its layout, q)
    Vs: list[np.ndarray] = []
    explored = 0
    reach = 0  # highest memory bin any partial assignment can have used so far
    for k, slot in enumerate(slots):
        allowed, w, t, lay, starts, groups = _prepare(slot, cap, delta, mode, cache)
        if len(allowed) == 0:
            return None
        hi = min(bins, reach + int(w.max())) + 1  # bins above hi are unreachable: skip them
        reach = hi - 1
        if V is None:
            IN = np.full((G, bins + 1), inf)
            IN[:, 0] = 0.0
        elif slot.chunk_start:
            IN = np.broadcast_to(V.min(axis=0), (G, bins + 1))
        else:
            IN = np.full((G, bins + 1), inf)
            IN[groups] = (V[:, None, :] + trans[:, groups, None]).min(axis=0)
        pad_w, pad_t = starts
        src = q_axis[None, None, :hi] - pad_w[:, :, None]
        vals = IN[groups[:, None, None], np.maximum(src, 0)] + pad_t[:, :, None]
        vals[src < 0] = inf
        explored += vals.size
        V = np.full((G, bins + 1), inf)
        V[groups, :hi] = vals.min(axis=1)
        # Keep only states that can still fit the remaining layers and beat the bound.
        if upper_bound < inf:
            V[V + rest[k + 1] >= upper_bound] = inf
        ins.append(IN)
        Vs.append(V)
        if not np.isfinite(V).any():
            return None
    g, q = np.unravel_index(int(np.argmin(V)), V.shape)
    best_time = float(V[g, q])
    picks = []
    for k in range(len(slots) - 1, -1, -1):
        allowed, w, t, lay, _, _ = _prepare(slots[k], cap, delta, mode, cache)
        rows = np.flatnonzero((lay == g) & (w <= q))
        j = rows[np.argmin(ins[k][g, q - w[rows]] + t[rows])]
        picks.append(int(allowed[j]))
        q -= int(w[j])
        if k > 0:
            if slots[k].chunk_start:
                g = int(np.argmin(Vs[k - 1][:, q]))
            else:
                g = int(np.argmin(Vs[k - 1][:, q] + trans[:, g]))
    picks.reverse()
    mem = sum(float(sl.mem[s]) for sl, s in zip(slots, picks))
    buf = max(float(sl.buf[s]) for sl, s in zip(slots, picks))
    return RankSolution(best_time, mem, buf, tuple(picks), explored)
