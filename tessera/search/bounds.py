"""Lower bounds on the step of a (context, split) and the partition search that uses them.

A mixin of the planner's search (planner._Search): it reads the search's candidates, caches and
memory budget. Every bound here is valid — no plan of the space that the bound covers has a
shorter step — which is what lets the planner skip what cannot win (planner.py, Exactness).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..cost.layer import StepContext, pipeline_p2p_time
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
    def _chunk_bound(self, cands, split, c: Context, p2p: float) -> float:
        """Valid lower bound on the step for this split (per-layer minimal times)."""
        f, b, w, st = ({k: x.fastest[t] for k, x in cands.items()} for t in ("fwd", "bonly", "wgrad", "step"))
        F = [sum(f[self.kind_of[i]] for i in range(s, e)) for s, e in split]
        Bk = [sum(b[self.kind_of[i]] for i in range(s, e)) for s, e in split]
        W = [sum(w[self.kind_of[i]] for i in range(s, e)) for s, e in split]
        S = [sum(st[self.kind_of[i]] for i in range(s, e)) for s, e in split]
        pp = c.pp
        best = 0.0
        tail = 0.0
        for r in range(pp):
            mine = range(r, len(split), pp)
            work = c.m * sum(F[i] + Bk[i] + W[i] for i in mine)
            drain = c.schedule != "zero_bubble"  # zero-bubble ranks may drain under deferred Ws
            before = sum(F[i] + (Bk[i] if drain else 0.0) for i in range(r)) + (2 if drain else 1) * r * p2p
            best = max(best, before + work)
            tail = max(tail, sum(S[i] for i in mine))
        return best + tail

    def _simulated_bound(self, cands, split, c: Context, p2p: float) -> float:
        """The schedule simulated with every layer at its fastest forward, backward and weight
        gradient, plus the largest rank's fastest tail: a valid lower bound (the makespan only
        grows with any operation's duration) that, unlike the path bounds, sees the bubbles."""
        f, b, w, st = ({k: x.fastest[t] for k, x in cands.items()} for t in ("fwd", "bonly", "wgrad", "step"))
        F = [sum(f[self.kind_of[i]] for i in range(s, e)) for s, e in split]
        W = [sum(w[self.kind_of[i]] for i in range(s, e)) for s, e in split]
        Bk = [sum(b[self.kind_of[i]] for i in range(s, e)) + x for (s, e), x in zip(split, W)]
        tail = max(sum(st[self.kind_of[i]] for s, e in self._rank_layers(c, split, r) for i in range(s, e))
                   for r in range(c.pp))
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
                if not self.scored:
                    self._note_infeasible_lp(c, cands, counts, r)
                break
        return bound / self.over

    def _partition(self, c: Context) -> list[tuple[float, tuple]]:
        """The split minimising the largest `_rank_bound` (partition.min_max_partition): stage
        boundaries chosen with the memory each stage's strategies need, not only its compute.
        Only splits that beat the balanced one (already queued) and the best plan are looked for."""
        n, B = self.world // c.pp, self.workload.global_batch // c.m
        cands = self._candidates(n, B)
        upper = self.scored[0].step * self.over / (1 + self.opts.optimality_gap) if self.scored else np.inf
        balanced = self._balanced(cands, c.pp)
        upper = min(upper, max(self._rank_bound(c, cands, self._counts([se]), se[0], r)
                               for r, se in enumerate(balanced)))
        P, hop = self._paths(c, cands)
        prefix = [tuple(int(x) for x in row) for row in self.kind_prefix]
        ks = [in_flight(c.schedule, c.pp, r, c.m, c.v) for r in range(c.pp)]
        lp = self.lp_cache

        def cost(r: int, s: int, e: int) -> float:
            counts = tuple(a - b for a, b in zip(prefix[e], prefix[s]))
            value = lp.get((n, c.m, ks[r], counts))
            if value is None:
                return self._rank_bound(c, cands, counts, s, r)
            return float(P[s]) + r * hop + value

        value, split = min_max_partition(len(self.model.layers), c.pp, cost, upper)
        self.proven = min(self.proven, min(value, upper) / self.over)  # every split of the context (planner.run)
        if split is None or split == balanced:
            return []
        self.stats["splits"] += 1
        ctx = StepContext(cluster=self.cluster, workload=self.workload, stage_size=n, micro_batch_seqs=B)
        p2p = pipeline_p2p_time(max(x.hidden for x in self.model.layers), ctx)
        return [(self._split_bound(c, cands, split, p2p), split)]

    def _hull(self, c: Context, kind: int, k: float, cands) -> list[tuple[float, float]]:
        key = (self.world // c.pp, self.workload.global_batch // c.m, c.m, kind, k)
        if key not in self.hulls:
            x = cands[kind].costs
            self.hulls[key] = lower_hull(c.m * (x.fwd + x.bwd) + x.step, x.states + k * x.act)
        return self.hulls[key]

    def _note_infeasible_lp(self, c: Context, cands, counts: tuple[int, ...], r: int) -> None:
        """Remember the smallest memory rank r could need with these layers."""
        k = in_flight(c.schedule, c.pp, r, c.m, c.v)
        kinds = [(n, kd) for kd, n in zip(self.kinds, counts) if n]
        need = (sum(n * self._hull(c, kd, k, cands)[0][0] for n, kd in kinds)
                + max(cands[kd].fastest["buf"] for _, kd in kinds) + self.cluster.device.reserved_bytes)
        self._record_infeasible(need, c, cands)
