"""What the per-step solvers place and return: `Items` (sequences or bundles of them, priced in
every class of group: a degree with a recompute), the solutions (groups, micro-batches, phases,
steps), the fluid lower bound, and the longest-first packing helpers the solvers share.

No torch import.
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field

import numpy as np

from .seqcost import SeqCostModel


class Deadline:
    """A solver's time budget on a clock: wall time by default (`time.perf_counter`); a
    benchmark may pass the process's CPU clock to get the plans a quiet machine would."""

    def __init__(self, budget_s: float = math.inf, clock=time.perf_counter):
        self.clock = clock
        self.end = clock() + budget_s

    def passed(self) -> bool:
        return self.clock() > self.end

    def left(self) -> float:
        return self.end - self.clock()


NEVER = Deadline()


@dataclass
class GroupSolution:
    degree: int  # units of tp ranks
    sequences: list[int]  # indices into the step's batch
    time_s: float
    recompute: str = ""  # the group's activation recompute ("": the phase's default)


@dataclass
class MicroBatchSolution:
    groups: list[GroupSolution]
    time_s: float  # with its ZeRO traffic: SeqCostModel.micro_batch_time(slowest_s)
    slowest_s: float = 0.0  # the slowest group's time


@dataclass
class Phase:
    """Micro-batches run under one ZeRO working mode (`strategy`: index into the step's
    StrategySet of the model that prices its traffic)."""

    strategy: int
    micro_batches: list[MicroBatchSolution]


@dataclass
class StepSolution:
    phases: list[Phase]
    time_s: float
    method: str  # "adaptive", "switching", "static<d>" (+ "+milp")
    details: dict = field(default_factory=dict)

    @property
    def micro_batches(self) -> list[MicroBatchSolution]:
        return [m for p in self.phases for m in p.micro_batches]


