"""Pipeline schedules as an event simulator: the bubble is computed, not assumed.

A pipeline of `pp` ranks runs `num_micro_batches` (m) micro-batches through `pp * v` model
chunks (v = virtual stages; chunk c lives on rank c % pp). Each chunk has a forward time F_c and
a backward time B_c; zero-bubble splits B_c into an input-gradient part (B) and a weight-gradient
part (W, `wgrad`), which has no successor and so can fill idle time. Dependencies:

    F(i, c) after F(i, c-1) + p2p          (activations arrive from the previous chunk)
    B(i, c) after B(i, c+1) + p2p          (gradients arrive from the next chunk);
    B(i, last) after F(i, last)
    W(i, c) after B(i, c)                  (zero-bubble only)

and a rank runs its operations one at a time in a fixed order, the order of the
`torch.distributed.pipelining` schedule the runtime uses for the plan:

- GPipe (`ScheduleGPipe`): all forwards, then all backwards.
- 1F1B (`Schedule1F1B`, PipeDream-flush): rank r runs `pp - r - 1` warm-up forwards, then
  alternates F and B, then drains the backwards.
- Interleaved 1F1B (`ScheduleInterleaved1F1B`; Narayanan et al. 2021): forwards visit the rank's v
  chunks in groups of `pp` micro-batches; warm-up is `2 (pp - r - 1) + (v - 1) pp` chunk-forwards;
  needs m % pp == 0.
- Zero-bubble (`ScheduleInterleavedZeroBubble` with one chunk per rank; the ZB-H1 idea of Qi et
  al. 2024): warm-up as 1F1B, then F, B and, from the (r+1)-th pair on, the oldest pending W, so
  rank r defers r weight-gradient passes, which fill the drain bubble at its end. A rank holds at
  most `pp` micro-batches of activations, as 1F1B's first rank.

Start of an operation = max(its rank is free, its dependency is done (+ p2p)); end = start +
duration. `bubble_fraction` is the idle share of the busiest rank: for equal stages 1F1B and
GPipe give (pp-1)/(m+pp-1), interleaving divides the bubble by about v.

Speed (`simulate` never needs every event to know the step time):
- GPipe has a closed form. The forwards form a flow shop of identical jobs, so F(i) ends on rank r
  at sum_{q<=r} F_q + r p2p + i max_{q<=r} F_q; each rank then starts its backwards when its last
  forward ends, and the last backward of rank 0 ends at
      max_s [ end of F(m-1) on s + sum_{q<=s} B_q + s p2p + (m - 1) max_{q<=s} B_q ].
- The other schedules repeat a period (Q operations per rank: 2 for 1F1B, 3 for zero-bubble,
  2 pp v for interleaved, advancing the micro-batch by delta = 1, 1, pp). Their order for
  m + delta micro-batches is the order for m with one more period inside the steady phase of
  every rank. So the makespan is simulated for a small m0 (same residue mod delta) and extended:
      T(m) = T(m0) + (m - m0) / delta * Lambda
  when a certificate holds at a time cut tau of the m0-simulation (the operations that start
  before tau, a set closed under dependencies): on every rank the two periods around the cut are
  steady (same operations, micro-batch + delta, dependencies shifted alike), every operation in
  the last period before the cut ends exactly Lambda after its twin one period earlier, and no
  operation at or after that period depends on anything more than two periods before the cut.
  Proof: max-plus is homogeneous (max(a, b) + c = max(a + c, b + c)), so by induction in
  dependency order each inserted period ends Lambda after the one before it, and every operation
  after the insertion ends n Lambda later than its twin in the m0-simulation. If the certificate
  fails (a transient longer than m0), m0 doubles; at m0 >= m the simulation is the whole step.
  Every part is checked against the full simulation in tests/test_cost_schedule.py.
- Events (for the timeline plot) are built only when `ScheduleResult.events` is read.

`in_flight(...)` gives, in closed form, the peak number of micro-batches whose activations a rank
holds (chunk units / v); `peak_in_flight` counts it from the order (an F holds from its start,
the B, or W for zero-bubble, that consumes it releases at its end).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence

import numpy as np

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
_F, _B, _W = 0, 1, 2
_KIND = "FBW"


@dataclass(frozen=True, slots=True)
class Event:
    stage: int
    kind: str  # 'F', 'B' or 'W'
    micro_batch: int
    chunk: int
    start: float
    end: float


@dataclass(frozen=True)
class ScheduleResult:
    step_time: float
    bubble_fraction: float
    busy: tuple[float, ...]  # seconds each rank computes
    # Peak count of (micro-batch, chunk) activations a rank holds at once: an F starts holding,
    # the B (or W for zero-bubble) that consumes it releases.
    peak_in_flight: tuple[int, ...]
    _replay: tuple = field(default=(), repr=False, compare=False)

    @property
    def events(self) -> tuple[Event, ...]:
        """Every operation with its start and end (simulated on first use; cached)."""
        cached = self.__dict__.get("_events")
        if cached is None:
            cached = _events(*self._replay)
            object.__setattr__(self, "_events", cached)
        return cached


def in_flight(schedule: str, pp: int, rank: int, num_micro_batches: int, virtual_stages: int = 1) -> float:
    """Peak micro-batches of activations held by pipeline rank `rank` (in units of its whole stage).

    GPipe m; 1F1B min(pp - r, m); interleaved min(2 (pp - r - 1) + (v - 1) pp + 1, m v) / v;
    zero-bubble min(pp, m) (r deferred Ws after pp - r - 1 warm-up forwards).
    """
    m, v = num_micro_batches, virtual_stages
    if pp == 1:
        return 1.0 if schedule != "gpipe" else float(m)
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(pp - rank, m))
    if schedule == "interleaved_1f1b":
        return min(2 * (pp - rank - 1) + (v - 1) * pp + 1, m * v) / v
    if schedule == "zero_bubble":
        return float(min(pp, m))
    raise ValueError(f"unknown schedule '{schedule}'; known: {', '.join(SCHEDULES)}")


# --- orders ------------------------------------------------------------------------------------
# An operation's id: kind * m * C + micro_batch * C + chunk (C = pp * v chunks).

def _rank_order(schedule: str, pp: int, m: int, v: int, r: int) -> list[tuple[int, int, int]]:
    """Rank r's operations in order, as (kind, micro_batch, chunk)."""
    if schedule == "gpipe":
        return [(_F, i, r) for i in range(m)] + [(_B, i, r) for i in range(m)]
    if schedule == "1f1b" or (schedule == "interleaved_1f1b" and v == 1):
        warm = min(pp - r - 1, m)
        ops = [(_F, i, r) for i in range(warm)]
        for i in range(m - warm):
            ops += [(_F, warm + i, r), (_B, i, r)]
        return ops + [(_B, i, r) for i in range(m - warm, m)]
    if schedule == "zero_bubble":
        warm = min(pp - r - 1, m)
        ops = [(_F, i, r) for i in range(warm)]
        done = 0  # Ws issued, oldest first; the (k+1)-th pair and later carry one (k >= r)
        for k in range(m):
            if warm + k < m:
                ops.append((_F, warm + k, r))
            ops.append((_B, k, r))
            if k >= r:
                ops.append((_W, done, r))
                done += 1
        return ops + [(_W, i, r) for i in range(done, m)]
    n = m * v  # interleaved: unit k -> (micro-batch, chunk)

    def unit(k: int, forward: bool) -> tuple[int, int]:
        group, within = divmod(k, pp * v)
        local = within // pp
        if not forward:
            local = v - 1 - local
        return group * pp + within % pp, local * pp + r

    warm = min(2 * (pp - r - 1) + (v - 1) * pp, n)
    ops = [(_F, *unit(k, True)) for k in range(warm)]
    for k in range(n - warm):
        ops += [(_F, *unit(warm + k, True)), (_B, *unit(k, False))]
    return ops + [(_B, *unit(k, False)) for k in range(n - warm, n)]


