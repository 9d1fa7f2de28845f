"""Per-step sequence-parallel groups for variable-length batches (as in FlexSP, Wang et al. ASPLOS'25).

Problem. A step's n sequences (lengths L_s) run on N devices in M micro-batches. In micro-batch m
the devices form sequence-parallel groups: power-of-two sizes d_g, aligned blocks of consecutive
ranks (so every group is one of the 2N-1 cached process groups), sizes summing to at most N. Each sequence
runs in exactly one (micro-batch, group). With `SeqCostModel` (seqcost.py):

    minimise   sum_m mb( max_g [alpha_{d_g} + sum_{s in g} c(L_s, d_g)] )  (+ the exposed gradient sync)
    subject to sum_{s in g} L_s * act / d_g <= budget          (memory of every device)
               sum_g d_g <= N in every micro-batch (spare ranks idle)

where mb(t) adds the ZeRO traffic that t seconds of compute do not hide (`SeqCostModel.micro_batch_time`).

Any multiset of power-of-two sizes summing to N can be laid out aligned (largest first), so the
solvers choose sizes and contents and `_layout` places them.

Solvers:
- `solve_static(degree)`: the baseline, all groups of one degree. balance="cost": sequences
  spread over the N/d groups longest first (LPT with a memory cap); balance="tokens": what a static
  system does, each group takes a contiguous run of the batch with an equal share of the tokens.
- `solve_micro_batch_heuristic`: for a target time T each sequence takes the smallest degree that
  runs it within T and fits memory (the smallest degree spends the least device-time, since the
  all-to-all traffic grows with d). First-fit decreasing packs the sequences into groups of time
  <= T (a sequence may join a group of a larger degree that has room). Bisection on T finds the
  smallest T whose groups need <= N devices: first on a fast count (small sequences filling the
  gaps fluidly), then on real packings. Sequences far below a group's time are bundled first
  (costs are additive within a group, so a bundle costs exactly its members).
- `milp_micro_batch` (seqmilp.py): the exact mixed-integer form (HiGHS), on the bundled items, used
  when it is small enough to pay within the time budget, and in tests against brute force.
- `solve_step`: the best of the adaptive plan and every single static degree under either balance
  (so never predicted slower than the best static degree); `plan_sequence_parallel` returns it as a `StepPlan`.

No torch import.
"""
from __future__ import annotations

import heapq
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import TesseraError
from ..plan import MicroBatchPlan, SPGroupAssignment, StepPlan
from .seqcost import SeqCostModel

log = logging.getLogger(__name__)

_SMALL = 0.125  # while counting, items under this share of a group's time fill gaps fluidly
_BUNDLE = 1 / 64  # items under this share of the lower bound are bundled
_COUNT_TOLERANCE = 0.005  # bisection on the device count, relative
_BUILD_TOLERANCE = 0.002  # then on real packings
_BUILD_STEPS = 6
_BUILD_WINDOW = 0.85  # packings search down to this share of the counted target
_MILP_MAX_BINARIES = 2500
_STATIC_EXTRA_MICRO_BATCHES = 1
_PEEL_FROM = 0.6  # try the long sequences' own micro-batch when one takes this share of the slowest
_TRY_ONE_MORE_MICRO_BATCH = True


@dataclass
class GroupSolution:
    degree: int
    sequences: list[int]  # indices into the step's batch
    time_s: float


@dataclass
class MicroBatchSolution:
    groups: list[GroupSolution]
    time_s: float  # with its ZeRO traffic: SeqCostModel.micro_batch_time(slowest_s)
    slowest_s: float = 0.0  # the slowest group's time


@dataclass
class StepSolution:
    micro_batches: list[MicroBatchSolution]
    time_s: float
    method: str  # "adaptive", "adaptive+milp" or "static<d>"
    details: dict = field(default_factory=dict)


