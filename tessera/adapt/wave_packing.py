"""Packing a multi-task step's operators into waves (the algorithms of `adapt.spindle`; its
module docstring states the model): `pack_waves` (the fastest wave sequence, exact dynamic
program), `_pack_waves_exact_memory` (the fastest that fits each device as
`spindle.device_memory` counts, A*), `_pack_waves_in_memory` (the fastest under the per-wave
memory bound, Pareto dynamic program). Operators are anything with `.after` (indices of the
operators that must finish first) and `.part`. No torch import.
"""
from __future__ import annotations

import math
from itertools import combinations

import numpy as np

INF = math.inf


def _wave_allocation(members: tuple[int, ...], sizes: np.ndarray, f: np.ndarray, b: np.ndarray, total: int):
    """(cost, groups) of the best allocation of one wave (see the module docstring) or (inf, None)."""
    tf = np.unique(f[list(members)])
    tb = np.unique(b[list(members)])
    tf, tb = tf[np.isfinite(tf)], tb[np.isfinite(tb)]
    if not len(tf) or not len(tb):
        return INF, None
    need = np.zeros((len(tf), len(tb)))
    pick = []
    for o in members:
        ok = (f[o][None, None, :] <= tf[:, None, None]) & (b[o][None, None, :] <= tb[None, :, None])
        g = np.where(ok, sizes[None, None, :], np.inf).min(axis=-1)
        need += g
        pick.append(g)
    cost = np.where(need <= total, tf[:, None] + tb[None, :], np.inf)
    i, j = np.unravel_index(int(np.argmin(cost)), cost.shape)
    if not np.isfinite(cost[i, j]):
        return INF, None
    return float(cost[i, j]), tuple(int(g[i, j]) for g in pick)


def _wave_options(members: tuple[int, ...], sizes: np.ndarray, f: np.ndarray, b: np.ndarray, mem: np.ndarray,
                  total: int) -> list[tuple[float, float, tuple[int, ...]]]:
    """The Pareto-optimal (time, memory, options) allocations of one wave, memory = the largest
    per-device bytes of its operators: thresholds (t_f, t_b, t_m) over the operators' values, each
    operator on its smallest group meeting all three (as `_wave_allocation`, with memory); an
    option is a column of f, b, mem (a group size, `sizes[i]`, and a plan of the operator)."""
    idx = list(members)
    tf, tb, tm = (np.unique(a[idx]) for a in (f, b, mem))
    tf, tb, tm = tf[np.isfinite(tf)], tb[np.isfinite(tb)], tm[np.isfinite(tm)]
    if not (len(tf) and len(tb) and len(tm)):
        return []
    need = np.zeros((len(tf), len(tb), len(tm)))
    pick = []
    for o in members:
        ok = ((f[o][None, None, None, :] <= tf[:, None, None, None])
              & (b[o][None, None, None, :] <= tb[None, :, None, None])
              & (mem[o][None, None, None, :] <= tm[None, None, :, None]))
        sized = np.where(ok, sizes[None, None, None, :], np.inf)
        need += sized.min(axis=-1)
        pick.append(sized.argmin(axis=-1))  # the option (column) taken: its smallest group
    time = np.broadcast_to((tf[:, None] + tb[None, :])[:, :, None], need.shape)
    out = []
    for i, j, k in zip(*np.nonzero(need <= total)):
        out.append((float(time[i, j, k]), float(tm[k]), tuple(int(g[i, j, k]) for g in pick)))
    return _pareto(out)


def _pareto(items: list[tuple]) -> list[tuple]:
    """Items (time, memory, ...) that no other beats on both (ties: the first)."""
    out, best_mem = [], np.inf
    for item in sorted(items, key=lambda x: (x[0], x[1])):
        if item[1] < best_mem:
            out.append(item)
            best_mem = item[1]
    return out