@dataclass(frozen=True, eq=False)
class _Structure:
    """Orders and dependencies of one (schedule, pp, m, v), as flat lists for the event loop."""

    pp: int
    m: int
    chunks: int
    order: tuple[list[int], ...]  # per rank, operation ids in order
    kind: np.ndarray  # per id
    mb: np.ndarray
    chunk: np.ndarray
    dep: list[int]  # per id: the operation it waits for (-1: none)
    hop: list[bool]  # whether that wait crosses a pipeline link (p2p)
    rank_of: np.ndarray  # per id (-1: not scheduled)
    pos_of: np.ndarray
    cache: dict = field(default_factory=dict)


@lru_cache(maxsize=64)
def _structure(schedule: str, pp: int, m: int, v: int) -> _Structure:
    C = pp * v
    kinds = 3 if schedule == "zero_bubble" else 2
    n = kinds * m * C
    ids = np.arange(n)
    kind, rest = np.divmod(ids, m * C)
    mb, chunk = np.divmod(rest, C)
    dep = np.full(n, -1)
    hop = np.zeros(n, dtype=bool)
    f = kind == _F
    dep[f & (chunk > 0)] = ids[f & (chunk > 0)] - 1
    hop[f & (chunk > 0)] = True
    b = kind == _B
    last = b & (chunk == C - 1)
    dep[last] = ids[last] - m * C  # F of the same micro-batch and chunk
    inner = b & (chunk < C - 1)
    dep[inner] = ids[inner] + 1
    hop[inner] = True
    w = kind == _W
    dep[w] = ids[w] - m * C  # B of the same micro-batch and chunk
    rank_of = np.full(n, -1)
    pos_of = np.full(n, -1)
    order = []
    for r in range(pp):
        ops = np.array(_rank_order(schedule, pp, m, v, r), dtype=np.int64).reshape(-1, 3)
        g = (ops[:, 0] * m + ops[:, 1]) * C + ops[:, 2]
        rank_of[g] = r
        pos_of[g] = np.arange(len(g))
        order.append(g.tolist())
    return _Structure(pp=pp, m=m, chunks=C, order=tuple(order), kind=kind, mb=mb, chunk=chunk,
                      dep=dep.tolist(), hop=hop.tolist(), rank_of=rank_of, pos_of=pos_of)