class Items:
    """What the packers place: single sequences or bundles of them, with their costs per degree."""

    def __init__(self, cost: SeqCostModel, lens: np.ndarray, C: np.ndarray, members: list[list[int]]):
        self.cost = cost
        self.N = cost.num_devices
        self.degrees = cost.degrees
        self.alpha = cost.a2a_alpha_s
        self.cap = cost.token_capacity(self.degrees)  # (D,)
        self.floor = cost.busy_floor_s
        self.lens = lens  # (m,) tokens
        self.C = C  # (m, D) seconds at each degree, without alpha
        self.members = members  # sequences of each item
        self.n = len(lens)
        self.jmin = np.searchsorted(self.cap, lens, side="left")  # smallest degree that holds it
        # plain lists for the scalar loops of the packers (numpy scalar indexing is slow)
        self.C_rows = C.tolist()
        self.lens_list = lens.tolist()
        self.cap_list = self.cap.tolist()
        self.alpha_list = self.alpha.tolist()

    @classmethod
    def of_sequences(cls, seq_lens, cost: SeqCostModel) -> "Items":
        lens = np.asarray(seq_lens, dtype=np.float64)
        cost.check_fits(lens)
        return cls(cost, lens, cost.seq_time(lens), [[i] for i in range(len(lens))])

    def bundled(self, idx: np.ndarray, unit: float) -> "Items":
        """The items `idx`, with those that take less than `unit` seconds at degree 1 merged
        (shortest first) into bundles of about `unit`."""
        tiny = (self.jmin[idx] == 0) & (self.C[idx, 0] < unit)
        keep = idx[~tiny]
        lens, rows, members = list(self.lens[keep]), list(self.C[keep]), [list(self.members[i]) for i in keep]
        small = idx[tiny]
        small = small[np.lexsort((small, self.C[small, 0]))]
        acc_t, acc_len, acc_row, acc_members = 0.0, 0.0, None, []
        for i in small.tolist():
            acc_t += self.C[i, 0]
            acc_len += self.lens[i]
            acc_row = self.C[i].copy() if acc_row is None else acc_row + self.C[i]
            acc_members += self.members[i]
            if acc_t >= unit:
                lens.append(acc_len)
                rows.append(acc_row)
                members.append(acc_members)
                acc_t, acc_len, acc_row, acc_members = 0.0, 0.0, None, []
        if acc_members:
            lens.append(acc_len)
            rows.append(acc_row)
            members.append(acc_members)
        C = np.array(rows).reshape(len(rows), len(self.degrees))
        return Items(self.cost, np.array(lens, dtype=np.float64), C, members)

    def group(self, c: int, items) -> GroupSolution:
        items = list(items)
        seqs = sorted(s for i in items for s in self.members[i])
        return GroupSolution(int(self.degrees[c]), seqs, self.group_time(c, items))

    def group_time(self, c: int, items) -> float:
        items = list(items)
        return float(self.alpha[c] + self.C[items, c].sum()) if items else 0.0

    def micro_batch(self, groups: list[GroupSolution]) -> MicroBatchSolution:
        slowest = max((g.time_s for g in groups), default=0.0)
        return MicroBatchSolution(groups=groups, time_s=self.cost.micro_batch_time(slowest), slowest_s=slowest)

    def step(self, mbs: list[MicroBatchSolution], method: str) -> StepSolution:
        """The micro-batches slowest last: the gradient sync then hides behind the longest backward."""
        mbs = sorted(mbs, key=lambda m: m.slowest_s)
        return StepSolution(micro_batches=mbs, method=method,
                            time_s=self.cost.step_time([m.slowest_s for m in mbs]))

    def lower_bound(self, idx: np.ndarray) -> float:
        """Of the slowest group's time: max(fastest time of the slowest item, device-seconds at the
        smallest degrees / N), and no less than the busy floor (below it nothing gains)."""
        jm = self.jmin[idx]
        device_seconds = (self.degrees[jm] * self.C[idx, jm]).sum()
        return max(self.slowest_item_s(idx), float(device_seconds) / self.N, self.floor)

    def slowest_item_s(self, idx: np.ndarray) -> float:
        """The time of the slowest item alone at its fastest degree that holds it: no group that
        runs it is quicker."""
        valid = np.arange(len(self.degrees))[None, :] >= self.jmin[idx][:, None]
        return float(np.where(valid, self.alpha[None, :] + self.C[idx], np.inf).min(axis=1).max())


