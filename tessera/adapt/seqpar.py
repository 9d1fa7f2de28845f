"""Per-step sequence-parallel groups for variable-length batches under one strategy (as in
FlexSP, Wang et al. ASPLOS'25); `switching.py` composes strategies (HotSPa) and is the entry point.

Problem. A step's n sequences (lengths L_s) run on N units (of `tp` ranks each) in M micro-batches.
In micro-batch m the units form sequence-parallel groups: power-of-two sizes d_g, aligned blocks
of consecutive units, sizes summing to at most N. Each sequence runs in exactly one (micro-batch,
group). With `SeqCostModel` (seqcost.py):

    minimise   step([max_g (alpha_{d_g} + sum_{s in g} c(L_s, d_g))  for each micro-batch])
    subject to sum_{s in g} L_s <= cap_{d_g}               (memory of every device)
               sum_g d_g <= N in every micro-batch (spare units idle)

where step() adds each micro-batch's ZeRO traffic that its compute does not hide, the gradient
sync and the optimizer (`SeqCostModel.step_time`): every extra micro-batch of a ZeRO-3 strategy
re-gathers the parameters, so fewer, fuller micro-batches can beat better-balanced ones.

Any multiset of power-of-two sizes summing to N can be laid out aligned (largest first), so the
solvers choose sizes and contents and `switching.layout` places them.

Solvers (the items and solutions they share: `seqitems.py`):
- `solve_static(degree)` (seqstatic.py): the baselines, all groups of one degree.
- `solve_micro_batch_heuristic`: for a target time T each sequence takes the smallest degree that
  runs it within T and fits memory (the smallest degree spends the least device-time, since the
  all-to-all traffic grows with d). First-fit decreasing packs the sequences into groups of time
  <= T (a sequence may join a group of a larger degree that has room). Bisection on T finds the
  smallest T whose groups need <= N devices: first on a fast count (small sequences filling the
  gaps fluidly), then on real packings. Sequences far below a group's time are bundled first
  (costs are additive within a group, so a bundle costs exactly its members).
- `solve_adaptive`: the step cut into the fewest micro-batches memory allows (and up to a few
  more, kept only when the whole step's time, traffic included, is lower), or the long sequences'
  micro-batch first with the rest after.
- `milp_micro_batch` (seqmilp.py): the exact mixed-integer form (HiGHS) of one micro-batch.

No torch import.
"""
from __future__ import annotations

import math

import numpy as np

from .seqitems import (NEVER, Deadline, GroupSolution, Items, MicroBatchSolution, Phase,  # noqa: F401 (re-exported)
                       StepSolution, _lpt_with_capacity, _split_micro_batches, fluid_bound, item_options,
                       step_lower_bound)
from .seqstatic import best_static, solve_static  # noqa: F401 (re-exported)

_SMALL = 0.125  # while counting, items under this share of a group's time fill gaps fluidly
_BUNDLE = 1 / 64  # items under this share of the lower bound are bundled
_COUNT_TOLERANCE = 0.01  # bisection on the device count, relative
_BUILD_TOLERANCE = 0.002  # then on real packings
_BUILD_STEPS = 4
_BUILD_WINDOW = 0.85  # packings search down to this share of the counted target
_EXTRA_MICRO_BATCHES = 3  # beyond the fewest memory allows, tried while they get faster
_PEEL_FROM = 0.6  # try the long sequences' own micro-batch when one takes this share of the slowest


# --- adaptive heuristic -------------------------------------------------------------------------


def _effective_area(b: Items, idx: np.ndarray, target: float) -> np.ndarray:
    """(n, K) device-seconds an item takes of groups of each class with time `target`: its time,
    or, where memory binds first, its share of the group's memory in seconds (inf where the item
    does not fit or finish in time)."""
    room = np.maximum(target - b.alpha, 0.0)
    ok = (b.alpha[None, :] + b.C[idx] <= target) & b.fit[idx]
    use = np.maximum(b.C[idx], b.lens[idx, None] * (room / b.cap)[None, :])
    return np.where(ok, b.degrees[None, :] * use, np.inf)