def _pack_waves_in_memory(ops: list, sizes: list[int], fwd: np.ndarray, bwd: np.ndarray, mem: np.ndarray,
                          total: int, budget: float):
    """`pack_waves` with sum over waves of the wave's memory <= budget: a forward dynamic program
    over the set of finished operators keeping every Pareto-optimal (time, memory) label.
    Returns (cost, [(operators, option columns), ...])."""
    n = len(ops)
    size_arr = np.asarray(sizes, dtype=float)
    need_mask = [sum(1 << a for a in op.after) for op in ops]
    options: dict[tuple[int, ...], list] = {}
    labels: dict[int, list] = {0: [(0.0, 0.0, None, None)]}  # (time, memory, previous label, wave)
    for done in range(1 << n):  # a wave only adds operators: every predecessor of a set comes first
        here = labels.get(done)
        if not here:
            continue
        labels[done] = here = _pareto(here)
        ready = [o for o in range(n) if not done >> o & 1 and need_mask[o] & done == need_mask[o]]
        for k in range(1, len(ready) + 1):
            for members in combinations(ready, k):
                if members not in options:
                    options[members] = _wave_options(members, size_arr, fwd, bwd, mem, total)
                nxt = done | sum(1 << o for o in members)
                for t, m, groups in options[members]:
                    for label in here:
                        if label[1] + m <= budget:
                            labels.setdefault(nxt, []).append((label[0] + t, label[1] + m, label, (members, groups)))
    final = labels.get((1 << n) - 1)
    if not final:
        return INF, []
    best = min(final, key=lambda x: (x[0], x[1]))
    waves, label = [], best
    while label[2] is not None:
        waves.append(label[3])
        label = label[2]
    return best[0], waves[::-1]