def step_lower_bound(b: Items) -> float:
    """No step plan is faster: the relaxation where every sequence runs at a degree that finishes
    it within T, the devices are shared fluidly (device-seconds <= N * T), and memory binds only
    each sequence alone (so a batch that memory cuts into micro-batches is bounded loosely). The
    smallest such T, as one micro-batch (splitting only adds ZeRO traffic), plus the gradient sync."""
    valid = np.arange(len(b.degrees))[None, :] >= b.jmin[:, None]
    t = np.where(valid, b.alpha[None, :] + b.C, np.inf)
    area = np.where(valid, b.degrees[None, :] * b.C, np.inf)

    def fits(target: float) -> bool:
        return float(np.where(t <= target, area, np.inf).min(axis=1).sum()) <= b.N * target

    lo = float(t.min(axis=1).max())
    hi = max(lo, float(area.min(axis=1).sum()) / b.N)
    while not fits(hi):
        lo, hi = hi, 2 * hi
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return b.cost.step_time([hi])


# --- helpers ------------------------------------------------------------------------------------


def _lpt_with_capacity(items: np.ndarray, times: np.ndarray, tokens: np.ndarray, groups: int,
                       cap: float) -> list[list[int]] | None:
    """Longest first onto the least-loaded group that still has memory; None if one does not fit."""
    order = np.lexsort((items, -times)).tolist()
    items, times, tokens = items.tolist(), times.tolist(), tokens.tolist()
    members: list[list[int]] = [[] for _ in range(groups)]
    used = [0.0] * groups
    heap = [(0.0, g) for g in range(groups)]
    limit = cap * (1 + 1e-12)
    for k in order:
        load, g = heapq.heappop(heap)
        if used[g] + tokens[k] > limit:  # rare: memory binds; take the least-loaded group with room
            skipped = [(load, g)]
            while heap:
                load, g = heapq.heappop(heap)
                if used[g] + tokens[k] <= limit:
                    break
                skipped.append((load, g))
            else:
                return None
            for entry in skipped:
                heapq.heappush(heap, entry)
        members[g].append(items[k])
        used[g] += tokens[k]
        heapq.heappush(heap, (load + times[k], g))
    return members


def _split_micro_batches(b: Items, idx: np.ndarray, parts: int, weight: np.ndarray,
                         token_cap: float) -> list[np.ndarray] | None:
    """Cut the items `idx` into `parts` micro-batches of similar weight, each within token_cap."""
    members = _lpt_with_capacity(np.arange(len(idx)), weight[idx], b.lens[idx], parts, token_cap)
    if members is None:
        return None
    return [idx[np.array(m, dtype=np.int64)] for m in members if m]


# --- static degree (the baselines) ----------------------------------------------------------------


def solve_static(b: Items, degree: int, balance: str = "cost") -> StepSolution | None:
    """All groups of `degree` ranks (N // degree of them); None if a sequence needs more.

    balance="cost": LPT by predicted time with a memory cap, fewest micro-batches memory allows
    (and one more). balance="tokens": group g takes the g-th contiguous run of the batch holding
    1/(N/d) of its tokens, cut into micro-batches of consecutive sequences that fill memory."""
    j = int(np.searchsorted(b.degrees, degree))
    if j >= len(b.degrees) or b.degrees[j] != degree or (b.jmin > j).any():
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
    sols = [solve_static(b, int(d), balance) for d in b.degrees]
    return min((s for s in sols if s is not None), key=lambda s: s.time_s, default=None)


# --- adaptive heuristic -------------------------------------------------------------------------


def _degree_choice(b: Items, idx: np.ndarray, target: float) -> np.ndarray | None:
    """Per item, the smallest degree index that runs it within `target` and fits memory."""
    ok = (b.alpha[None, :] + b.C[idx] <= target) & (np.arange(len(b.degrees))[None, :] >= b.jmin[idx][:, None])
    if not ok.any(axis=1).all():
        return None
    return np.argmax(ok, axis=1)