def _durations(st: _Structure, fwd, bonly, wgrad) -> list[float]:
    """Seconds of every operation id (kind-major, then micro-batch, then chunk)."""
    out = list(fwd) * st.m + list(bonly) * st.m
    if wgrad is not None:
        out += list(wgrad) * st.m
    return out


def _run(st: _Structure, dur: list[float], hop: float) -> tuple[list[float], list[float]]:
    """Start and end of every operation: each rank takes its next operation as soon as it is free
    and the operation's dependency is done (ranks are swept until all are finished)."""
    start = [0.0] * len(dur)
    end = [-1.0] * len(dur)  # -1: not yet run
    dep, hops = st.dep, st.hop
    pos = [0] * st.pp
    free = [0.0] * st.pp
    left = sum(len(o) for o in st.order)
    while left:
        moved = 0
        for r, order in enumerate(st.order):
            p, t_free, n = pos[r], free[r], len(order)
            while p < n:
                g = order[p]
                d = dep[g]
                if d >= 0:
                    ready = end[d]
                    if ready < 0.0:
                        break
                    if hops[g]:
                        ready += hop
                    if ready > t_free:
                        t_free = ready
                start[g] = t_free
                t_free += dur[g]
                end[g] = t_free
                p += 1
            moved += p - pos[r]
            pos[r], free[r] = p, t_free
        if not moved:
            raise RuntimeError("pipeline schedule deadlocked")  # an ordering bug, never user input
        left -= moved
    return start, end


# --- the step time without every event ---------------------------------------------------------

def _period(schedule: str, pp: int, v: int) -> tuple[int, int]:
    """(operations per period per rank Q, micro-batches a period advances delta)."""
    if schedule == "interleaved_1f1b" and v > 1:
        return 2 * pp * v, pp
    return (3, 1) if schedule == "zero_bubble" else (2, 1)


def _gpipe_makespan(fwd, bwd, m: int, hop: float) -> float:
    """Closed form of the GPipe step (module docstring)."""
    best = 0.0
    sum_f = sum_b = max_f = max_b = 0.0
    for s, (f, b) in enumerate(zip(fwd, bwd)):
        sum_f, sum_b = sum_f + f, sum_b + b
        max_f, max_b = max(max_f, f), max(max_b, b)
        last_forward = sum_f + s * hop + (m - 1) * max_f
        best = max(best, last_forward + sum_b + s * hop + (m - 1) * max_b)
    return best


