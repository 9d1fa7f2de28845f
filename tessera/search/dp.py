"""Layer-wise dynamic program for one pipeline rank: each layer's strategy under a memory budget.

Problem (layers l = 1..L of one rank in model order, chunk starts marked):
    minimise   sum_l time_l(s_l) + sum_{l not a chunk start} trans(layout(s_{l-1}), layout(s_l))
    subject to sum_l mem_l(s_l) + max_l buf_l(s_l) <= budget
with time_l = m (f + b) + step (seconds per step), mem_l = states + in_flight * act, and
trans = m * re-sharding time between layouts (planner.py builds these).

Method. The max-term is removed by enumerating a cap c on the buffer over the distinct buffer
sizes: only strategies with buf <= c are allowed and the additive budget becomes budget - c. The
optimum is found at the cap equal to its own largest buffer, and every capped solution is
feasible, so min over caps is the optimum. For each cap, a dynamic program over layers with state
(layout of the previous layer, memory used in Q bins of delta = (budget - c - sum of the smallest
options) / Q):
    V_l[g', q'] = min_{s: layout(s) = g'} ( min_g V_{l-1}[g, q' - w_s] + trans[g, g'] ) + time_l(s)
where w_s is the strategy's memory above the layer's smallest option, in bins.

Certificate (exact, not a resolution-dependent approximation). With w_s rounded DOWN every
feasible assignment stays feasible (sum floor(x) <= sum x <= Q), so that program's value is a lower
bound T_down <= OPT_c; with w_s rounded UP every assignment it accepts is feasible (sum x <=
sum ceil(x) <= Q), so its solution T_up >= OPT_c is a plan (rounding to the NEAREST bin is tried
first and kept when its exact memory fits). The cap is solved when the rounded-down solution is
itself feasible or no cap can beat the best solution by more than `gap`; otherwise Q grows 4x (up
to `max_bins`) and what is left is reported as `RankResult.bound` <= OPT <= `solution.time`.
Caps are taken in the order of their linear relaxation (space.lp_time_bound), and skipped with
it as their bound once it cannot beat the best solution so far. Partial assignments whose time
plus the remaining layers' fastest times reach `upper_bound` are dropped in every program (a plan
at least as fast exists), so the bound never exceeds upper_bound when nothing beats it.

Cost per layer: O(S Q + G^2 Q) for S candidates, G layouts, Q bins, vectorised with numpy: each
candidate shifts its layout's row of states by its bins (only the bins that hold states), and
per layout only candidates that no other beats in bins and time take part; identical layers
share their precomputed arrays.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .space import lower_hull, lp_time_bound


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


@dataclass(frozen=True)
class RankResult:
    """The best assignment found (None: nothing fits that beats the upper bound), a valid lower
    bound on the optimum (min(optimum, upper_bound)), and the work done."""

    solution: RankSolution | None
    bound: float
    states_explored: int

    @property
    def certified(self) -> bool:
        return self.solution is not None and self.solution.time <= self.bound * (1 + 1e-12) + 1e-300


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


def _cap_relaxation(slots: list[Slot], cap: float, room: float) -> float:
    """The linear relaxation of one cap's problem (transitions dropped): a lower bound."""
    groups: dict[tuple, list] = {}
    for s in slots:
        key = (id(s.time), id(s.mem), id(s.buf))
        if key not in groups:
            ok = s.buf <= cap
            groups[key] = [0, lower_hull(s.time[ok], s.mem[ok]) if ok.any() else None]
        groups[key][0] += 1
    if any(h is None for _, h in groups.values()):
        return np.inf
    return lp_time_bound([(n, h) for n, h in groups.values()], room)


