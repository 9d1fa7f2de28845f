"""Pipeline schedules as an event simulator: the bubble is computed, not assumed.

A pipeline of `pp` ranks runs `num_micro_batches` (m) micro-batches through `pp * v` model
chunks (v = virtual stages; chunk c lives on rank c % pp). Each chunk has a forward time F_c and
a backward time B_c; zero-bubble splits B_c into an input-gradient part (B) and a weight-gradient
part (W, `wgrad`), which has no successor and so can fill idle time. Dependencies:

    F(i, c) after F(i, c-1) + p2p          (activations arrive from the previous chunk)
    B(i, c) after B(i, c+1) + p2p          (gradients arrive from the next chunk);
    B(i, last) after F(i, last)
    W(i, c) after B(i, c)                  (zero-bubble only)

and a rank runs one operation at a time. Orders per rank:

- GPipe: all forwards, then all backwards.
- 1F1B (PipeDream-flush): rank r runs `pp - r - 1` warm-up forwards, then alternates F and B,
  then drains the backwards.
- Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): forwards visit the rank's v chunks in
  groups of `pp` micro-batches; warm-up is `2 (pp - r - 1) + (v - 1) pp` chunk-forwards; needs
  m % pp == 0.
- Zero-bubble ZB-H1 (Qi et al. 2024): a greedy rank runs a ready B first, else the next F while it
  holds fewer than `pp - r` un-backwarded and fewer than `pp` un-weight-graded micro-batches, else
  a pending W; Ws thus fill the warm-up and drain bubbles, with peak memory at most that of 1F1B's
  first rank (`pp` micro-batches).

Fixed orders are solved exactly in one pass (start = max(rank free, dependencies ready)); the
greedy zero-bubble rank is simulated in time order. `bubble_fraction` is the idle share of the
busiest rank: for equal stages 1F1B and GPipe give (pp-1)/(m+pp-1), interleaving divides the
bubble by about v, and zero-bubble is smaller than 1F1B.

`in_flight(...)` gives, in closed form, the peak number of micro-batches whose activations a rank
holds (chunk units / v); the simulator's `peak_in_flight` checks it.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


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
    events: tuple[Event, ...]
    busy: tuple[float, ...]  # seconds each rank computes
    # Peak count of (micro-batch, chunk) activations a rank holds at once: an F starts holding,
    # the B (or W for zero-bubble) that consumes it releases.
    peak_in_flight: tuple[int, ...]


def in_flight(schedule: str, pp: int, rank: int, num_micro_batches: int, virtual_stages: int = 1) -> float:
    """Peak micro-batches of activations held by pipeline rank `rank` (in units of its whole stage).

    GPipe m; 1F1B min(pp - r, m); interleaved min(2 (pp - r - 1) + (v - 1) pp + 1, m v) / v;
    zero-bubble min(pp, m) (Ws are deferred, so later ranks hold up to pp like rank 0 of 1F1B).
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