def pack_waves(ops: list, sizes: list[int], fwd: np.ndarray, bwd: np.ndarray,
               total: int, mem: np.ndarray | None = None,
               budget: float = INF) -> tuple[float, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """The wave sequence minimising sum(max f + max b): (cost, [(operators, groups), ...]).

    fwd[o, i], bwd[o, i]: seconds of operator o on sizes[i] devices (inf: it does not fit).
    With `mem` (bytes per device of operator o on sizes[i]): only sequences whose waves' largest
    `mem` add up to at most `budget` (the module docstring's memory bound)."""
    if mem is not None:
        cost, waves = _pack_waves_in_memory(ops, sizes, fwd, bwd, mem, total, budget)
        return cost, [(members, tuple(sizes[i] for i in options)) for members, options in waves]
    solve, best = _time_dp(ops, sizes, fwd, bwd, total)
    cost = solve(0)
    if not math.isfinite(cost):
        return INF, []
    waves, state = [], 0
    while state != (1 << len(ops)) - 1:
        _, wave, state = best[state]
        waves.append(wave)
    return cost, waves


def _time_dp(ops: list, sizes: list[int], fwd: np.ndarray, bwd: np.ndarray, total: int):
    """(solve, memo): solve(done) = the least time of the waves that finish the operators not in
    `done` (a bit set), memo[done] = (that time, the first wave, the set after it)."""
    n = len(ops)
    size_arr = np.asarray(sizes, dtype=float)
    full = (1 << n) - 1
    wave_cache: dict[tuple[int, ...], tuple[float, tuple | None]] = {}
    best: dict[int, tuple[float, tuple | None, int]] = {full: (0.0, None, full)}
    need_mask = [sum(1 << a for a in op.after) for op in ops]

    def solve(done: int) -> float:
        if done in best:
            return best[done][0]
        ready = [o for o in range(n) if not done >> o & 1 and need_mask[o] & done == need_mask[o]]
        choice = (INF, None, done)
        for k in range(1, len(ready) + 1):
            for members in combinations(ready, k):
                if members not in wave_cache:
                    wave_cache[members] = _wave_allocation(members, size_arr, fwd, bwd, total)
                cost, groups = wave_cache[members]
                if not math.isfinite(cost):
                    continue
                nxt = done | sum(1 << o for o in members)
                value = cost + solve(nxt)
                if value < choice[0]:
                    choice = (value, (members, groups), nxt)
        best[done] = choice
        return choice[0]

    return solve, best


def _pack_waves_exact_memory(ops: list, sizes: list[int], fwd: np.ndarray, bwd: np.ndarray,
                             states: np.ndarray, act: np.ndarray, buf: np.ndarray, total: int, budget: float,
                             max_nodes: int = 4000):
    """The fastest wave schedule whose every device stays within `budget` bytes as `device_memory`
    counts them (groups side by side from device 0 in operator order), each wave's allocation one
    of its Pareto-optimal (time, largest per-device bytes) ones (`_wave_options`): A* over partial
    schedules, the remaining time of the unconstrained program (`_time_dp`) as the admissible
    estimate, a partial schedule dropped as soon as a device overflows (memory only grows as waves
    are added). Columns i are options: a group of sizes[i] devices and a plan, with per-device
    bytes states[o, i], act[o, i], buf[o, i]; rounds end as early as `round_ends` lets them.
    Returns (cost, [(operators, columns)]), or
    (inf, []) when nothing fits, or None when `max_nodes` expansions did not settle it."""
    import heapq

    n = len(ops)
    full = (1 << n) - 1
    solve, _ = _time_dp(ops, sizes, fwd, bwd, total)
    if not math.isfinite(solve(0)):
        return INF, []
    size_arr = np.asarray(sizes, dtype=float)
    mem = states + act
    need_mask = [sum(1 << a for a in op.after) for op in ops]
    options: dict[tuple[int, ...], list] = {}
    dependents = [sum(1 << o for o, op in enumerate(ops) if a in op.after) for a in range(n)]
    # node: (estimate, tie, time, done, waves, held states {(part, first, size): bytes}, per-device
    # arrays: held states, this round's activations, earlier rounds' largest, buffers)
    zero = np.zeros(total)
    heap = [(solve(0), 0, 0.0, 0, (), {}, zero, zero, zero, zero)]
    tie = expanded = 0
    seen: set = set()  # the same waves in another order: the same time and the same memory
    while heap:
        _, _, time, done, waves, held, load, acts, peak, bufs = heapq.heappop(heap)
        if done == full:
            return time, list(waves)
        key = frozenset(waves)
        if key in seen:
            continue
        seen.add(key)
        expanded += 1
        if expanded > max_nodes:
            return None
        ready = [o for o in range(n) if not done >> o & 1 and need_mask[o] & done == need_mask[o]]
        for k in range(1, len(ready) + 1):
            for members in combinations(ready, k):
                if members not in options:
                    options[members] = _wave_options(members, size_arr, fwd, bwd, mem, total)
                nxt = done | sum(1 << o for o in members)
                rest = solve(nxt)
                for t, _, chosen in options[members]:
                    h2, ld, ac, bf = dict(held), load.copy(), acts.copy(), bufs.copy()
                    first = 0
                    for o, i in zip(members, chosen):
                        g = sizes[i]
                        where = slice(first, first + g)
                        key = (ops[o].part, first, g)
                        grow = states[o, i] - h2.get(key, 0.0)
                        if grow > 0:
                            ld[where] += grow
                            h2[key] = states[o, i]
                        ac[where] += act[o, i]
                        bf[where] = np.maximum(bf[where], buf[o, i])
                        first += g
                    pk = np.maximum(peak, ac)
                    if float((ld + pk + bf).max()) > budget:  # only grows as waves are added
                        continue
                    if all(dependents[o] & nxt == dependents[o] for o in range(n) if nxt >> o & 1):
                        peak_next, ac = pk, zero  # a round ends: its activations go (`round_ends`)
                    else:
                        peak_next = peak
                    tie += 1
                    heapq.heappush(heap, (time + t + rest, tie, time + t, nxt, waves + ((members, chosen),), h2,
                                          ld, ac, peak_next, bf))
    return INF, []