def _pack(b: Items, idx: np.ndarray, target: float, build: bool, max_devices: int | None = None):
    """Pack items into groups of time <= target (first-fit decreasing by device-seconds): an item
    goes into the lowest-degree open group of at least its degree that has time and memory left,
    else opens a group of its degree.

    build=True returns [(degree index, items)] per group. build=False returns the devices needed,
    with the items under _SMALL of a degree-1 group filling the gaps fluidly (less one such item
    of slack per group) instead of being placed. With max_devices, build=True opens no group
    past that many devices and returns (groups, the items left out)."""
    j = _degree_choice(b, idx, target)
    if j is None:
        return None if build else math.inf
    t = b.C[idx, j]
    small = np.zeros(len(idx), bool) if build else (j == 0) & (t <= _SMALL * (target - b.alpha[0]))
    big = np.flatnonzero(~small)
    big = big[np.lexsort((idx[big], -b.degrees[j[big]] * t[big]))]
    D = len(b.degrees)
    rows, lens, caps = b.C_rows, b.lens_list, b.cap_list
    room = [target - a for a in b.alpha_list]
    gcls: list[int] = []
    rem_t: list[float] = []
    rem_k: list[float] = []
    members: list[list[int]] = []
    by_class: list[list[int]] = [[] for _ in range(D)]
    used, left_out = 0, []
    for s, c in zip(idx[big].tolist(), j[big].tolist()):
        row, length, chosen = rows[s], lens[s], -1
        for cc in range(c, D):
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
        rem_t[chosen] -= row[gcls[chosen]]
        rem_k[chosen] -= length
        members[chosen].append(s)
    if build:
        groups = list(zip(gcls, members))
        return groups if max_devices is None else (groups, np.array(left_out, dtype=np.int64))
    devices = int(b.degrees[gcls].sum()) if gcls else 0
    rest = idx[small]
    if rest.size == 0:
        return devices
    c0, l0 = b.C[rest, 0], b.lens[rest]
    c0_sum, per_token = float(c0.sum()), float(c0.sum() / l0.sum())
    left = c0_sum
    if gcls:  # each open group's gap, in degree-1 seconds of the small items
        cls = np.asarray(gcls, dtype=np.int64)
        gap_t = np.maximum(np.asarray(rem_t) - b.C[rest][:, cls].max(axis=0), 0.0) * (c0_sum / b.C[rest].sum(axis=0)[cls])
        gap_k = np.maximum(np.asarray(rem_k) - l0.max(), 0.0) * per_token
        left -= float(np.minimum(gap_t, gap_k).sum())
    if left <= 0:
        return devices
    per_group = min(room[0] - float(c0.max()), (caps[0] - float(l0.max())) * per_token)
    return devices + math.ceil(left / per_group - 1e-9) if per_group > 0 else math.inf


def _build(b: Items, idx: np.ndarray, target: float) -> MicroBatchSolution | None:
    """Groups for a target time (every group within it), if they need at most N devices."""
    groups = _pack(b, idx, target, build=True)
    if groups is None or sum(int(b.degrees[c]) for c, _ in groups) > b.N:
        return None
    return b.micro_batch([b.group(c, m) for c, m in groups])


def _search(b: Items, idx: np.ndarray) -> MicroBatchSolution | None:
    """Bisection on the target time: first on the (fast) device count, then on real packings."""
    lo = floor = b.lower_bound(idx)
    hi = lo
    for _ in range(60):
        if _pack(b, idx, hi, build=False) <= b.N:
            break
        lo, hi = hi, hi * 1.5
    else:
        return None
    while hi - lo > _COUNT_TOLERANCE * hi:
        mid = 0.5 * (lo + hi)
        if _pack(b, idx, mid, build=False) <= b.N:
            hi = mid
        else:
            lo = mid
    best = _build(b, idx, hi)
    if best is not None:
        lo, hi = max(floor, hi * _BUILD_WINDOW), best.slowest_s
    else:
        step = 1 + 4 * _COUNT_TOLERANCE
        for _ in range(200):
            lo, hi = hi, hi * step
            best = _build(b, idx, hi)
            if best is not None:
                break
            step = min(step * 1.5, 1.5)
        else:
            return None
    for _ in range(_BUILD_STEPS):
        if hi - lo <= _BUILD_TOLERANCE * hi:
            break
        mid = 0.5 * (lo + hi)
        sol = _build(b, idx, mid)
        if sol is None:
            lo = mid
        else:
            hi = min(mid, sol.slowest_s)
            best = sol if sol.time_s < best.time_s else best
    return best