def solve_rank(slots: list[Slot], trans: np.ndarray, budget: float, bins: int = 256,
               max_bins: int = 4096, upper_bound: float = np.inf, gap: float = 0.0) -> RankResult:
    """The optimum of the module docstring's problem, certified (or bounded: `RankResult.bound`).

    With `gap` > 0 a cap is left as soon as its lower bound shows it cannot beat the best solution
    found by more than that factor (best <= (1 + gap) x its optimum), which keeps the resolution
    low where the answer cannot change much."""
    fastest = _fastest_if_it_fits(slots, trans, budget)
    if fastest is not None:
        return RankResult(fastest, fastest.time, fastest.states_explored)
    best: RankSolution | None = None
    bounds: list[float] = []
    explored = 0

    def ceiling() -> float:
        return min(upper_bound, best.time / (1 + gap)) if best is not None else upper_bound

    caps = [float(c) for c in np.unique(np.concatenate([s.buf for s in slots]))]
    relaxed = [_cap_relaxation(slots, c, budget - c) if budget > c else np.inf for c in caps]
    for rel, cap in sorted(zip(relaxed, caps)):  # most promising first: a good plan early prunes the rest
        room = budget - cap
        if rel >= ceiling():
            bounds.append(min(rel, ceiling()))
            continue
        q = bins
        while True:
            top = ceiling()
            low = _solve_capped(slots, trans, cap, room, q, "down", top)
            if low is None:  # nothing under this cap beats the ceiling
                bounds.append(top)
                break
            explored += low.states_explored
            if low.mem <= room * (1 + 1e-12):  # the relaxation's optimum is feasible: optimal
                best = low if best is None or low.time < best.time else best
                bounds.append(low.time)
                break
            for mode in ("nearest", "up"):  # nearest is often feasible; up always is
                sol = _solve_capped(slots, trans, cap, room, q, mode, top)
                if sol is None:
                    break
                explored += sol.states_explored
                if sol.mem <= room * (1 + 1e-12):
                    if best is None or sol.time < best.time:
                        best = sol
                    break
            if low.time >= ceiling() or q >= max_bins:
                bounds.append(min(low.time, ceiling()))
                break
            q *= 4
    bound = min(bounds) if bounds else np.inf
    if best is not None:
        bound = min(bound, best.time)
        best = RankSolution(best.time, best.mem, best.buf, best.choice, explored)
    return RankResult(best, min(bound, upper_bound), explored)


def _prepare(slot: Slot, cap: float, delta: float, mode: str, cache: dict):
    """Per distinct slot (identical layers share one): the allowed candidates as the program sees
    them, (bins w, time t), keeping per layout only those no other beats on both (fewer bins and
    no more time, or the same bins and less time: the program cannot tell them apart otherwise);
    grouped by layout."""
    key = (id(slot.time), id(slot.mem), id(slot.buf))
    if key in cache:
        return cache[key]
    # A candidate whose memory is infinite (it fits no device, e.g. host memory under offload) is
    # never allowed: its bins would not be a number.
    allowed = np.flatnonzero((slot.buf <= cap) & np.isfinite(slot.mem))
    base = slot.mem[allowed].min() if len(allowed) else 0.0
    raw = (slot.mem[allowed] - base) / delta
    # "up": ceil (a little slack for float noise keeps exact multiples where they are); "down": floor;
    # "nearest": a guess whose memory the caller checks.
    rounded = {"up": np.ceil(raw - 1e-9), "down": np.floor(raw + 1e-9), "nearest": np.round(raw)}[mode]
    w = np.clip(rounded, 0, 2**40).astype(np.int64)  # beyond any budget's bins: never placed
    lay, t = slot.layout[allowed], slot.time[allowed]
    order = np.lexsort((t, w, lay))  # by layout, then bins, then time
    allowed, w, lay, t = allowed[order], w[order], lay[order], t[order]
    keep = np.ones(len(allowed), dtype=bool)
    best = np.inf
    for i in range(len(allowed)):
        if i and lay[i] != lay[i - 1]:
            best = np.inf
        keep[i] = t[i] < best
        best = min(best, t[i])
    allowed, w, lay, t = allowed[keep], w[keep], lay[keep], t[keep]
    groups = np.unique(lay)
    members = [np.flatnonzero(lay == g) for g in groups]
    out = (allowed, w, t, lay, members, groups)
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
            lo = 0
        else:
            live = np.flatnonzero(np.isfinite(V).any(axis=0))
            if not len(live):
                return None
            lo, top = int(live[0]), int(live[-1]) + 1  # the bins that hold states
            if slot.chunk_start:
                IN = np.broadcast_to(V.min(axis=0), (G, bins + 1))
            else:
                IN = np.full((G, bins + 1), inf)
                IN[groups, lo:top] = (V[:, None, lo:top] + trans[:, groups, None]).min(axis=0)
        V = np.full((G, bins + 1), inf)
        for g, rows in zip(groups, starts):  # each candidate shifts its layout's row by its bins
            source, target = IN[g], V[g]
            for j in rows:
                shift = int(w[j])
                if lo + shift >= hi:
                    break  # rows are sorted by bins
                np.minimum(target[lo + shift:hi], source[lo:hi - shift] + t[j], out=target[lo + shift:hi])
                explored += hi - lo - shift
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
