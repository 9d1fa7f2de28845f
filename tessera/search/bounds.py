"""Lower bounds on the step of a (context, split) and the partition search that uses them.

A mixin of the planner's search (planner._Search): it reads the search's candidates, caches and
memory budget. Every bound here is valid — no plan of the space that the bound covers has a
shorter step — which is what lets the planner skip what cannot win (planner.py, Exactness).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..cost.layer import StepContext, pipeline_p2p_time
from ..cost.memory import required_memory
from ..cost.schedule import in_flight, simulate
from .partition import balanced_stages, min_max_partition
from .space import lower_hull, lp_time_bound


@dataclass(order=True)
class Context:
    """One outer choice. `bubble`: micro-batch passes the schedule adds to the critical path of
    equal stages (pp - 1 for GPipe/1F1B, (pp - 1) / v interleaved, about (pp - 1) / 3 for
    zero-bubble); the rank program weighs per-micro-batch time by m + bubble, as the makespan
    (m + bubble) (F + B) of balanced stages does, against once-per-step time."""

    estimate: float
    pp: int = field(compare=False)
    m: int = field(compare=False)
    schedule: str = field(compare=False)
    v: int = field(compare=False)
    bubble: float = field(compare=False, default=0.0)


class SplitBounds:
    """Bounds of splits (a mixin of planner._Search)."""

    # --- lower bounds -----------------------------------------------------------------------------
    def _paths(self, c: Context, cands) -> tuple[np.ndarray, float]:
        """(P, hop): P[s] = fastest forward of layers [0, s), plus their fastest full backward except
        for zero-bubble (its ranks end with deferred Ws, which may overlap the drain); hop = p2p."""
        key = (self.world // c.pp, c.m, c.schedule == "zero_bubble")
        if key not in self.paths:
            f = {k: x.fastest["fwd"] for k, x in cands.items()}
            b = {k: x.fastest["bwd"] for k, x in cands.items()}
            drain = c.schedule != "zero_bubble"
            per = [f[k] + (b[k] if drain else 0.0) for k in self.kind_of]
            hop = 0.0
            if c.pp > 1:
                ctx = StepContext(cluster=self.cluster, workload=self.workload, stage_size=self.world // c.pp,
                                  micro_batch_seqs=self.workload.global_batch // c.m)
                hop = (2.0 if drain else 1.0) * pipeline_p2p_time(max(x.hidden for x in self.model.layers), ctx)
            self.paths[key] = (np.concatenate([[0.0], np.cumsum(per)]), hop)
        return self.paths[key]

    def _rank_bound(self, c: Context, cands, counts: tuple[int, ...], start: int, r: int) -> float:
        """Lower bound on the step from pipeline rank r holding `counts` layers of each kind, its
        first chunk starting at layer `start`: the first micro-batch must reach it and the last
        gradient leave it (`_paths`), and in between it runs m micro-batches of its layers and then
        its tail, at least the LP relaxation of its memory knapsack (space.lp_time_bound) with its
        largest unavoidable buffer set aside. Infinite when the rank cannot fit."""
        k = in_flight(c.schedule, c.pp, r, c.m, c.v)
        key = (self.world // c.pp, c.m, k, counts)  # `_partition` reads this cache directly
        if key not in self.lp_cache:
            kinds = [(n, kd) for kd, n in zip(self.kinds, counts) if n]
            room = self.budget - max(cands[kd].fastest["buf"] for _, kd in kinds)
            hulls = [(n, self._hull(c, kd, k, cands)) for n, kd in kinds]
            self.lp_cache[key] = lp_time_bound(hulls, room)
        P, hop = self._paths(c, cands)
        return float(P[start]) + r * hop + self.lp_cache[key]

    def _counts(self, ranges) -> tuple[int, ...]:
        return tuple(int(x) for x in sum(self.kind_prefix[e] - self.kind_prefix[s] for s, e in ranges))

    # --- one context ----------------------------------------------------------------------------
    def _fastest_prefix(self, cands) -> dict[str, list[float]]:
        """Per cost term, prefix sums over the layers of each layer's fastest value."""
        key = id(cands)
        if key not in self.prefixes:
            self.prefixes[key] = {t: np.concatenate([[0.0], np.cumsum([cands[k].fastest[t] for k in self.kind_of])]).tolist()
                                  for t in ("fwd", "bonly", "wgrad", "step")}
        return self.prefixes[key]

    def _chunk_bound(self, cands, split, c: Context, p2p: float) -> float:
        """Valid lower bound on the step for this split (per-layer minimal times): rank r cannot
        finish before micro-batch 0 crossed the chunks before it, it ran m micro-batches, and the
        last gradient went back; plus the largest rank's fastest tail."""
        pre = self._fastest_prefix(cands)
        f, b, w, st = pre["fwd"], pre["bonly"], pre["wgrad"], pre["step"]
        F = [f[e] - f[s] for s, e in split]
        Bk = [b[e] - b[s] for s, e in split]
        W = [w[e] - w[s] for s, e in split]
        S = [st[e] - st[s] for s, e in split]
        drain = c.schedule != "zero_bubble"  # zero-bubble ranks may drain under deferred Ws
        best = tail = before = 0.0
        for r in range(c.pp):
            mine = range(r, len(split), c.pp)
            work = c.m * sum(F[i] + Bk[i] + W[i] for i in mine)
            best = max(best, before + (2 if drain else 1) * r * p2p + work)
            tail = max(tail, sum(S[i] for i in mine))
            before += F[r] + (Bk[r] if drain else 0.0)  # chunks 0..r, crossed before rank r + 1
        return best + tail

    def _simulated_bound(self, cands, split, c: Context, p2p: float) -> float:
        """The schedule simulated with every layer at its fastest forward, backward and weight
        gradient, plus the largest rank's fastest tail: a valid lower bound (the makespan only
        grows with any operation's duration) that, unlike the path bounds, sees the bubbles."""
        pre = self._fastest_prefix(cands)
        f, b, w, st = pre["fwd"], pre["bonly"], pre["wgrad"], pre["step"]
        F = [f[e] - f[s] for s, e in split]
        W = [w[e] - w[s] for s, e in split]
        Bk = [b[e] - b[s] + x for (s, e), x in zip(split, W)]
        tail = max(sum(st[e] - st[s] for s, e in self._rank_layers(c, split, r)) for r in range(c.pp))
        return simulate(c.schedule, F, Bk, c.m, c.pp, c.v, p2p, W).step_time + tail

    def _any_split_bound(self, c: Context, cands) -> float:
        """A lower bound for every split of the context: the ranks' busy time and tails are at
        least their mean (evaluate's step is at least that mean even on time-shared cores), and
        their sum is at least the LP relaxation of all layers' knapsack over the pp ranks' memory
        together, each layer costed at the fewest in-flight micro-batches of any rank."""
        k = min(in_flight(c.schedule, c.pp, r, c.m, c.v) for r in range(c.pp))
        counts = self._counts([(0, len(self.model.layers))])
        kinds = [(n, kd) for kd, n in zip(self.kinds, counts) if n]
        room = self.budget - max(cands[kd].fastest["buf"] for _, kd in kinds)
        return lp_time_bound([(n, self._hull(c, kd, k, cands)) for n, kd in kinds], c.pp * room) / c.pp

    def _balanced(self, cands, chunks: int) -> tuple[tuple[int, int], ...]:
        """The split balancing each layer's fastest forward + backward (cached per candidate set)."""
        key = (id(cands), chunks)
        if key not in self.balanced:
            self.balanced[key] = balanced_stages([cands[k].fastest["fb"] for k in self.kind_of], chunks)
        return self.balanced[key]

    def _rank_layers(self, c: Context, split, r: int) -> list[tuple[int, int]]:
        return [split[i] for i in range(r, len(split), c.pp)]

    def _split_bound(self, c: Context, cands, split, p2p: float) -> float:
        """max(path bound of `_chunk_bound`, the largest `_rank_bound`), of the step as evaluate()
        gives it (the simulated step divided by the oversubscription of time-shared cores)."""
        bound = self._chunk_bound(cands, split, c, p2p)
        for r in range(c.pp):
            ranges = self._rank_layers(c, split, r)
            counts = self._counts(ranges)
            bound = max(bound, self._rank_bound(c, cands, counts, ranges[0][0], r))
            if bound == np.inf:
                if not self.scored:  # the split's peak: its largest rank's smallest memory
                    need = max(self._rank_need(c, cands, self._counts(self._rank_layers(c, split, q)), q)
                               for q in range(c.pp))
                    self._record_infeasible(required_memory(need, self.cluster), c, cands)
                break
        return bound / self.over

    def _partition(self, c: Context) -> list[tuple[float, tuple]]:
        """Two exact min-max partitions (partition.min_max_partition) whose stage boundaries are
        chosen with the memory each stage's strategies need, not only its compute:
        - the bottleneck: the largest rank's LP value (m micro-batches and its tail, at the memory
          it has), which paces a filled pipeline (1F1B: about m - 1 times the slowest stage plus
          every stage once);
        - the bound: the largest `_rank_bound` (the bottleneck plus fill and drain paths), whose
          value bounds the step of every split of the context.
        Both are queued with the splits one boundary move away, each under its own bound; the
        search keeps moving boundaries from any of them that improves the context's best plan
        (planner._process)."""
        n, B = self.world // c.pp, self.workload.global_batch // c.m
        cands = self._candidates(n, B)
        upper = self.scored[0].step * self.over / (1 + self.opts.optimality_gap) if self.scored else np.inf
        balanced = self._balanced(cands, c.pp)
        P, hop = self._paths(c, cands)
        path = P.tolist()
        prefix = [tuple(int(x) for x in row) for row in self.kind_prefix]
        ks = [in_flight(c.schedule, c.pp, r, c.m, c.v) for r in range(c.pp)]
        lp = self.lp_cache  # `_rank_bound` fills it

        def bottleneck(r: int, s: int, e: int) -> float:
            counts = tuple(a - b for a, b in zip(prefix[e], prefix[s]))
            value = lp.get((n, c.m, ks[r], counts))
            if value is None:
                return self._rank_bound(c, cands, counts, s, r) - path[s] - r * hop
            return value

        def bound(r: int, s: int, e: int) -> float:
            return bottleneck(r, s, e) + path[s] + r * hop

        work = np.concatenate([[0.0], np.cumsum([cands[k].fastest["work"] for k in self.kind_of])]).tolist()

        def rest(r: int, e: int) -> float:  # the later ranks' share of the fastest work left
            return (work[-1] - work[e]) / (c.pp - 1 - r)

        floor = self._any_split_bound(c, cands) * self.over  # no split's value is below it
        value, lowest = _deepening(len(self.model.layers), c.pp, bound, upper, rest, floor)
        self.proven = min(self.proven, min(value, upper) / self.over)  # every split of the context (planner.run)
        if lowest is None:
            if not self.scored:  # say how little memory any split could need
                self._note_partition_need(c, cands)
            return []
        # A split whose bottleneck reaches the best plan's step cannot beat it (the bottleneck
        # is a lower bound too); one no better than the balanced split's is not needed.
        cap = max(bottleneck(r, s, e) for r, (s, e) in enumerate(balanced)) * (1 + 1e-12)
        _, paced = _deepening(len(self.model.layers), c.pp, bottleneck, min(upper, cap), rest, floor)
        seen = {balanced}
        self.climb[(c.pp, c.m, c.schedule, c.v)] = [np.inf, seen]
        return self._neighbours(c, lowest, seen, include=True) + (
            self._neighbours(c, paced, seen, include=True) if paced is not None else [])

    def _neighbours(self, c: Context, split, seen: set, include: bool = False) -> list[tuple[float, tuple]]:
        """`split` (if `include`) and the splits that move a boundary of its two ranks with the
        largest `_rank_bound` by one layer, not yet in `seen`, with their bounds (infinite ones
        dropped); all are added to `seen`."""
        n, B = self.world // c.pp, self.workload.global_batch // c.m
        cands = self._candidates(n, B)
        ctx = StepContext(cluster=self.cluster, workload=self.workload, stage_size=n, micro_batch_seqs=B)
        p2p = pipeline_p2p_time(max(x.hidden for x in self.model.layers), ctx)
        heavy = sorted(range(c.pp), key=lambda r: -self._rank_bound(c, cands, self._counts([split[r]]), split[r][0], r))
        ends = [e for _, e in split[:-1]]
        moves = []
        for r in heavy[:2]:
            for i in (r - 1, r):  # the boundaries before and after rank r
                if 0 <= i < len(ends):
                    for d in (-1, 1):
                        cuts = [0] + ends[:i] + [ends[i] + d] + ends[i + 1:] + [len(self.model.layers)]
                        if all(a < b for a, b in zip(cuts, cuts[1:])):
                            moves.append(tuple(zip(cuts[:-1], cuts[1:])))
        out = []
        for sp in ([split] if include else []) + moves:
            if sp in seen:
                continue
            seen.add(sp)
            self.stats["splits"] += 1
            lb = self._split_bound(c, cands, sp, p2p)
            if lb < np.inf:
                out.append((lb, sp))
        return out

    def _note_partition_need(self, c: Context, cands) -> None:
        """Record the smallest peak memory any split of the context needs (its largest rank's
        smallest memory, minimised over splits by partition.min_max_partition), when it can be
        below the smallest recorded so far."""
        known = np.inf
        if self.best_infeasible is not None:  # in allocated bytes, as `_rank_need` counts
            known = ((self.best_infeasible[0] - self.cluster.device.reserved_bytes)
                     / (1.0 + self.cluster.fragmentation))
        prefix = [tuple(int(x) for x in row) for row in self.kind_prefix]
        least = {}  # per rank: each kind's smallest memory there
        for r in range(c.pp):
            k = in_flight(c.schedule, c.pp, r, c.m, c.v)
            least[r] = [self._hull(c, kd, k, cands)[0][0] for kd in self.kinds]
        buf = [cands[kd].fastest["buf"] for kd in self.kinds]
        if sum(n * x for n, x in zip(prefix[-1], least[c.pp - 1])) / c.pp >= known:
            return  # even an even share of the smallest memories is above what is known

        def need(r: int, s: int, e: int) -> float:
            counts = [a - b for a, b in zip(prefix[e], prefix[s])]
            return (sum(n * x for n, x in zip(counts, least[r]))
                    + max(x for n, x in zip(counts, buf) if n))

        value, _ = min_max_partition(len(self.model.layers), c.pp, need, known)
        if np.isfinite(value):
            self._record_infeasible(required_memory(value, self.cluster), c, cands)

    def _hull(self, c: Context, kind: int, k: float, cands) -> list[tuple[float, float]]:
        key = (self.world // c.pp, self.workload.global_batch // c.m, c.m, kind, k)
        if key not in self.hulls:
            x = cands[kind].costs
            self.hulls[key] = lower_hull(c.m * (x.fwd + x.bwd) + x.step, x.states + k * x.act)
        return self.hulls[key]

    def _rank_need(self, c: Context, cands, counts: tuple[int, ...], r: int) -> float:
        """The fewest bytes rank r allocates with these layers (each at its smallest memory)."""
        k = in_flight(c.schedule, c.pp, r, c.m, c.v)
        kinds = [(n, kd) for kd, n in zip(self.kinds, counts) if n]
        return (sum(n * self._hull(c, kd, k, cands)[0][0] for n, kd in kinds)
                + max(cands[kd].fastest["buf"] for _, kd in kinds))


def _deepening(layers: int, stages: int, cost, upper: float, rest, floor: float):
    """partition.min_max_partition with a cut-off that starts a little above `floor` (a lower
    bound on the answer) and grows until a split is found, ending at `upper`: the same answer
    (the optimum is found as soon as the cut-off exceeds it), looking at far fewer ranges when
    `upper` is loose or infinite."""
    for factor in ((1.02, 1.1, 1.3, 2.0, 4.0) if floor > 0 else ()):
        if floor * factor >= upper:
            break
        value, split = min_max_partition(layers, stages, cost, floor * factor, rest)
        if split is not None:
            return value, split
    value, split = min_max_partition(layers, stages, cost, upper, rest)
    return (value, split) if split is not None else (upper, None)