def solve_micro_batch_heuristic(b: Items, idx: np.ndarray) -> tuple[MicroBatchSolution | None, Items]:
    """The heuristic on one micro-batch's items (bundled); returns the solution and the bundled items."""
    bundled = b.bundled(idx, b.lower_bound(idx) * _BUNDLE)
    return _search(bundled, np.arange(bundled.n)), bundled


def _solve_split(b: Items, idx: np.ndarray) -> tuple[StepSolution | None, list[Items]]:
    """The items `idx` cut into the fewest micro-batches memory allows, of equal device-seconds (one
    more when memory binds, as smaller micro-batches pack more freely), each solved alone."""
    weight = b.degrees[b.jmin] * b.C[np.arange(b.n), b.jmin]  # device-seconds at the smallest degree
    first = max(1, math.ceil(b.lens[idx].sum() / (b.N * b.cap[0]) - 1e-9))
    best = None
    for parts in range(first, first + 8):
        split = _split_micro_batches(b, idx, parts, weight, b.N * b.cap[0])
        if split is None:
            continue
        solved = [solve_micro_batch_heuristic(b, part) for part in split]
        if any(m is None for m, _ in solved):
            continue
        sol = _step_of(b, solved)
        if best is not None:
            return min(best, sol, key=lambda x: x[0].time_s)
        best = sol
        if parts == 1 or not _TRY_ONE_MORE_MICRO_BATCH:
            return best
    return best if best is not None else (None, [])


def _step_of(b: Items, solved: list) -> tuple[StepSolution, list[Items]]:
    solved = sorted(solved, key=lambda x: x[0].slowest_s)  # the order `step` runs them in, with their items
    return b.step([m for m, _ in solved], "adaptive"), [items for _, items in solved]


def _solve_peeled(b: Items, idx: np.ndarray, longest: float) -> tuple[StepSolution | None, list[Items]]:
    """When a few long sequences set the time: a micro-batch that runs them, with every other
    sequence that fits within their time on the devices they leave, then the rest after. (Equal
    micro-batches would make the long sequences' micro-batch wait on memory-bound short groups.
    Stretching that micro-batch past the longest sequence's time, `longest`, measured no better.)"""
    out = _pack(b, idx, longest, build=True, max_devices=b.N)
    if out is None or out[1].size == 0 or out[1].size == idx.size:
        return None, []
    groups, rest = out
    then, then_items = _solve_split(b, rest)
    if then is None:
        return None, []
    first = b.micro_batch([b.group(c, m) for c, m in groups])
    placed = np.array([i for _, m in groups for i in m], dtype=np.int64)
    return _step_of(b, [(first, b.bundled(placed, 0.0))] + list(zip(then.micro_batches, then_items)))


def solve_adaptive(b: Items) -> tuple[StepSolution | None, list[Items]]:
    """The heuristic for the whole step: the better of equal micro-batches (`_solve_split`) and the
    long sequences' micro-batch first (`_solve_peeled`)."""
    idx = np.arange(b.n)
    split = _solve_split(b, idx)
    longest = b.slowest_item_s(idx)
    if split[0] is not None and longest < _PEEL_FROM * max(m.slowest_s for m in split[0].micro_batches):
        return split  # no sequence long enough to set a micro-batch's time: peeling cannot pay
    sols = [s for s in (split, _solve_peeled(b, idx, longest)) if s[0] is not None]
    return min(sols, key=lambda s: s[0].time_s) if sols else (None, [])