def _steady_runs(st: _Structure, Q: int, delta: int) -> np.ndarray:
    """Per rank, the longest run [a, b) of positions p whose operation repeats the one at p - Q
    with the micro-batch advanced by delta and its dependency advanced alike (structural: cached
    on the structure)."""
    key = ("runs", Q, delta)
    if key in st.cache:
        return st.cache[key]
    flat = np.concatenate([np.asarray(o, dtype=np.int64) for o in st.order])
    lengths = np.array([len(o) for o in st.order])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    pos = np.arange(len(flat)) - np.repeat(offsets[:-1], lengths)
    ok = pos >= Q
    cur = flat[ok]
    prev = flat[np.flatnonzero(ok) - Q]
    dep = np.asarray(st.dep)
    good = ((st.kind[cur] == st.kind[prev]) & (st.chunk[cur] == st.chunk[prev])
            & (st.mb[cur] == st.mb[prev] + delta))
    dc, dp = dep[cur], dep[prev]
    both = (dc >= 0) & (dp >= 0)
    dcs, dps = np.maximum(dc, 0), np.maximum(dp, 0)
    same_dep = (st.rank_of[dcs] == st.rank_of[dps]) & (st.pos_of[dcs] == st.pos_of[dps] + Q)
    good &= np.where(both, same_dep, (dc < 0) & (dp < 0))
    periodic = np.zeros(len(flat), dtype=bool)
    periodic[np.flatnonzero(ok)] = good
    runs = np.zeros((st.pp, 2), dtype=np.int64)
    for r in range(st.pp):
        padded = np.concatenate([[0], periodic[offsets[r]:offsets[r + 1]].astype(np.int8), [0]])
        edges = np.flatnonzero(np.diff(padded))
        if len(edges):
            k = int(np.argmax(edges[1::2] - edges[::2]))
            runs[r] = edges[2 * k], edges[2 * k + 1]
    st.cache[key] = runs
    return runs


def _extension(st: _Structure, start: list[float], end: list[float], Q: int, delta: int) -> float | None:
    """Lambda of the certificate in the module docstring, or None if it does not hold.

    The certificate with a window of J periods: positions [x - (J-1) Q, x + Q) of every rank are
    steady, no operation at or after x - Q waits on one before x - J Q, and every operation in
    [x - (J-1) Q, x) ends Lambda after its twin one period earlier. (The module docstring states
    it for J = 2; a zero-bubble rank r defers its Ws by r periods, so there J grows with pp: the
    twins of an early dependency are then related through the chain of periods up to the cut.)"""
    runs = _steady_runs(st, Q, delta)
    start_arr, end_arr = np.asarray(start), np.asarray(end)
    orders = [np.asarray(o) for o in st.order]
    starts = [start_arr[o] for o in orders]
    a, b = runs[:, 0], runs[:, 1]
    if np.any(b - a < 2 * Q):
        return None
    lo = max(s[x] for s, x in zip(starts, a + Q - 1))
    hi = min((s[x] if x < len(s) else np.inf) for s, x in zip(starts, b - Q))
    if not lo < hi:
        return None
    tau = hi if np.isfinite(hi) else np.nextafter(lo, np.inf)
    cut = np.array([int(np.searchsorted(s, tau, side="left")) for s in starts])
    scheduled = np.flatnonzero(st.rank_of >= 0)
    period = (st.pos_of[scheduled] - cut[st.rank_of[scheduled]]) // Q  # -1: last period before the cut
    dep = np.asarray(st.dep)[scheduled]
    has = dep >= 0
    dep_period = np.zeros(len(dep), dtype=np.int64)
    dep_period[has] = (st.pos_of[dep[has]] - cut[st.rank_of[dep[has]]]) // Q
    late = has & (period >= -1)  # the last period before the cut and everything after it
    J = max(2, int(-dep_period[late].min()) if late.any() else 0)
    if np.any(cut < a + (J - 1) * Q) or np.any(cut > b - Q):
        return None
    diffs = np.concatenate([end_arr[o[x - (J - 1) * Q:x]] - end_arr[o[x - J * Q:x - Q]]
                            for o, x in zip(orders, cut)])
    lam = float(np.median(diffs))
    if np.max(np.abs(diffs - lam)) > 1e-11 * max(float(end_arr.max()), 1e-300):
        return None
    return lam


def _makespan(schedule: str, fwd, bwd, wgrad, m: int, pp: int, v: int, hop: float) -> float:
    if schedule == "gpipe":
        return _gpipe_makespan(fwd, bwd, m, hop)
    bonly, w = _split_backward(schedule, bwd, wgrad)
    Q, delta = _period(schedule, pp, v)
    # Room for the warm-up, a window of steady periods and the drain (zero-bubble's window spans
    # the pp - 1 Ws the last rank defers).
    m0 = {2: 2 * pp + 8, 3: 4 * pp + 8}.get(Q, 6 * pp)
    while m0 < m:
        runs: dict[int, tuple] = {}
        for cycle in (1, 2):  # a steady state may repeat every other period
            step = cycle * delta
            m1 = m0 + (m - m0) % step  # (m - m1) a whole number of such periods
            if m1 >= m:
                continue
            st = _structure(schedule, pp, m1, v)
            if m1 not in runs:
                runs[m1] = _run(st, _durations(st, fwd, bonly, w), hop)
            start, end = runs[m1]
            lam = _extension(st, start, end, cycle * Q, step)
            if lam is not None:
                return max(end) + (m - m1) // step * lam
        m0 = min(2 * m0, m)
        m0 -= (m0 - m) % delta  # same residue as m (m0 <= m)
    st = _structure(schedule, pp, m, v)
    return max(_run(st, _durations(st, fwd, bonly, w), hop)[1])