def _orders(schedule: str, pp: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """Per rank, the ordered list of (kind, micro_batch, chunk) for the fixed-order schedules."""
    orders = []
    for r in range(pp):
        if schedule == "gpipe":
            ops = [("F", i, r) for i in range(m)] + [("B", i, r) for i in range(m)]
        elif schedule == "1f1b" or (schedule == "interleaved_1f1b" and v == 1):
            warm = min(pp - r - 1, m)
            ops = [("F", i, r) for i in range(warm)]
            for i in range(m - warm):
                ops += [("F", warm + i, r), ("B", i, r)]
            ops += [("B", i, r) for i in range(m - warm, m)]
        else:  # interleaved: unit k -> (micro-batch, local chunk)
            n = m * v

            def unit(k: int, forward: bool) -> tuple[int, int]:
                group, within = divmod(k, pp * v)
                local = within // pp
                if not forward:
                    local = v - 1 - local
                return group * pp + within % pp, local * pp + r

            warm = min(2 * (pp - r - 1) + (v - 1) * pp, n)
            ops = [("F", *unit(k, True)) for k in range(warm)]
            for k in range(n - warm):
                ops += [("F", *unit(warm + k, True)), ("B", *unit(k, False))]
            ops += [("B", *unit(k, False)) for k in range(n - warm, n)]
        orders.append(ops)
    return orders


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
    if pp == 1:
        schedule = "1f1b"  # one rank: every schedule is forward, backward, forward, ...
    if schedule == "zero_bubble":
        w = list(wgrad) if wgrad is not None else [b / 2 for b in bwd]
        events = _simulate_zero_bubble(list(fwd), list(bwd), w, m, pp, hop)
    else:
        events = _simulate_fixed(_orders(schedule, pp, m, v), list(fwd), list(bwd), m, chunks, hop)
    step = max(e.end for e in events)
    busy = [0.0] * pp
    for e in events:
        busy[e.stage] += e.end - e.start
    return ScheduleResult(step_time=step, bubble_fraction=1.0 - max(busy) / step if step > 0 else 0.0,
                          events=tuple(events), busy=tuple(busy),
                          peak_in_flight=_peak_in_flight(events, pp, schedule == "zero_bubble" and pp > 1))


def _simulate_fixed(orders, fwd, bwd, m, chunks, hop) -> list[Event]:
    pp = len(orders)
    end: dict[tuple[str, int, int], float] = {}
    free = [0.0] * pp
    pos = [0] * pp
    events: list[Event] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                kind, i, c = orders[r][pos[r]]
                if kind == "F":
                    dep = 0.0 if c == 0 else end.get(("F", i, c - 1))
                    dep = dep if c == 0 or dep is None else dep + hop
                    dur = fwd[c]
                else:
                    dep = end.get(("F", i, c)) if c == chunks - 1 else end.get(("B", i, c + 1))
                    dep = dep if dep is None or c == chunks - 1 else dep + hop
                    dur = bwd[c]
                if dep is None:
                    break
                start = max(free[r], dep)
                free[r] = end[(kind, i, c)] = start + dur
                events.append(Event(r, kind, i, c, start, start + dur))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked")  # an ordering bug, never user input
    return events


def _simulate_zero_bubble(fwd, bwd, wgrad, m, pp, hop) -> list[Event]:
    """ZB-H1 greedy: at each moment an idle rank runs a ready B, else an admissible F, else a W."""
    bonly = [max(b - w, 0.0) for b, w in zip(bwd, wgrad)]
    inf = float("inf")
    f_ready = [[0.0 if r == 0 else inf] * m for r in range(pp)]  # when F(i) may start on rank r
    b_ready = [[inf] * m for _ in range(pp)]
    next_f, next_b, w_done = [0] * pp, [0] * pp, [0] * pp
    w_queue: list[list[int]] = [[] for _ in range(pp)]
    free = [0.0] * pp
    times: list[float] = []
    events: list[Event] = []
    total = 3 * m * pp

    def start_next(r: int, t: float) -> bool:
        if next_b[r] < m and b_ready[r][next_b[r]] <= t:
            i = next_b[r]
            next_b[r] += 1
            kind, dur = "B", bonly[r]
            w_queue[r].append(i)
            if r > 0:
                b_ready[r - 1][i] = t + dur + hop
                heapq.heappush(times, t + dur + hop)
        elif (next_f[r] < m and f_ready[r][next_f[r]] <= t and next_f[r] - next_b[r] < pp - r
              and next_f[r] - w_done[r] < pp):
            i = next_f[r]
            next_f[r] += 1
            kind, dur = "F", fwd[r]
            if r + 1 < pp:
                f_ready[r + 1][i] = t + dur + hop
                heapq.heappush(times, t + dur + hop)
            else:
                b_ready[r][i] = t + dur
        elif w_queue[r]:
            i = w_queue[r].pop(0)
            w_done[r] += 1
            kind, dur = "W", wgrad[r]
        else:
            return False
        free[r] = t + dur
        heapq.heappush(times, t + dur)
        events.append(Event(r, kind, i, r, t, t + dur))
        return True

    t = 0.0
    while len(events) < total:
        progressed = True
        while progressed:  # several operations may start at the same instant
            progressed = False
            for r in range(pp):
                if free[r] <= t:
                    progressed |= start_next(r, t)
        while times and times[0] <= t:
            heapq.heappop(times)
        if not times:
            if len(events) < total:
                raise RuntimeError("zero-bubble simulation stalled")  # a policy bug, never user input
            break
        t = heapq.heappop(times)
    return events


def _peak_in_flight(events: list[Event], pp: int, release_on_w: bool) -> tuple[int, ...]:
    release = "W" if release_on_w else "B"
    peaks = []
    for r in range(pp):
        # At equal times a release happens before an acquire (memory is freed, then reused).
        marks = sorted((e.start, 1, 1) if e.kind == "F" else (e.end, 0, -1)
                       for e in events if e.stage == r and e.kind in ("F", release))
        level = peak = 0
        for _, _, delta in marks:
            level += delta
            peak = max(peak, level)
        peaks.append(peak)
    return tuple(peaks)