def _degree_choice(b: Items, idx: np.ndarray, target: float) -> tuple[np.ndarray, np.ndarray] | None:
    """Per item, the smallest degree that runs it within `target` and fits memory (the smallest
    degree spends the least device-time, as all-to-all traffic grows with it), in the recompute
    class that takes the fewest device-seconds of a group there (time or memory, whichever binds:
    `_effective_area`); and that area."""
    area = _effective_area(b, idx, target)
    R = len(b.models)
    per_degree = area.reshape(len(idx), -1, R)  # (n, D, R)
    best_r = np.argmin(per_degree, axis=2)
    best = np.take_along_axis(per_degree, best_r[:, :, None], axis=2)[:, :, 0]  # (n, D)
    ok = np.isfinite(best)
    if not ok.any(axis=1).all():
        return None
    j = np.argmax(ok, axis=1)
    rows = np.arange(len(idx))
    return j * R + best_r[rows, j], best[rows, j]


def _pack(b: Items, idx: np.ndarray, target: float, build: bool, max_devices: int | None = None):
    """Pack items into groups of time <= target (first-fit decreasing by device-seconds): an item
    goes into the lowest-degree open group of at least its degree that has time and memory left,
    else opens a group of its degree.

    build=True returns ([(degree index, items)] per group, slowest group time). build=False
    returns the devices needed, with the items under _SMALL of a degree-1 group filling the gaps
    fluidly (less one such item of slack per group) instead of being placed. With max_devices,
    build=True opens no group past that many devices and returns (groups, slowest, the items left out)."""
    chosen_class = _degree_choice(b, idx, target)
    if chosen_class is None:
        return None if build else math.inf
    j, eff = chosen_class
    t = b.C[idx, j]
    small = (np.zeros(len(idx), bool) if build else
             (b.degrees[j] == 1) & (t <= _SMALL * (target - b.alpha[j])))
    big = np.flatnonzero(~small)
    big = big[np.lexsort((idx[big], -eff[big]))]
    D = len(b.degrees)
    rows, lens, caps, deg = b.C_rows, b.lens_list, b.cap_list, b.degree_list
    room = [target - a for a in b.alpha_list]
    gcls: list[int] = []
    rem_t: list[float] = []
    rem_k: list[float] = []
    members: list[list[int]] = []
    by_class: list[list[int]] = [[] for _ in range(D)]  # open groups that still have room
    joinable = b.joinable
    least_t = b.C[idx[big]].min(axis=0).tolist() if big.size else [0.0] * D  # a group below it is full
    least_k = float(b.lens[idx[big]].min()) if big.size else 0.0
    used, left_out = 0, []
    for s, c in zip(idx[big].tolist(), j[big].tolist()):
        row, length, chosen = rows[s], lens[s], -1
        for cc in joinable[c]:
            if not by_class[cc]:
                continue
            w = row[cc]
            for g in by_class[cc]:
                if rem_t[g] >= w and rem_k[g] >= length:
                    chosen = g
                    break
            if chosen >= 0:
                break
        if chosen < 0:
            if max_devices is not None and used + int(b.degrees[c]) > max_devices:
                left_out.append(s)
                continue
            used += int(b.degrees[c])
            chosen = len(gcls)
            gcls.append(c)
            rem_t.append(room[c])
            rem_k.append(caps[c])
            members.append([])
            by_class[c].append(chosen)
        gc = gcls[chosen]
        rem_t[chosen] -= row[gc]
        rem_k[chosen] -= length
        members[chosen].append(s)
        if rem_t[chosen] < least_t[gc] or rem_k[chosen] < least_k:
            by_class[gc].remove(chosen)
    if build:
        groups = list(zip(gcls, members))
        slowest = target - min(rem_t) if rem_t else 0.0
        return (groups, slowest) if max_devices is None else (groups, slowest, np.array(left_out, dtype=np.int64))
    devices = int(b.degrees[gcls].sum()) if gcls else 0
    rest = idx[small]
    if rest.size == 0:
        return devices
    k0 = int(np.bincount(j[small]).argmax())  # the degree-1 class most small items chose
    c0, l0 = b.C[rest, k0], b.lens[rest]
    c0_sum, per_token = float(c0.sum()), float(c0.sum() / l0.sum())
    left = c0_sum
    if gcls:  # each open group's gap, in degree-1 seconds of the small items
        cls = np.asarray(gcls, dtype=np.int64)
        gap_t = np.maximum(np.asarray(rem_t) - b.C[rest][:, cls].max(axis=0), 0.0) * (c0_sum / b.C[rest].sum(axis=0)[cls])
        gap_k = np.maximum(np.asarray(rem_k) - l0.max(), 0.0) * per_token
        left -= float(np.minimum(gap_t, gap_k).sum())
    if left <= 0:
        return devices
    per_group = min(room[k0] - float(c0.max()), (caps[k0] - float(l0.max())) * per_token)
    return devices + math.ceil(left / per_group - 1e-9) if per_group > 0 else math.inf