class Items:
    """What the packers place: single sequences or bundles of them, with their costs in every
    class of group. A class is a (degree, recompute) pair: recompute is local to a group's ranks,
    so groups of one micro-batch may differ in it; the ZeRO working mode is the phase's. `models`
    (one per recompute, same working mode; the first prices the traffic) give the classes, ordered
    by degree then model; `strategy` is the first model's index in the step's StrategySet."""

    def __init__(self, models: list[SeqCostModel], lens: np.ndarray, C: np.ndarray, members: list[list[int]],
                 strategy: int = 0):
        self.models = models
        self.cost = models[0]
        self.strategy = strategy
        self.N = self.cost.num_devices
        R, D = len(models), len(self.cost.degrees)
        self.degrees = np.repeat(self.cost.degrees, R)  # (K,) class k = degree k // R, model k % R
        self.rc = [m.strategy.recompute for m in models] * D
        self.alpha = np.array([[m.alpha_s[j] for m in models] for j in range(D)]).reshape(-1)
        self.cap = np.array([[m.cap_tokens[j] for m in models] for j in range(D)]).reshape(-1)
        self.floor = self.cost.busy_floor_s
        self.lens = lens  # (m,) tokens
        self.C = C  # (m, K) seconds in each class, without alpha
        self.members = members  # sequences of each item
        self.n = len(lens)
        self.fit = lens[:, None] <= self.cap[None, :]  # (m, K) memory holds the item alone
        self.first = np.where(self.fit.any(axis=1), np.argmax(self.fit, axis=1), len(self.cap))
        # plain lists for the scalar loops of the packers (numpy scalar indexing is slow)
        self.C_rows = C.tolist()
        self.lens_list = lens.tolist()
        self.cap_list = self.cap.tolist()
        self.alpha_list = self.alpha.tolist()
        self.degree_list = self.degrees.tolist()
        # per class, the classes of at least its degree (the groups an item of that class may join)
        self.joinable = [[cc for cc in range(len(self.cap)) if self.degree_list[cc] >= d] for d in self.degree_list]

    @classmethod
    def of_sequences(cls, seq_lens, cost: SeqCostModel | list[SeqCostModel], strategy: int = 0) -> "Items":
        models = list(cost) if isinstance(cost, (list, tuple)) else [cost]
        lens = np.asarray(seq_lens, dtype=np.float64)
        C = np.stack([m.seq_time(lens) for m in models], axis=2).reshape(len(lens), -1)  # (n, D, R) -> (n, K)
        return cls(models, lens, C, [[i] for i in range(len(lens))], strategy)

    def fits(self, idx: np.ndarray | None = None) -> bool:
        first = self.first if idx is None else self.first[idx]
        return bool((first < len(self.cap)).all())

    def class_of(self, degree: int, model: int = 0) -> int:
        """Class index of a degree under model `model` (-1 when the degree is not one)."""
        j = np.flatnonzero(self.cost.degrees == degree)
        return int(j[0]) * len(self.models) + model if j.size else -1

    def bundled(self, idx: np.ndarray, unit: float) -> "Items":
        """The items `idx`, with those that take less than `unit` seconds in class 0 merged
        (shortest first) into bundles of about `unit` (and within half a class-0 group's memory)."""
        tiny = (self.first[idx] == 0) & (self.C[idx, 0] < unit)
        keep = idx[~tiny]
        lens, rows, members = list(self.lens[keep]), list(self.C[keep]), [list(self.members[i]) for i in keep]
        small = idx[tiny]
        small = small[np.lexsort((small, self.C[small, 0]))]
        acc_t, acc_len, acc_row, acc_members = 0.0, 0.0, None, []
        room = self.cap_list[0] / 2 if self.cap_list else 0.0
        for i in small.tolist():
            if acc_members and acc_len + self.lens_list[i] > room:
                lens.append(acc_len)
                rows.append(acc_row)
                members.append(acc_members)
                acc_t, acc_len, acc_row, acc_members = 0.0, 0.0, None, []
            acc_t += self.C_rows[i][0]
            acc_len += self.lens_list[i]
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
        C = np.array(rows).reshape(len(rows), len(self.cap))
        return Items(self.models, np.array(lens, dtype=np.float64), C, members, self.strategy)

    def group(self, c: int, items) -> GroupSolution:
        items = list(items)
        seqs = sorted(s for i in items for s in self.members[i])
        return GroupSolution(int(self.degrees[c]), seqs, self.group_time(c, items), self.rc[c])

    def group_time(self, c: int, items) -> float:
        items = list(items)
        return float(self.alpha[c] + self.C[items, c].sum()) if items else 0.0

    def micro_batch(self, groups: list[GroupSolution]) -> MicroBatchSolution:
        slowest = max((g.time_s for g in groups), default=0.0)
        return MicroBatchSolution(groups=groups, time_s=self.cost.micro_batch_time(slowest), slowest_s=slowest)

    def step(self, mbs: list[MicroBatchSolution], method: str) -> StepSolution:
        """One phase, the micro-batches slowest last: the gradient sync then hides behind the longest backward."""
        mbs = sorted(mbs, key=lambda m: m.slowest_s)
        return StepSolution(phases=[Phase(self.strategy, mbs)], method=method,
                            time_s=self.cost.step_time([m.slowest_s for m in mbs]))

    def best_times(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(fastest time, least device-seconds) of each item over the classes that hold it (inf if none)."""
        fit = self.fit[idx]
        t = np.where(fit, self.alpha[None, :] + self.C[idx], np.inf).min(axis=1)
        area = np.where(fit, self.degrees[None, :] * self.C[idx], np.inf).min(axis=1)
        return t, area

    def lower_bound(self, idx: np.ndarray) -> float:
        """Of the slowest group's time: max(fastest time of the slowest item, device-seconds / N),
        and no less than the busy floor (below it nothing gains)."""
        t, area = self.best_times(idx)
        return max(float(t.max(initial=0.0)), float(area.sum()) / self.N + float(self.alpha.min()), self.floor)

    def slowest_item_s(self, idx: np.ndarray) -> float:
        """The time of the slowest item alone in its fastest class that holds it: no group that
        runs it is quicker."""
        return float(self.best_times(idx)[0].max(initial=0.0))


def fluid_bound(options: list[tuple[np.ndarray, np.ndarray]], N: int, fixed: float = 0.0) -> float:
    """The smallest T such that every sequence has an option (time t <= T, device-seconds a) and
    the chosen device-seconds fit N (T - fixed): options is one (t, a) pair of (n, k) arrays per
    item set (strategy); `fixed`, the least fixed cost any group pays (every device of a group
    spends it, so no device computes sequences for more than T - fixed)."""
    t = np.concatenate([o[0] for o in options], axis=1)
    area = np.concatenate([o[1] for o in options], axis=1)

    def fits(target: float) -> bool:
        return float(np.where(t <= target, area, np.inf).min(axis=1).sum()) <= N * (target - fixed)

    lo = float(t.min(axis=1).max())
    hi = max(lo, float(area.min(axis=1).sum()) / N + fixed)
    if not np.isfinite(hi):
        return math.inf
    while not fits(hi):
        lo, hi = hi, 2 * hi
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def item_options(b: Items) -> tuple[np.ndarray, np.ndarray]:
    """(time, device-seconds) of every item in every class that holds it (inf elsewhere)."""
    return (np.where(b.fit, b.alpha[None, :] + b.C, np.inf),
            np.where(b.fit, b.degrees[None, :] * b.C, np.inf))


def step_lower_bound(b: Items) -> float:
    """No step plan under this strategy is faster: the relaxation where every sequence runs at a
    degree that finishes it within T, the devices are shared fluidly (device-seconds <= N * T), and
    memory binds only each sequence alone (so a batch that memory cuts into micro-batches is bounded
    loosely). The smallest such T, as one micro-batch (splitting only adds ZeRO traffic), plus the
    gradient sync and the optimizer."""
    return b.cost.step_time([fluid_bound([item_options(b)], b.N, float(b.alpha.min()))])


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