def _split_backward(schedule: str, bwd, wgrad):
    """(input-gradient seconds, weight-gradient seconds or None) per chunk."""
    if schedule != "zero_bubble":
        return list(bwd), None
    w = list(wgrad) if wgrad is not None else [b / 2 for b in bwd]
    return [max(b - x, 0.0) for b, x in zip(bwd, w)], w


def _events(schedule, fwd, bwd, wgrad, m, pp, v, hop) -> tuple[Event, ...]:
    st = _structure(schedule, pp, m, v)
    bonly, w = _split_backward(schedule, bwd, wgrad)
    start, end = _run(st, _durations(st, fwd, bonly, w), hop)
    kind, mb, chunk = st.kind.tolist(), st.mb.tolist(), st.chunk.tolist()
    return tuple(Event(r, _KIND[kind[g]], mb[g], chunk[g], start[g], end[g])
                 for r, order in enumerate(st.order) for g in order)


@lru_cache(maxsize=256)
def _peak_in_flight(schedule: str, pp: int, m: int, v: int) -> tuple[int, ...]:
    """Per rank, the most activations held at once, counted along its order (the count repeats
    once every rank is past its warm-up, so 2 pp micro-batches show the peak of any m)."""
    if schedule == "gpipe":
        return (m,) * pp
    m = min(m, 2 * pp)
    release = _W if schedule == "zero_bubble" else _B
    out = []
    for r in range(pp):
        level = peak = 0
        for kind, _, _ in _rank_order(schedule, pp, m, v, r):
            if kind == _F:
                level += 1
                peak = max(peak, level)
            elif kind == release:
                level -= 1
        out.append(peak)
    return tuple(out)


def simulate(schedule: str, fwd: Sequence[float], bwd: Sequence[float], num_micro_batches: int,
             pp: int, virtual_stages: int = 1, p2p: float = 0.0,
             wgrad: Sequence[float] | None = None) -> ScheduleResult:
    """Simulate one step. `fwd`/`bwd` hold per-chunk seconds (pp * virtual_stages chunks, in model
    order); `bwd` includes recompute; `wgrad` is the weight-gradient part of `bwd` that
    zero-bubble runs as a separate W (default: half of `bwd`)."""
    m, v = num_micro_batches, virtual_stages
    chunks = pp * v
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule '{schedule}'; known: {', '.join(SCHEDULES)}")
    if len(fwd) != chunks or len(bwd) != chunks:
        raise ValueError(f"need {chunks} chunk times (pp={pp} x virtual_stages={v}), got {len(fwd)} and {len(bwd)}")
    if m < 1 or pp < 1 or v < 1:
        raise ValueError("micro-batches, pipeline degree and virtual stages must be >= 1")
    if v > 1 and schedule != "interleaved_1f1b":
        raise ValueError("virtual_stages > 1 needs schedule interleaved_1f1b")
    if schedule == "interleaved_1f1b" and v > 1 and m % pp:
        raise ValueError(f"interleaved 1F1B needs the micro-batch count ({m}) to be a multiple of pp ({pp})")
    hop = p2p if pp > 1 else 0.0
    if pp == 1 and v == 1:
        schedule = "1f1b"  # one rank: every schedule is forward, backward, forward, ...
    if schedule == "interleaved_1f1b" and v == 1:
        schedule = "1f1b"  # the same order
    fwd, bwd = [float(x) for x in fwd], [float(x) for x in bwd]
    wg = [float(x) for x in wgrad] if wgrad is not None and schedule == "zero_bubble" else None
    busy = [0.0] * pp
    for c in range(chunks):
        busy[c % pp] += m * (fwd[c] + bwd[c])
    step = m * (fwd[0] + bwd[0]) if chunks == 1 else _makespan(schedule, fwd, bwd, wg, m, pp, v, hop)
    return ScheduleResult(step_time=step, bubble_fraction=1.0 - max(busy) / step if step > 0 else 0.0,
                          busy=tuple(busy), peak_in_flight=_peak_in_flight(schedule, pp, m, v),
                          _replay=(schedule, tuple(fwd), tuple(bwd), None if wg is None else tuple(wg), m, pp, v, hop))