def milp_slots(b: Items, n: int) -> list[tuple[int, int]]:
    """The MILP's possible groups for n items: (degree index, slot) with min(N/d, n) slots per degree."""
    return [(c, t) for c, d in enumerate(b.degrees) for t in range(min(b.N // int(d), n))]


def milp_binaries(n: int, b: Items) -> int:
    """Size of the MILP for n items: (n + 1) binaries per slot."""
    return len(milp_slots(b, n)) * (n + 1)


# --- the entry point --------------------------------------------------------------------------


def _layout(mb: MicroBatchSolution, num_devices: int) -> MicroBatchPlan:
    """Largest groups first at aligned offsets; spare ranks become idle groups of one."""
    groups = sorted(mb.groups, key=lambda g: (-g.degree, g.sequences[:1]))
    out, offset = [], 0
    for g in groups:
        out.append(SPGroupAssignment(ranks=tuple(range(offset, offset + g.degree)), sequences=tuple(g.sequences)))
        offset += g.degree
    for r in range(offset, num_devices):
        out.append(SPGroupAssignment(ranks=(r,), sequences=()))
    return MicroBatchPlan(groups=tuple(out), predicted_time_s=mb.time_s)


def to_step_plan(step: int, seq_lens, sol: StepSolution, num_devices: int) -> StepPlan:
    return StepPlan(step=step, seq_lens=tuple(int(x) for x in seq_lens),
                    micro_batches=tuple(_layout(m, num_devices) for m in sol.micro_batches),
                    predicted_time_s=sol.time_s,
                    strategy="static" if sol.method.startswith("static") else "adaptive")


def solve_step(seq_lens, cost: SeqCostModel, time_budget_s: float = 0.1, use_milp: bool = True) -> StepSolution:
    """The best of: the adaptive heuristic (each micro-batch refined by the exact MILP when it is
    small enough for the time budget and not already at its lower bound) and every static degree
    under either balance."""
    start = time.perf_counter()
    if len(seq_lens) == 0:
        raise TesseraError("a step needs at least one sequence")
    b = Items.of_sequences(seq_lens, cost)
    # Both static baselines: the token split can edge out LPT when memory cuts micro-batches differently.
    statics = [s for s in (best_static(b, "cost"), best_static(b, "tokens")) if s is not None]
    static = min(statics, key=lambda s: s.time_s, default=None)
    adaptive, bundles = solve_adaptive(b)
    if adaptive is not None and use_milp:
        refined = []
        for mb, items in zip(adaptive.micro_batches, bundles):
            idx = np.arange(items.n)
            left = time_budget_s - (time.perf_counter() - start)
            exact = None
            if (mb.slowest_s > items.lower_bound(idx) * (1 + 1e-3) and left > 0.005
                    and milp_binaries(items.n, items) <= _MILP_MAX_BINARIES):
                from .seqmilp import milp_micro_batch  # scipy.optimize: imported only when it runs

                exact = milp_micro_batch(items, idx, time_limit_s=left)
            refined.append(exact if exact is not None and exact.time_s < mb.time_s * (1 - 1e-9) else mb)
        if any(r is not m for r, m in zip(refined, adaptive.micro_batches)):
            adaptive = b.step(refined, "adaptive+milp")
    candidates = [s for s in (adaptive, static) if s is not None]
    if not candidates:
        raise TesseraError("no sequence-parallel plan fits this batch in memory; use more devices or recompute")
    best = min(candidates, key=lambda s: s.time_s)
    best.details = {"static_best_s": static.time_s if static else math.inf,
                    "static_best_method": static.method if static else None,
                    "adaptive_s": adaptive.time_s if adaptive else math.inf,
                    "solve_s": time.perf_counter() - start}
    return best


def plan_sequence_parallel(step: int, seq_lens, cost: SeqCostModel, time_budget_s: float = 0.1) -> StepPlan:
    """StepPlan for one step's batch (see the module docstring)."""
    sol = solve_step(seq_lens, cost, time_budget_s)
    log.debug("step %d: %s %.4fs (best static %.4fs) solved in %.1f ms", step, sol.method, sol.time_s,
              sol.details["static_best_s"], 1e3 * sol.details["solve_s"])
    return to_step_plan(step, seq_lens, sol, cost.num_devices)