def _build(b: Items, idx: np.ndarray, target: float):
    """(groups, slowest) for a target time (every group within it), if they need at most N devices."""
    out = _pack(b, idx, target, build=True)
    if out is None or sum(int(b.degrees[c]) for c, _ in out[0]) > b.N:
        return None
    return out


def _search(b: Items, idx: np.ndarray, deadline: Deadline = NEVER) -> MicroBatchSolution | None:
    """Bisection on the target time: first on the (fast) device count, then on real packings.
    Past the `deadline`, the best packing found so far (None before the first)."""
    lo = floor = b.lower_bound(idx)
    hi = lo
    for _ in range(60):
        if _pack(b, idx, hi, build=False) <= b.N:
            break
        if deadline.passed():
            return None
        lo, hi = hi, hi * 1.5
    else:
        return None
    while hi - lo > _COUNT_TOLERANCE * hi and not deadline.passed():
        mid = 0.5 * (lo + hi)
        if _pack(b, idx, mid, build=False) <= b.N:
            hi = mid
        else:
            lo = mid
    best = _build(b, idx, hi)
    if best is not None:
        lo, hi = max(floor, hi * _BUILD_WINDOW), best[1]
    else:
        step = 1 + 4 * _COUNT_TOLERANCE
        for _ in range(200):
            lo, hi = hi, hi * step
            best = _build(b, idx, hi)
            if best is not None:
                break
            if deadline.passed():
                return None
            step = min(step * 1.5, 1.5)
        else:
            return None
    for _ in range(_BUILD_STEPS):
        if hi - lo <= _BUILD_TOLERANCE * hi or deadline.passed():
            break
        mid = 0.5 * (lo + hi)
        sol = _build(b, idx, mid)
        if sol is None:
            lo = mid
        else:
            hi = min(mid, sol[1])
            best = sol if sol[1] < best[1] else best
    return b.micro_batch([b.group(c, m) for c, m in best[0]])


def solve_micro_batch_heuristic(b: Items, idx: np.ndarray,
                                deadline: Deadline = NEVER) -> tuple[MicroBatchSolution | None, Items]:
    """The heuristic on one micro-batch's items (bundled); returns the solution and the bundled items."""
    bundled = b.bundled(idx, b.lower_bound(idx) * _BUNDLE)
    return _search(bundled, np.arange(bundled.n), deadline), bundled


