"""Which LLM pipeline rank encodes which images, and when: the Optimus placement that runs.

The runtime (`runtime/vlm_pipeline.py`) and the simulator (`adapt/optimus.py`) share this
placement. Every pipeline rank (a group of the stage's devices) holds a replica of the encoder.
Rank r encodes a_{r,j} whole images of micro-batch j:

  - forward: one encoder pass per micro-batch it serves, in micro-batch order, back to back from
    the step's start -S, all before its first LLM forward (its warm-up bubble); pass j must end
    by D_j (stage 0's forward of j starts at D_j + hop: the hand-off of j's image tokens);
  - backward: the same passes in micro-batch order from the end of its last LLM backward (its
    cool-down bubble), pass j starting no earlier than R_j (stage 0's backward of j ended and
    sent the image tokens' gradient back); the step ends at T + E.

With f(a), b(a) the seconds of an encoder forward / backward pass of a images on a rank group
(`PassTime`: the encoder's plan priced for a pass of that many images per device, so a pass
that re-gathers ZeRO-3 parameters pays for it however few images it holds) and w_r, c_r the
start of rank r's first LLM forward and the end of its last LLM backward in the LLM's simulated
1F1B timeline (makespan T):
    S = max(0, max_{r, j: a_rj > 0} (sum_{i <= j} f(a_ri) - min(D_j, w_r)))
    E = max(0, max_r y_r - T),  y_r = the end of r's last backward pass, where pass j starts at
        max(end of the previous pass, c_r, R_j) and takes b(a_rj).
The LLM's own timeline is untouched: encoder work runs only where its rank would idle, inside
the step stretched by S at the start and E at the end.

Choosing a_{r,j}: for a trial (S, E), micro-batches in order are water-filled (images treated as
divisible, a pass as its fixed part plus a linear part per image: `PassTime.fixed`, `.per_image`)
onto the ranks whose backward pass would start earliest, each rank taking no more
than both of its windows still hold and no more images in all than its memory holds; the smallest E for each S is found by bisection, S + E is
minimised by golden-section search over S, and the best split is rounded to whole images per
micro-batch (largest remainders; also in whole passes of a rank group's width, kept when faster)
and priced exactly by the formulas above. `refine` then moves images between ranks while the
exact price drops (Optimus refines its chosen plan's placement this way), and `exact` solves the
placement as a mixed-integer programme (HiGHS, a deterministic node limit: every rank that plans
gets the same placement), proving it optimal or bounding how far it may be. No torch import.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

EPS = 1e-12


@dataclass(frozen=True)
class PassTime:
    """Seconds of one encoder pass of `a` images on a rank group of `width` devices sharing them.

    Without a table: fixed + a * per_image (a > 0). With `table` (the seconds of a pass with
    k = 1, 2, ... images on each device, from the encoder's plan priced at that micro-batch):
    table[ceil(a / width) - 1], beyond its end per_image more for each further image (the
    slowest device of the pass holds ceil(a / width) images). `fixed` and `per_image` are also
    what the placement search (`_split`) uses as the pass's linear model."""

    per_image: float
    fixed: float = 0.0
    table: tuple[float, ...] = ()
    width: int = 1

    def __call__(self, a: float) -> float:
        if a <= 0:
            return 0.0
        if not self.table:
            return self.fixed + a * self.per_image
        k = math.ceil(a / self.width - 1e-9)
        if k <= len(self.table):
            return self.table[k - 1]
        return self.table[-1] + (k - len(self.table)) * self.width * self.per_image

    def least_per_image(self) -> float:
        """No pass costs less than this per image it holds."""
        rates = [t / (k * self.width) for k, t in enumerate(self.table, 1)]
        return min(rates + [self.per_image]) if self.table else self.per_image

    @classmethod
    def from_table(cls, table, width: int) -> "PassTime":
        """The table's pass times, modelled for the search as the marginal seconds per image
        between its first and last entry plus what a one-image-per-device pass costs beyond that."""
        table = tuple(float(t) for t in table)
        per = (table[-1] - table[0]) / ((len(table) - 1) * width) if len(table) > 1 else table[0] / width
        per = max(per, 0.0)
        return cls(per, max(0.0, table[0] - width * per), table, width)


def least_extra(windows: "PipelineWindows", images: list[int], f, b) -> float:
    """A lower bound on S + E for micro-batches of `images` images: rank r's passes fit in
    [-S, w_r] and [c_r, T + E], so pp (S + E) + sum_r (w_r + T - c_r) >= the encoder work. That
    work is no less than every image at the lowest seconds per image of any pass (on any rank),
    nor than one pass of one image (the cheapest pass) per micro-batch that has images, forward
    and backward."""
    w = windows
    pp = len(w.warm)
    total, passes = sum(images), sum(1 for a in images if a > 0)
    work = sum(max(total * min(p.least_per_image() for p in ps), passes * min(p(1) for p in ps))
               for ps in (rank_passes(f, pp), rank_passes(b, pp)))
    room = sum(max(0.0, a) + max(0.0, w.horizon - c) for a, c in zip(w.warm, w.cool))
    return max(0.0, (work - room) / len(w.warm))


def _as_pass(x) -> PassTime:
    return x if isinstance(x, PassTime) else PassTime(float(x))


def rank_passes(x, pp: int) -> list[PassTime]:
    """Each pipeline rank's `PassTime`: one for all (a `PassTime` or seconds per image), or one per
    rank (a sequence: ranks whose encoder replicas recompute differently pass at different speeds)."""
    if isinstance(x, (list, tuple)):
        if len(x) != pp:
            raise ValueError(f"{len(x)} pass times for {pp} pipeline ranks")
        return [_as_pass(v) for v in x]
    return [_as_pass(x)] * pp


def rank_limits(limit, pp: int) -> list[float]:
    """Each pipeline rank's most images (None: no limit; an int for all; a sequence, one per rank)."""
    if limit is None:
        return [math.inf] * pp
    if isinstance(limit, (list, tuple)):
        if len(limit) != pp:
            raise ValueError(f"{len(limit)} image limits for {pp} pipeline ranks")
        return [math.inf if v is None else v for v in limit]
    return [limit] * pp


@dataclass(frozen=True)
class EncoderPass:
    rank: int
    kind: str  # "EF" (encoder forward) or "EB" (encoder backward)
    micro_batch: int
    images: int
    start: float
    end: float


@dataclass(frozen=True)
class BubbleAssignment:
    counts: tuple[tuple[int, ...], ...]  # [pipeline rank][micro-batch] whole images encoded
    shift_s: float  # S
    extension_s: float  # E
    passes: tuple[EncoderPass, ...]

    @property
    def images_per_rank(self) -> tuple[int, ...]:
        return tuple(sum(row) for row in self.counts)


@dataclass(frozen=True)
class PipelineWindows:
    """The LLM pipeline's timeline as the encoder placement sees it (seconds)."""

    warm: tuple[float, ...]  # w_r: rank r's first LLM forward starts
    cool: tuple[float, ...]  # c_r: rank r's last LLM backward ends
    deadlines: tuple[float, ...]  # D_j
    releases: tuple[float, ...]  # R_j
    horizon: float  # T

    @classmethod
    def from_events(cls, events, pp: int, m: int, horizon: float, hop: float = 0.0) -> "PipelineWindows":
        """From `cost.schedule.simulate` events (kind "F"/"B", stage, micro_batch, start, end)."""
        first = {(e.kind, e.micro_batch): e for e in events if e.stage == 0}
        warm = tuple(min(e.start for e in events if e.stage == r and e.kind == "F") for r in range(pp))
        cool = tuple(max(e.end for e in events if e.stage == r and e.kind == "B") for r in range(pp))
        return cls(warm, cool, tuple(first["F", j].start - hop for j in range(m)),
                   tuple(first["B", j].end + hop for j in range(m)), horizon)


def price(windows: PipelineWindows, counts, f, b) -> BubbleAssignment:
    """S, E and the encoder passes of a whole-image assignment (the module docstring's formulas);
    f, b: `PassTime`s or seconds per image, one for every rank or one per rank (`rank_passes`)."""
    w = windows
    fs, bs = rank_passes(f, len(w.warm)), rank_passes(b, len(w.warm))
    shift = 0.0
    for r, row in enumerate(counts):
        done = 0.0
        for j, a in enumerate(row):
            if a:
                done += fs[r](a)
                shift = max(shift, done - min(w.deadlines[j], w.warm[r]))
    passes, end = [], w.horizon
    for r, row in enumerate(counts):
        t, y = -shift, w.cool[r]
        for j, a in enumerate(row):
            if a:
                passes.append(EncoderPass(r, "EF", j, a, t, t + fs[r](a)))
                t += fs[r](a)
                start = max(y, w.releases[j])
                y = start + bs[r](a)
                passes.append(EncoderPass(r, "EB", j, a, start, y))
        end = max(end, y)
    return BubbleAssignment(tuple(tuple(row) for row in counts), shift, end - w.horizon, tuple(passes))


def assign(windows: PipelineWindows, images: list[int], f, b, limit=None) -> BubbleAssignment | None:
    """Whole images of each micro-batch to pipeline ranks, S + E as small as the search finds
    (module docstring); f, b: `PassTime`s or seconds per image, one for all ranks or one per rank
    (`rank_passes`); `limit`: the most images a rank may encode in a step (its memory holds their
    activations from forward to backward), one for all ranks or one per rank (`rank_limits`).
    None when the limits leave too few places."""
    w = windows
    pp, m = len(w.warm), len(images)
    pfs, pbs = rank_passes(f, pp), rank_passes(b, pp)
    total = sum(images)
    if total == 0:
        return price(w, [[0] * m for _ in range(pp)], pfs, pbs)
    limits = rank_limits(limit, pp)
    # Rounding to whole images adds at most one image per micro-batch to a rank's divisible share.
    caps = [max(0.0, min(total, lim - m)) for lim in limits]
    if sum(caps) < total:
        return None
    # Every rank encoding up to its cap before the first deadline and after the last release is
    # feasible: these bounds hold the search.
    s_hi = max(p.per_image * c + m * p.fixed for p, c in zip(pfs, caps)) + max(0.0, -min(w.deadlines)) + EPS
    e_hi = max(p.per_image * c + m * p.fixed for p, c in zip(pbs, caps)) + max(0.0, max(w.releases) - w.horizon) + EPS
    work = max(p.per_image for p in pfs) * total / pp + max(p.per_image for p in pbs) * total / pp
    tol = 1e-4 * max(w.horizon, work, EPS)  # 0.3 ms on a 3 s step
    split_of = lambda s, e: _split(w, images, pfs, pbs, s, e, caps)  # noqa: E731

    def smallest(lo: float, hi: float, ok) -> float:
        if ok(lo):
            return lo
        while hi - lo > tol:
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if ok(mid) else (mid, hi)
        return hi

    known: list[tuple[float, float]] = []  # (S, E*(S)) found so far

    def e_star(s: float) -> float:
        """The smallest E for S = s. A larger S only leaves more room, so E*(S) does not grow
        with S: the values found at neighbouring S bracket it (checked, as the placement is a
        heuristic; the bracket falls back to the bound that always holds)."""
        ok = lambda e: split_of(s, e) is not None  # noqa: E731
        lo = max((e for t, e in known if t >= s), default=0.0)
        hi = min((e for t, e in known if t <= s), default=e_hi)
        if hi < e_hi and not ok(hi):
            lo, hi = hi, e_hi
        e = smallest(min(lo, hi), hi, ok)
        known.append((s, e))
        return e

    s_min = smallest(0.0, s_hi, lambda s: split_of(s, e_hi) is not None)
    e_min = e_star(s_min)
    best = (s_min + e_min, s_min)
    lo, hi = s_min, s_min + best[0] - s_min  # a larger S than S_min + E*(S_min) cannot win
    ratio = (math.sqrt(5) - 1) / 2
    a, c = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fc = a + e_star(a), c + e_star(c)
    while hi - lo > 4 * tol:  # S to about 1 ms on a 3 s step; E* for it exact to tol
        if fa <= fc:
            hi, c, fc = c, a, fa
            a = hi - ratio * (hi - lo)
            fa = a + e_star(a)
        else:
            lo, a, fa = a, c, fc
            c = lo + ratio * (hi - lo)
            fc = c + e_star(c)
    for value, s in ((fa, a), (fc, c)):
        if value < best[0]:
            best = (value, s)
    s = best[1]
    split = split_of(s, e_star(s))
    placed = price(w, _whole_images(split, images), pfs, pbs)
    width = max(p.width for p in pfs)
    if width > 1:  # also rounded to whole passes of the group's width, when that fits and is faster
        quantised = price(w, _whole_images(split, images, width), pfs, pbs)
        if (all(k <= lim for k, lim in zip(quantised.images_per_rank, limits))
                and quantised.shift_s + quantised.extension_s < placed.shift_s + placed.extension_s):
            placed = quantised
    return placed


def _split(w: PipelineWindows, images, pfs: list[PassTime], pbs: list[PassTime], s: float, e: float,
           limits: list[float]):
    """Divisible images per (rank, micro-batch) that keep every pass inside its windows for a
    start shift s and an end extension e, and every rank r within limits[r] images, or None.
    Micro-batches in order; each one water-filled onto the ranks whose backward pass would start
    earliest (level L: rank r takes min(cap_r, max(0, (L - z_r - g_b) / b_r)) images, a pass
    costing its fixed part g plus the linear part). (`assign` calls it hundreds of times: plain
    loops over the ranks.)"""
    pp = len(w.warm)
    f = [p.per_image for p in pfs]
    b = [p.per_image for p in pbs]
    gf = [p.fixed for p in pfs]
    gb = [p.fixed for p in pbs]
    held = [0.0] * pp
    x = [-s] * pp  # forward cursor
    y = list(w.cool)  # backward cursor
    end = w.horizon + e
    by_backward = all(v > 0 for v in b)
    units = b if by_backward else [v if v > 0 else 1.0 for v in f]
    ranks = range(pp)
    out = [[0.0] * len(images) for _ in ranks]
    for j, need in enumerate(images):
        if need <= 0:
            continue
        release, deadline = w.releases[j], w.deadlines[j]
        z = [(yr if yr > release else release) + g for yr, g in zip(y, gb)]  # where r's pass of j starts its images
        cap = [0.0] * pp
        total = 0.0
        for r in ranks:
            room_f = min(deadline, w.warm[r]) - x[r] - gf[r]
            room_b = end - z[r]
            fwd = room_f / f[r] if f[r] > 0 else (math.inf if room_f >= 0 else 0.0)
            bwd = room_b / b[r] if b[r] > 0 else (math.inf if room_b >= 0 else 0.0)
            c = min(fwd, bwd, need, limits[r] - held[r])
            if c > 0:
                cap[r] = c
                total += c
        if total < need * (1 - 1e-9):
            return None
        level_of = z if by_backward else [v + g for v, g in zip(x, gf)]
        take = _water_fill(level_of, cap, need, units)
        for r, a in enumerate(take):
            if a > 0:
                out[r][j] = a
                held[r] += a
                x[r] += gf[r] + a * f[r]
                y[r] = z[r] + a * b[r]
    return out


def _water_fill(level, cap, need: float, units) -> list[float]:
    """a_r = min(cap_r, max(0, (L - level_r) / units_r)) with sum a_r = need (sum cap_r >= need)."""
    events = []
    for z, c, u in zip(level, cap, units):
        if c > 0:
            events.append((z, 1.0 / u))
            events.append((z + c * u, -1.0 / u))
    events.sort()
    got, slope, prev = 0.0, 0.0, events[0][0]
    mark = events[-1][0]
    for at, step in events:
        nxt = got + slope * (at - prev)
        if nxt >= need:
            mark = prev + (need - got) / slope
            break
        got, prev, slope = nxt, at, slope + step
    return [min(c, max(0.0, (mark - z) / u)) if c > 0 else 0.0 for z, c, u in zip(level, cap, units)]


def refine(windows: PipelineWindows, placed: BubbleAssignment, f, b, limit=None,
           max_prices: int = 3000) -> BubbleAssignment:
    """Improve a placement by moving images between ranks, a pass's width at a time (`PassTime
    .width`, one image for a plain per-image time): of micro-batch j, from rank a to rank c,
    kept when the exact price's S + E drops and c stays within its limit (`assign`'s f, b and
    `limit`); rounds over all moves until none helps or `max_prices` placements were priced.
    Never worse than `placed`."""
    counts = [list(row) for row in placed.counts]
    pp, m = len(counts), len(counts[0]) if counts else 0
    pf, pb = rank_passes(f, pp), rank_passes(b, pp)
    limits = rank_limits(limit, pp)
    unit = max(1, max(p.width for p in pf))
    best, value, priced = placed, placed.shift_s + placed.extension_s, 0
    improved = True
    while improved and priced < max_prices:
        improved = False
        for j in range(m):
            for a in range(pp):
                for c in range(pp):
                    if a == c or counts[a][j] == 0:
                        continue
                    # A whole pass's width, or the part of a's pass that fills none.
                    for move in {min(unit, counts[a][j]), counts[a][j] % unit or unit}:
                        if priced >= max_prices or sum(counts[c]) + move > limits[c]:
                            continue
                        counts[a][j] -= move
                        counts[c][j] += move
                        trial = price(windows, counts, pf, pb)
                        priced += 1
                        if trial.shift_s + trial.extension_s < value - 1e-12:
                            best, value, improved = trial, trial.shift_s + trial.extension_s, True
                            break
                        counts[a][j] += move
                        counts[c][j] -= move
    return best


def _whole_images(split, images, quantum: int = 1) -> list[list[int]]:
    """Round each micro-batch's divisible split to whole images summing to its count (largest
    remainders), in multiples of `quantum` images but for one rank's remainder of the count (a
    pass of a rank group's width in images keeps every device busy; `PassTime.table`)."""
    pp = len(split)
    counts = [[0] * len(images) for _ in range(pp)]
    for j, need in enumerate(images):
        shares = [split[r][j] for r in range(pp)]
        scale = need / sum(shares) if sum(shares) > 0 else 0.0
        units = [a * scale / quantum for a in shares]
        floors = [int(math.floor(u + 1e-9)) for u in units]
        left = need // quantum - sum(floors)
        order = sorted(range(pp), key=lambda r: (-(units[r] - floors[r]), r))
        for r in order[:max(left, 0)]:
            floors[r] += 1
        got = [f * quantum for f in floors]
        rest = need - sum(got)  # < quantum: to the rank whose share it leaves shortest
        if rest:
            got[max(range(pp), key=lambda r: (units[r] * quantum - got[r], -r))] += rest
        for r in range(pp):
            counts[r][j] = got[r]
    return counts


def default_assignment(pp: int, m: int, images_per_micro_batch: int) -> BubbleAssignment:
    """The placement for a pipeline whose times were not priced (a hand-made plan): a uniform
    1F1B pipeline whose stage takes 1 s forward and 2 s backward per micro-batch, and an
    encoder whose micro-batch takes as long as one LLM stage's."""
    from ..cost.schedule import simulate

    sim = simulate("1f1b", [1.0] * pp, [2.0] * pp, m, pp)
    windows = PipelineWindows.from_events(sim.events, pp, m, sim.step_time)
    per = max(images_per_micro_batch, 1)
    return assign(windows, [images_per_micro_batch] * m, 1.0 / per, 2.0 / per)


EXACT_NODE_LIMIT = 100  # branch-and-bound nodes: deterministic (a time limit would differ between ranks)
# The planner solves exactly only placements of at most this many (rank, micro-batch) pairs: on
# this project's 2-core machine 32 pairs (pp 4, 8 micro-batches) take 0.3-0.9 s, 128 take 1-4 s and
# 512 (pp 16, 32 micro-batches) 3-8 s for the root node alone; larger ones keep `refine`'s placement.
EXACT_MAX_PAIRS = 64


@dataclass(frozen=True)
class PlacementProblem:
    """What a placement is chosen from (`assign`, `refine` and `exact` take these)."""

    windows: PipelineWindows
    images: tuple[int, ...]  # per micro-batch
    f: PassTime | tuple[PassTime, ...]  # one for all ranks or one per rank (`rank_passes`)
    b: PassTime | tuple[PassTime, ...]
    limit: int | tuple[int, ...] | None = None  # the most images a rank may encode in a step (`rank_limits`)

    def solve(self, node_limit: int | None = EXACT_NODE_LIMIT) -> "ExactPlacement | None":
        return exact(self.windows, list(self.images), self.f, self.b, self.limit, node_limit)


@dataclass(frozen=True)
class ExactPlacement:
    placed: BubbleAssignment
    bound_s: float  # no placement has S + E below this (the MILP's dual bound)
    optimal: bool  # the MILP proved `placed` optimal


def exact(windows: PipelineWindows, images: list[int], f, b, limit=None,
          node_limit: int | None = EXACT_NODE_LIMIT) -> ExactPlacement | None:
    """The placement minimising S + E as a mixed-integer programme (HiGHS through scipy), exact
    for the module docstring's formulas; None when none is found within `node_limit` nodes (None:
    no limit, solved to proven optimality however long it takes). f, b and `limit` as `assign`
    takes them (per rank or for all).

    Variables: a_rj whole images of micro-batch j on rank r; the pass's size as one binary per
    level x_rjk (a pass of at most k width images costs f(k width), b(k width): `PassTime.table`
    is a step function of ceil(a / width)), or, for a pass linear in its images, one binary z_rj
    (the fixed part) and f = fixed z + per_image a; S, E and the end y_rj of rank r's backward
    pass of j. Constraints, for every rank r and micro-batch j:
        sum_r a_rj = images_j,  sum_j a_rj <= limit_r,  a_rj <= width k on the chosen level
        S >= sum_{i <= j} f_ri - min(D_j, w_r)           (forward passes back to back from -S)
        y_rj >= y_r(j-1) + b_rj,  y_rj >= c_r z_rj + b_rj,  y_rj >= R_j z_rj + b_rj
        E >= y_r(m-1) - T
    (the forward constraint of a micro-batch a rank skips is implied by its last pass's, as
    min(D_j, w_r) grows with j). Minimising S + E makes the max in the backward formula tight
    wherever it matters; the result is re-priced by `price`."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    w = windows
    pp, m = len(w.warm), len(images)
    pfs, pbs = rank_passes(f, pp), rank_passes(b, pp)
    limits = rank_limits(limit, pp)
    width = max(1, pfs[0].width)
    stepped = bool(pfs[0].table)
    if any(bool(p.table) != stepped or max(1, p.width) != width for p in pfs + pbs):
        raise ValueError("the ranks' pass times must all be tables of one width, or all linear")
    levels = max(1, max(math.ceil(a / width) for a in images)) if stepped else 1
    fl = [[p(k * width) for k in range(1, levels + 1)] if stepped else [p.fixed] for p in pfs]
    bl = [[p(k * width) for k in range(1, levels + 1)] if stepped else [p.fixed] for p in pbs]
    na, nx = pp * m, pp * m * levels
    ia = lambda r, j: r * m + j  # noqa: E731
    ix = lambda r, j, k: na + (r * m + j) * levels + k  # noqa: E731
    i_s, i_e = na + nx, na + nx + 1
    iy = lambda r, j: na + nx + 2 + r * m + j  # noqa: E731
    n = na + nx + 2 + pp * m
    rows, cols, vals, lo, hi = [], [], [], [], []

    def add(terms, low, high):
        for c, v in terms:
            rows.append(len(lo))
            cols.append(c)
            vals.append(v)
        lo.append(low)
        hi.append(high)

    def seconds(p: list[PassTime], at_level, r, j, sign):  # sign x (the seconds of rank r's pass of j)
        t = [(ix(r, j, k), sign * at_level[r][k]) for k in range(levels)]
        return t if stepped else t + [(ia(r, j), sign * p[r].per_image)]

    for j, need in enumerate(images):
        add([(ia(r, j), 1.0) for r in range(pp)], need, need)
    for r in range(pp):
        if math.isfinite(limits[r]):
            add([(ia(r, j), 1.0) for j in range(m)], -np.inf, limits[r])
        for j, need in enumerate(images):
            on = [(ix(r, j, k), 1.0) for k in range(levels)]
            add(on, -np.inf, 1.0)
            room = [(ix(r, j, k), -float(width * (k + 1) if stepped else need)) for k in range(levels)]
            add([(ia(r, j), 1.0)] + room, -np.inf, 0.0)
            add([(i_s, 1.0)] + [t for i in range(j + 1) for t in seconds(pfs, fl, r, i, -1.0)],
                -min(w.deadlines[j], w.warm[r]), np.inf)
            back = seconds(pbs, bl, r, j, -1.0)
            if j:
                add([(iy(r, j), 1.0), (iy(r, j - 1), -1.0)] + back, 0.0, np.inf)
            for ready in (w.cool[r], w.releases[j]):
                add([(iy(r, j), 1.0)] + back + [(c, -ready * v) for c, v in on], 0.0, np.inf)
        add([(i_e, 1.0), (iy(r, m - 1), -1.0)], -w.horizon, np.inf)
    cost = np.zeros(n)
    cost[[i_s, i_e]] = 1.0
    integral = np.zeros(n)
    integral[:na + nx] = 1
    low = np.zeros(n)
    low[iy(0, 0):] = -np.inf
    high = np.full(n, np.inf)
    high[na:na + nx] = 1.0
    res = milp(cost, constraints=LinearConstraint(coo_matrix((vals, (rows, cols)), shape=(len(lo), n)).tocsr(), lo, hi),
               integrality=integral, bounds=Bounds(low, high),
               options={} if node_limit is None else {"node_limit": node_limit})
    if res.x is None:
        return None
    counts = np.rint(res.x[:na]).astype(int).reshape(pp, m)
    if (counts < 0).any() or list(counts.sum(axis=0)) != list(images):
        return None
    placed = price(w, counts.tolist(), pfs, pbs)
    bound = res.mip_dual_bound if res.mip_dual_bound is not None else 0.0
    return ExactPlacement(placed, max(0.0, float(bound)), bool(res.status == 0))