def _solve_split(b: Items, idx: np.ndarray, deadline: Deadline = NEVER) -> tuple[StepSolution | None, list[Items]]:
    """The items `idx` cut into micro-batches of equal device-seconds, each solved alone: as few as
    the memory of each recompute allows, and one more (smaller micro-batches pack more freely,
    each carries its ZeRO traffic); the fastest whole step. (When none of those splits packs, more
    micro-batches, up to `_EXTRA_MICRO_BATCHES` tries.)"""
    weight = np.where(b.fit, b.degrees[None, :] * b.C, np.inf).min(axis=1)  # least device-seconds
    unit_caps = b.cap[b.degrees == 1]  # a degree-1 group's memory under each recompute
    unit_cap = float(unit_caps.max())
    tokens = float(b.lens[idx].sum())
    fewest = sorted({max(1, math.ceil(tokens / (b.N * c) - 1e-9)) for c in unit_caps})
    # the fewest micro-batches each recompute's memory allows, and one more
    counts = sorted({p for f in fewest for p in (f, f + 1)})
    best = None
    tried = 0
    for parts in counts + list(range(counts[-1] + 1, counts[-1] + 8)):
        split = _split_micro_batches(b, idx, parts, weight, b.N * unit_cap)
        if split is None:
            continue
        solved = [solve_micro_batch_heuristic(b, part, deadline) for part in split]
        if any(m is None for m, _ in solved):
            if deadline.passed():
                break
            continue
        sol = _step_of(b, solved)
        tried += 1
        if best is None or sol[0].time_s < best[0].time_s:
            best = sol
        if parts >= idx.size or tried > _EXTRA_MICRO_BATCHES or parts >= counts[-1] or deadline.passed():
            break
    return best if best is not None else (None, [])


def _step_of(b: Items, solved: list) -> tuple[StepSolution, list[Items]]:
    solved = sorted(solved, key=lambda x: x[0].slowest_s)  # the order `step` runs them in, with their items
    return b.step([m for m, _ in solved], "adaptive"), [items for _, items in solved]


def peel(b: Items, idx: np.ndarray, target: float):
    """Groups within `target` seconds on at most N devices, longest items first: (micro-batch,
    its items bundled, the items left out), or None when nothing or everything is left out."""
    out = _pack(b, idx, target, build=True, max_devices=b.N)
    if out is None or out[2].size == idx.size:
        return None
    groups, _, rest = out
    first = b.micro_batch([b.group(c, m) for c, m in groups])
    placed = np.array([i for _, m in groups for i in m], dtype=np.int64)
    return first, b.bundled(placed, 0.0), rest


def _solve_peeled(b: Items, idx: np.ndarray, longest: float, deadline: Deadline = NEVER):
    """When a few long sequences set the time: a micro-batch that runs them, with every other
    sequence that fits within their time on the devices they leave, then the rest after. (Equal
    micro-batches would make the long sequences' micro-batch wait on memory-bound short groups.
    Stretching that micro-batch past the longest sequence's time, `longest`, measured no better.)"""
    out = peel(b, idx, longest)
    if out is None or out[2].size == 0:
        return None, []
    first, first_items, rest = out
    then, then_items = _solve_split(b, rest, deadline)
    if then is None:
        return None, []
    return _step_of(b, [(first, first_items)] + list(zip(then.micro_batches, then_items)))


def solve_adaptive(b: Items, idx: np.ndarray | None = None,
                   deadline: Deadline = NEVER) -> tuple[StepSolution | None, list[Items]]:
    """The heuristic for the items `idx` (all by default) as one phase: the better of equal
    micro-batches (`_solve_split`) and the long sequences' micro-batch first (`_solve_peeled`)."""
    idx = np.arange(b.n) if idx is None else idx
    if idx.size == 0 or not b.fits(idx):
        return None, []
    split = _solve_split(b, idx, deadline)
    longest = b.slowest_item_s(idx)
    if split[0] is not None and longest < _PEEL_FROM * max(m.slowest_s for m in split[0].micro_batches):
        return split  # no sequence long enough to set a micro-batch's time: peeling cannot pay
    sols = [s for s in (split, _solve_peeled(b, idx, longest, deadline)) if s[0] is not None]
    return min(sols, key=lambda s: s[0].time_s) if sols else (None, [])


def milp_slots(b: Items, n: int) -> list[tuple[int, int]]:
    """The MILP's possible groups for n items: (degree index, slot) with min(N/d, n) slots per degree."""
    return [(c, t) for c, d in enumerate(b.degrees) for t in range(min(b.N // int(d), n))]


def milp_binaries(n: int, b: Items) -> int:
    """Size of the MILP for n items: (n + 1) binaries per slot."""
    return len(milp_slots(b, n)) * (n + 1)
