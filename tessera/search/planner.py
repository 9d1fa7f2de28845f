"""The static planner: `search(model, cluster, workload)` returns the fastest plan that fits.

Optimisation problem
--------------------
Variables
    pp        pipeline degree: divides the world; a stage is whole nodes or part of one node
    schedule  GPipe, 1F1B, interleaved 1F1B (v virtual stages), zero-bubble (ZB-H1)
    m         micro-batches per step (divides the global batch G); B = G / m sequences per
              micro-batch over a stage's n = world / pp devices
    split     stage boundaries (pp * v contiguous layer ranges)
    s_l       each layer's strategy from its candidate set (space.py): dp * tp * sp = n,
              ZeRO 0-3 / HSDP, recompute, offload, EP
Objective
    step(plan) = makespan of the schedule simulator over chunk times + max rank tail
    (cost/evaluate.py); the plan returned minimises it
Constraints
    memory    for every pipeline rank r: sum_l (states_l + in_flight_r * act_l) + max_l buf_l
              + reserved <= device memory                                     (cost/memory.py)
    layout    dp divides B; tp within a node and dividing the heads; ep divides experts and dp sp
    batch     micro_batch_size * m * max_l dp_l = G
    tied      an LM head tied to the embedding takes the embedding's parameter layout (dp,
              ulysses, tp, ZeRO shard degree, cp): the runtime shares the weight only then, and
              the cost model prices it once only then (`_solve_tied_rank`; a pipeline's head copy
              follows the embedding's layout too, summed by an all-reduce of equal shards)

Method (which function does what)
    `_contexts`      enumerates (pp, m, schedule, v) and orders them by a balanced-stage
                     estimate of the step: FLOPs at the best GEMM rate plus each micro-batch's
                     kernel launches and per-call overheads (compute.fixed_seconds_per_micro_batch);
                     contexts whose estimate is already slower than the best plan found are skipped
                     (the estimate has no communication and no imbalance, so it is optimistic).
    `_candidates`    builds each distinct layer's candidates once per (n, B) — all decoder blocks of
                     a dense model are one layer spec — costs them vectorised (cost/layer.py) and
                     drops dominated ones (space.prune_dominated, with its proof).
    `_splits`        all stage boundaries when there are at most `max_splits`, else the split that
                     balances compute; with one chunk per rank also a "partition" item:
    `_partition`     (bounds.py) two exact min-max partitions over all splits
                     (partition.min_max_partition): the one minimising the largest `_rank_bound`
                     and the one minimising the largest rank's LP value (the bottleneck), so each
                     stage's layers are chosen with the memory their strategies need, not only their
                     compute (Galvatron-BMW); both are queued with the splits that move a boundary of
                     their heaviest ranks, and the search keeps moving boundaries from any split that
                     improves its context's best plan. Interleaved pipelines keep Megatron's even
                     split (each boundary moved by one if it cannot fit).
    `_rank_bound`    a valid lower bound on the step from one pipeline rank: the first micro-batch
                     must reach it and the last gradient leave it (fastest layer times), and it runs
                     m micro-batches of its layers and its tail, at least the LP relaxation of its
                     memory knapsack (space.lp_time_bound).
    `_split_bound`   the largest `_rank_bound` of a split, and the path bound of `_chunk_bound`;
                     (context, split) pairs are processed best-first by these bounds and the search
                     stops when none can beat the best plan by more than `optimality_gap`.
    dp.solve_rank    the layer-wise dynamic program per rank (exact memory certificate, see dp.py)
                     minimising (m + bubble) (f + b + re-sharding) + step under the rank's memory
                     budget; for pp = 1 this is exactly the step time.
    `evaluate`       scores the assembled plan with the simulator; the fastest feasible wins.
    explain.explain  why this plan, the runner-up with another structure and by how much, which
                     constraint binds, and what the space left out.

Exactness. The search is a branch and bound: every queue item carries a lower bound on the step
of every plan it covers (contexts: the compute estimate; splits: `_split_bound`; partition items:
the LP of all layers over the ranks' memory together), items are taken best-first, and the search
stops once none can beat the best plan by more than `optimality_gap` (0.1%). What it takes out of
the queue leaves a lower bound too (`run`: the ranks' certified program bounds with the path to
each rank, the partition's min-max value, and, for the solved pipeline splits that limit the
proof, the schedule simulated at the fastest layer times), so the returned plan carries
`SearchInfo.step_lower_bound_s`, proved: no plan of the space is predicted faster, and the
explanation says how close the plan is to it.
- pp = 1: the rank program's objective is the step itself and dp.py certifies it, so the plan is
  within `optimality_gap` of the best plan of the space (the test suite checks the enumerated
  optimum at every memory budget of its instance).
- pipelines: the ranks are solved one by one, the makespan's coupling of the ranks and the largest
  tail approximated by the (m + bubble) weight, so a plan can be slower than the enumerated
  optimum (it matches it on the test instances, whose proved bounds are 1.7% and 14% below it);
  the proved bound is what the plan is guaranteed against.
"""
from __future__ import annotations

import heapq
import logging
import time
from dataclasses import dataclass, replace
from math import comb

import numpy as np

from ..cost.compute import achieved_flops, fixed_seconds_per_micro_batch
from ..cost.evaluate import evaluate
from ..cost.memory import memory_budget, required_memory
from ..cost.layer import StepContext, cost_key, layer_costs, pipeline_p2p_time, transition_matrix
from ..cost.schedule import in_flight
from ..errors import TesseraError
from ..plan import PipelineSpec, Plan, Schedule, SearchInfo
from ..spec.cluster import ClusterSpec
from ..spec.model import LayerKind, ModelSpec
from ..spec.workload import Workload
from .bounds import Context as _Context
from .bounds import SplitBounds
from .dp import RankSolution, Slot, solve_rank
from .explain import bubble_warning, explain, structure
from .limits import check_search_size
from .space import (Candidates, SearchOptions, candidate_table, divisors, dominated_on_rank, fastest_costs,
                    param_layouts, prune_dominated, space_notes, virtual_stage_options)

log = logging.getLogger(__name__)
GiB = 2**30


class NoFeasiblePlanError(TesseraError):
    """No plan of the space fits in device memory."""

    def __init__(self, message: str, best_peak_bytes: float, device_bytes: float):
        super().__init__(message)
        self.best_peak_bytes = best_peak_bytes
        self.device_bytes = device_bytes


@dataclass
class _Scored:
    step: float
    plan: Plan


class _Search(SplitBounds):
    def __init__(self, model: ModelSpec, cluster: ClusterSpec, workload: Workload, options: SearchOptions):
        if options.allow_cp and any(layer.num_experts for layer in model.layers):
            options = replace(options, allow_cp=False, cp=None)  # the runtime runs MoE models at cp = 1
        self.model, self.cluster, self.workload, self.opts = model, cluster, workload, options
        self.world = cluster.num_gpus
        keys: dict[tuple, int] = {}
        self.kind_of = [keys.setdefault(cost_key(layer), len(keys)) for layer in model.layers]
        self.kind_layer = {k: model.layers[i] for i, k in reversed(list(enumerate(self.kind_of)))}
        # An LM head tied to the embedding: the two take one parameter layout (`_solve_tied_rank`).
        self.tied = (len(model.layers) > 1 and model.layers[0].kind == LayerKind.EMBEDDING
                     and model.layers[-1].tied_params > 0)
        self.tied_kinds = {self.kind_of[0], self.kind_of[-1]} if self.tied else set()
        self.budget = memory_budget(cluster)
        self.tables: dict[tuple[int, int], dict[int, Candidates] | None] = {}
        self.layouts: dict[tuple[int, int], tuple[dict, np.ndarray]] = {}
        self.scored: list[_Scored] = []
        self.best_infeasible: tuple[float, str] | None = None
        self.dp_cache: dict[tuple, tuple] = {}
        self.hulls: dict[tuple, list] = {}
        self.paths: dict[tuple, tuple] = {}
        self.balanced: dict[tuple, tuple] = {}
        self.prefixes: dict[int, dict] = {}
        self.climb: dict[tuple, list] = {}  # partitioned contexts: [their best step, splits queued]
        self.lp_cache: dict[tuple, float] = {}
        self.kinds = sorted(set(self.kind_of))
        onehot = np.eye(len(self.kinds), dtype=np.int64)[[self.kinds.index(k) for k in self.kind_of]]
        self.kind_prefix = np.vstack([np.zeros(len(self.kinds), dtype=np.int64), np.cumsum(onehot, axis=0)])
        self.stats = dict(contexts=0, skipped=0, splits=0, plans=0, states=0, candidates=0, pruned=0)
        self.proven = np.inf  # lower bound on the step of everything taken out of the queue (`run`)
        self.solved: list[tuple[float, _Context, tuple]] = []  # solved pipeline splits and their bounds
        # evaluate() divides the simulated step by the oversubscription of time-shared cores (CPU
        # profiles), so every lower bound of the simulated step is divided by it too.
        self.over = max(1.0, cluster.oversubscription)

    # --- the space ------------------------------------------------------------------------------
    def _pp_options(self) -> list[int]:
        gpn = self.cluster.gpus_per_node
        out = []
        for pp in divisors(self.world):
            n = self.world // pp
            if pp > len(self.model.layers) or (self.opts.max_pp and pp > self.opts.max_pp):
                continue
            if self.opts.pp is not None and pp != self.opts.pp:
                continue
            if n % gpn == 0 or gpn % n == 0:
                out.append(pp)
        return out

    def _notes(self) -> list[str]:
        sizes = [self.world // pp for pp in self._pp_options()]
        return space_notes(list(self.kind_layer.values()), sizes, self.cluster.gpus_per_node, self.opts)

    def _contexts(self) -> list[_Context]:
        G, seq = self.workload.global_batch, self.workload.seq_len
        # FLOPs as the cost model times them (measured time scales included), so that the estimate
        # stays below any plan's compute.
        flops = sum(layer.flops_per_token * layer.linear_time_scale
                    + layer.attn_flops_coeff * seq * layer.attn_time_scale for layer in self.model.layers)
        rate = achieved_flops(self.cluster, self.workload.dtype)
        # Kernel launches and per-call overheads: paid per micro-batch by every strategy, so more
        # micro-batches cost more (a stage holds at least 1/pp of them when balanced).
        fixed = sum(fixed_seconds_per_micro_batch(layer, self.cluster) for layer in self.model.layers)
        out = []
        for pp in self._pp_options():
            for m in divisors(G):
                per_mb = (3.0 * flops * (G // m) * seq / (rate * self.world)  # balanced, no comm
                          + fixed / pp)
                scheds: list[tuple[str, int, float]] = []
                if pp == 1:
                    scheds.append(("1f1b", 1, 0.0))
                else:
                    for s in self.opts.schedules:
                        if s == "interleaved_1f1b":
                            if m % pp == 0:  # the simulator's (and torch's) interleaved order needs it
                                scheds += [(s, v, (pp - 1) / v) for v in virtual_stage_options(
                                    pp, len(self.model.layers), self.model.num_blocks, self.opts)]
                        elif s == "zero_bubble":
                            scheds.append((s, 1, (pp - 1) / 3))
                        elif s == "1f1b" and m < pp:
                            continue  # torch refuses 1F1B with m < pp (GPipe and zero-bubble run it)
                        else:
                            scheds.append((s, 1, float(pp - 1)))
                for s, v, bubble in scheds:
                    out.append(_Context(per_mb * (m + bubble), pp, m, s, v, bubble))
        return sorted(out)

    def _candidates(self, n: int, B: int) -> dict[int, Candidates] | None:
        key = (n, B)
        if key in self.tables:
            return self.tables[key]
        ctx = StepContext(cluster=self.cluster, workload=self.workload, stage_size=n, micro_batch_seqs=B,
                          host_layers=len(self.model.layers) * n / self.world)
        out: dict[int, Candidates] = {}
        layouts: dict[tuple, int] = {}
        for kind, layer in self.kind_layer.items():
            table = candidate_table(layer, n, B, self.cluster, self.opts, self.workload.seq_len)
            if not len(table):
                self.tables[key] = None
                return None
            costs = layer_costs(layer, table, ctx)
            keep = prune_dominated(table, costs, by_shard=kind in self.tied_kinds)
            self.stats["candidates"] += len(table)
            self.stats["pruned"] += len(table) - len(keep)
            table = table.subset(keep)
            costs = type(costs)(**{f: np.asarray(getattr(costs, f))[keep] for f in costs.__dataclass_fields__})
            lay = [(int(a), int(b), int(c), bool(d), int(e)) for a, b, c, d, e in
                   zip(table.dp, table.tp, table.sp, table.megatron, table.cp)]
            for x in lay:
                layouts.setdefault(x, len(layouts))
            out[kind] = Candidates(table=table, costs=costs, layout=lay,
                                   fastest=fastest_costs(costs, self.workload.global_batch // B))
        hidden = max(layer.hidden for layer in self.model.layers)
        names = list(layouts)
        trans = transition_matrix(hidden, names, ctx)
        self.layouts[key] = (layouts, trans)
        self.tables[key] = out
        return out

    def _splits(self, cands: dict[int, Candidates], chunks: int) -> tuple[list[tuple], bool]:
        """(splits, complete): every split when there are at most `max_splits`, else the split that
        balances each layer's fastest forward + backward (completed by `_partition` and `_shifted`)."""
        L = len(self.model.layers)
        if chunks == 1:
            return [((0, L),)], True
        if comb(L - 1, chunks - 1) <= self.opts.max_splits:
            from itertools import combinations

            return [tuple(zip((0,) + cut, cut + (L,))) for cut in combinations(range(1, L), chunks - 1)], True
        return [self._balanced(cands, chunks)], False

    def _shifted(self, split) -> list[tuple[tuple[int, int], ...]]:
        """`split` with each boundary moved by one layer (memory is uneven across ranks:
        in-flight micro-batches, embedding, logits)."""
        L = len(self.model.layers)
        ends = [e for _, e in split[:-1]]
        out = []
        for i in range(len(ends)):
            for d in (-1, 1):
                cuts = [0] + ends[:i] + [ends[i] + d] + ends[i + 1:] + [L]
                if all(a < b for a, b in zip(cuts, cuts[1:])):
                    out.append(tuple(zip(cuts[:-1], cuts[1:])))
        return out

    def _solve_split(self, c: _Context, split, bound: float, slack: float = 1.0) -> float | None:
        """Solve every rank of (context, split), assemble and score the plan (its step, or None);
        partial assignments that cannot beat `slack` x the best step so far are pruned. `bound` is
        the split's lower bound; with the ranks' own it goes into `self.proven` (see `run`)."""
        n, B = self.world // c.pp, self.workload.global_batch // c.m
        cands = self._candidates(n, B)
        layouts, trans_mb = self.layouts[(n, B)]
        weight = c.m + c.bubble  # micro-batch passes on the critical path (see _Context)
        trans = weight * trans_mb
        best_step = self.scored[0].step * slack if self.scored else np.inf
        choice: list[int] = [0] * len(self.model.layers)
        P, hop = self._paths(c, cands)
        last = len(self.model.layers) - 1
        embedding_layout = None  # the tied embedding's parameter layout, once its rank is solved
        try:
            for r in range(c.pp):
                k = in_flight(c.schedule, c.pp, r, c.m, c.v)
                chunks = self._rank_layers(c, split, r)
                # weight (f + b) + tail <= (weight / m) (busy + tail), and the first micro-batch
                # reaches the rank (and, but for zero-bubble, the last gradient leaves it) outside
                # its busy time: path + (m / weight) objective <= simulated step <= over x step.
                path = float(P[chunks[0][0]]) + r * hop
                upper = (best_step * self.over / (1 + self.opts.optimality_gap) - path) * weight / c.m
                rank_layers = [i for s, e in chunks for i in range(s, e)]
                tied_here = self.tied and rank_layers[0] == 0 and rank_layers[-1] == last
                restrict = {}
                if self.tied and rank_layers[-1] == last and embedding_layout is not None:
                    restrict = {self.kind_of[last]: embedding_layout}  # a pipeline's head copy: the same layout
                if tied_here:
                    sol, keep, rank_bound = self._solve_tied_rank(c, n, B, chunks, k, weight, trans, upper)
                else:
                    sol, keep, rank_bound = self._solve_rank(c, n, B, chunks, k, weight, trans, upper, restrict)
                bound = max(bound, (path + rank_bound * c.m / weight) / self.over)  # the comment above, backwards
                if sol is None:
                    return None
                pos = 0
                for s, e in chunks:
                    for i in range(s, e):
                        choice[i] = int(keep[self.kind_of[i]][sol.choice[pos]])
                        pos += 1
                if self.tied and rank_layers[0] == 0:
                    embedding_layout = param_layouts(cands[self.kind_of[0]].table)[choice[0]]
        finally:
            if c.pp > 1:  # tightened at the end where it limits the proof (`_tighten`)
                self.solved.append((bound, c, split))
            else:
                self.proven = min(self.proven, bound)
        plan = self._assemble(c, B, split, choice, cands)
        if plan is None:
            return None
        pred = evaluate(plan)
        self.stats["plans"] += 1
        if not pred.fits:  # cannot happen: the DP enforces the same memory model
            log.warning("search produced a plan that does not fit; skipped")
            return None
        self._record(plan.model_copy(update={"prediction": pred}))
        return pred.step_time_s

    def _solve_rank(self, c: _Context, n: int, B: int, chunks, k: float, weight: float, trans: np.ndarray,
                    upper: float, restrict: dict | None = None):
        """(solution or None, candidate indices per kind, bound) of one rank's program, cached;
        `restrict`: kind -> the one parameter layout its candidates may take."""
        restrict = restrict or {}
        key = (n, B, c.m, weight, tuple(tuple(self.kind_of[s:e]) for s, e in chunks), k,
               tuple(sorted(restrict.items())))
        hit = self.dp_cache.get(key)
        if hit is None or (hit[0] is None and upper > hit[2]):  # None under a tighter bound
            cands = self._candidates(n, B)
            layouts = self.layouts[(n, B)][0]
            slots = self._slots(cands, chunks, layouts, weight, k, trans, restrict)
            if slots is None:  # no candidate of a restricted kind takes that layout
                hit = self.dp_cache[key] = (None, {}, np.inf, np.inf)
            else:
                res = solve_rank(slots, trans, self.budget, self.opts.memory_bins, self.opts.max_memory_bins,
                                 upper_bound=max(upper, 0.0), gap=self.opts.optimality_gap)
                sol = res.solution
                if sol is not None:
                    self.stats["states"] += sol.states_explored
                elif not self.scored and not restrict:
                    self._note_infeasible(slots, c, cands)
                hit = self.dp_cache[key] = (sol, self._keep, upper, res.bound)
        sol, keep, _, rank_bound = hit
        return sol, keep, rank_bound

    def _solve_tied_rank(self, c: _Context, n: int, B: int, chunks, k: float, weight: float,
                         trans: np.ndarray, upper: float):
        """`_solve_rank` for a rank holding both the embedding and the LM head tied to it: the two
        take one parameter layout (the runtime then shares one weight, priced once).

        The program without that constraint is a relaxation (its bound stays valid). When its
        optimum gives the pair two layouts, that optimum is repaired: the blocks kept, the pair
        re-chosen together in one layout (`_repair_tied`); a repair within `optimality_gap` of the
        relaxation is taken (the search's own tolerance). Otherwise the program is solved once
        per layout both layers can take, each pruned by the best found so far (the repair first),
        and the best is kept, the bound the smallest of theirs: exact."""
        sol, keep, bound = self._solve_rank(c, n, B, chunks, k, weight, trans, upper)
        if sol is None:
            return sol, keep, bound
        cands = self._candidates(n, B)
        first, last = self.kind_of[0], self.kind_of[-1]
        emb_keys, head_keys = param_layouts(cands[first].table), param_layouts(cands[last].table)
        picked = (emb_keys[int(keep[first][sol.choice[0]])], head_keys[int(keep[last][sol.choice[-1]])])
        if picked[0] == picked[1]:
            return sol, keep, bound
        slots = self._slots(cands, chunks, self.layouts[(n, B)][0], weight, k, trans)
        repaired = self._repair_tied(slots, keep, sol, trans, emb_keys, head_keys)
        if repaired is not None and repaired.time <= sol.time * (1 + self.opts.optimality_gap):
            return repaired, keep, bound
        best = (repaired, keep) if repaired is not None and repaired.time < upper else None
        common = set(emb_keys) & set(head_keys)
        order = [g for g in picked if g in common] + sorted(common - set(picked))
        bounds = []
        for g in order:
            ceiling = min(upper, best[0].time) if best is not None else upper
            s, kp, b = self._solve_rank(c, n, B, chunks, k, weight, trans, ceiling, {first: g, last: g})
            bounds.append(b)
            if s is not None and (best is None or s.time < best[0].time):
                best = (s, kp)
        tied_bound = min(bounds) if bounds else np.inf
        if best is None:
            return None, keep, max(bound, min(tied_bound, upper))
        return best[0], best[1], max(bound, min(tied_bound, best[0].time))

    def _repair_tied(self, slots: list[Slot], keep: dict, sol, trans: np.ndarray, emb_keys: list,
                     head_keys: list):
        """`sol` (one rank holding every layer, embedding first and LM head last) with the
        embedding and head re-chosen in one parameter layout, the other layers kept: the fastest
        pair of each layout that fits the budget, the best of them (None when none fits)."""
        first, last = self.kind_of[0], self.kind_of[-1]
        choice = list(sol.choice)
        e, h = slots[0], slots[-1]
        inner = range(1, len(slots) - 1)
        mem = sum(float(slots[i].mem[choice[i]]) for i in inner)
        buf = max((float(slots[i].buf[choice[i]]) for i in inner), default=0.0)
        time = sum(float(slots[i].time[choice[i]]) for i in inner)
        time += sum(float(trans[slots[i - 1].layout[choice[i - 1]], slots[i].layout[choice[i]]])
                    for i in range(2, len(slots) - 1) if not slots[i].chunk_start)
        after_e = slots[1].layout[choice[1]] if len(slots) > 2 else None
        before_h = slots[-2].layout[choice[-2]] if len(slots) > 2 else None
        e_time = e.time + (trans[e.layout, after_e] if after_e is not None and not slots[1].chunk_start else 0.0)
        h_time = h.time + (trans[before_h, h.layout] if before_h is not None and not h.chunk_start else 0.0)
        if len(slots) == 2 and not h.chunk_start:
            e_time = e.time
        e_key = [emb_keys[int(j)] for j in keep[first]]
        h_key = [head_keys[int(j)] for j in keep[last]]
        best = None
        for a in range(len(e.time)):
            for b in range(len(h.time)):
                if e_key[a] != h_key[b]:
                    continue
                t = time + float(e_time[a]) + float(h_time[b])
                if len(slots) == 2 and not h.chunk_start:
                    t += float(trans[e.layout[a], h.layout[b]])
                m = mem + float(e.mem[a]) + float(h.mem[b])
                top = max(buf, float(e.buf[a]), float(h.buf[b]))
                if m + top <= self.budget and (best is None or t < best[0]):
                    best = (t, m, top, a, b)
        if best is None:
            return None
        t, m, top, a, b = best
        choice[0], choice[-1] = a, b
        return RankSolution(t, m, top, tuple(choice), sol.states_explored)

    def _record(self, plan: Plan) -> None:
        self.scored.append(_Scored(plan.prediction.step_time_s, plan))
        self.scored.sort(key=lambda x: x.step)
        del self.scored[50:]

    def _slots(self, cands, chunks, layouts, m: float, k: float, trans: np.ndarray,
               restrict: dict | None = None) -> list[Slot] | None:
        """DP inputs for one rank, per layer kind: the rank's objective terms, without the
        strategies another dominates for this rank (`dominated_on_rank`); a kind in `restrict`
        keeps only its candidates of that parameter layout (before the dominance test, which
        compares across layouts). None: a restricted kind has no such candidate."""
        restrict = restrict or {}
        per_kind: dict[int, tuple] = {}
        slots = []
        penalty = trans.max(axis=0) + trans.max(axis=1)  # worst extra re-sharding into and out of a layout
        for s, e in chunks:
            for i in range(s, e):
                kind = self.kind_of[i]
                if kind not in per_kind:
                    x = cands[kind]
                    allowed = np.arange(len(x.table))
                    if kind in restrict:
                        allowed = np.array([j for j, g in enumerate(param_layouts(x.table)) if g == restrict[kind]],
                                           dtype=np.int64)
                        if not len(allowed):
                            return None
                    t = (m * (x.costs.fwd + x.costs.bwd) + x.costs.step)[allowed]
                    mem = (x.costs.states + k * x.costs.act)[allowed]
                    buf = x.costs.buf[allowed]
                    lay = np.array([layouts[x.layout[j]] for j in allowed])
                    kept = dominated_on_rank(t, mem, buf, lay, penalty)
                    keep = allowed[kept]
                    per_kind[kind] = (t[kept], mem[kept], buf[kept], lay[kept], keep)
                t, mem, buf, lay, keep = per_kind[kind]
                slots.append(Slot(time=t, mem=mem, buf=buf, layout=lay, chunk_start=i == s))
        self._keep = {kind: v[4] for kind, v in per_kind.items()}
        return slots

    def _assemble(self, c, B, split, choice, cands) -> Plan | None:
        pipe = PipelineSpec(degree=c.pp, schedule=Schedule(c.schedule), virtual_stages=c.v, stages=split)
        return self._assemble_plan(pipe, c.m, B, choice, cands)

    def _assemble_plan(self, pipe: PipelineSpec, m: int, B: int, choice, cands) -> Plan | None:
        layers = tuple(cands[self.kind_of[i]].table.get(j) for i, j in enumerate(choice))
        dp_batch = max(s.dp for s in layers)
        mbs = B // dp_batch
        if self.opts.micro_batch_sizes is not None and mbs not in self.opts.micro_batch_sizes:
            return None
        if any(dp_batch % s.dp for s in layers):  # e.g. dp 4 and 6 in a stage of 12: no common batch split
            return None
        return Plan(name="tessera", model=self.model, cluster=self.cluster, workload=self.workload,
                    micro_batch_size=mbs, num_micro_batches=m, pipeline=pipe, layers=layers)

    def _note_infeasible(self, slots: list[Slot], c: _Context, cands) -> None:
        """Remember the smallest memory any rank assignment of this context could need."""
        i = [int(np.argmin(s.mem + s.buf)) for s in slots]
        need = sum(float(s.mem[j]) for s, j in zip(slots, i)) + max(float(s.buf[j]) for s, j in zip(slots, i))
        self._record_infeasible(required_memory(need, self.cluster), c, cands)

    def _record_infeasible(self, need: float, c: _Context, cands) -> None:
        if self.best_infeasible is None or need < self.best_infeasible[0]:
            block = max(cands, key=lambda k: self.kind_of.count(k))
            x = cands[block]
            j = int(np.argmin(x.costs.states + x.costs.act + x.costs.buf))
            s = x.table.get(j)
            desc = f"pp={c.pp}, tp={s.tp}" + (f", cp={s.cp}" if s.cp > 1 else "")
            desc += f", ulysses={s.sp_degree}" if s.sp_degree > 1 else ""
            desc += f", zero{s.zero}" if s.zero else ", no zero"
            desc += f", {s.recompute.value} recompute" if s.recompute.value != "none" else ""
            desc += ", offload" if s.offload_optimizer else ""
            self.best_infeasible = (need, desc)

    # --- driver ---------------------------------------------------------------------------------
    def run(self) -> Plan:
        """Best-first over (context, split) by lower bound; stops when no bound beats the best by
        more than `optimality_gap`.

        `self.proven` collects a lower bound for everything the search has taken out of the queue
        (each solved split: its bound and its ranks' certified program bounds; each partition
        search: its min-max value over all splits; each interleaved context of which only some
        splits were queued: a bound for any split), so min(self.proven, what is still queued) is a
        lower bound on the step of every plan of the space."""
        t0 = time.perf_counter()
        heap: list[tuple[float, int, _Context, object]] = []
        for i, c in enumerate(self._contexts()):
            heap.append((c.estimate / self.over, i, c, None))
        heapq.heapify(heap)
        seq = len(heap)
        hidden = max(layer.hidden for layer in self.model.layers)
        gap = self.opts.optimality_gap
        while heap:
            bound, _, c, split = heapq.heappop(heap)
            if self.scored and bound * (1 + gap) >= self.scored[0].step:
                self.stats["skipped"] += 1 + len(heap)
                self.stats["next_bound"] = bound
                heapq.heappush(heap, (bound, seq, c, split))  # kept for the runner-up
                seq += 1
                break
            seq = self._process(heap, seq, bound, c, split, hidden)
        if not self.scored:
            raise self._no_plan()
        lower = self._tighten(min(self.proven, heap[0][0] if heap else np.inf))
        # A runner-up of another structure for the explanation: a few more items, within +25%.
        extra = popped = 0
        while heap and extra < self.opts.runner_ups and popped < 50 and not self._has_runner_up():
            popped += 1
            bound, _, c, split = heapq.heappop(heap)
            extra += isinstance(split, tuple)
            seq = self._process(heap, seq, bound, c, split, hidden, slack=1.25)
        best = self.scored[0].plan
        warning = bubble_warning(best)
        if warning:
            log.warning("%s", warning)
        self.stats["lower_bound"] = min(lower, self.scored[0].step)
        info = SearchInfo(search_time_s=time.perf_counter() - t0, candidates=self.stats["candidates"],
                          step_lower_bound_s=float(self.stats["lower_bound"]),
                          explanation=tuple(explain(best, [(x.step, x.plan) for x in self.scored], self.stats,
                                                    self._unconstrained(best), self._notes())))
        return best.model_copy(update={"search": info})

    def _tighten(self, lower: float) -> float:
        """The proved lower bound: `lower` (everything but solved pipeline splits) and each solved
        split's bound, the smallest ones raised by `_simulated_bound` (one simulation each, only
        for the splits that limit the proof)."""
        solved = sorted(self.solved, key=lambda x: x[0])
        for i, (bound, c, split) in enumerate(solved):
            if bound >= lower:
                break
            n, B = self.world // c.pp, self.workload.global_batch // c.m
            ctx = StepContext(cluster=self.cluster, workload=self.workload, stage_size=n, micro_batch_seqs=B)
            p2p = pipeline_p2p_time(max(x.hidden for x in self.model.layers), ctx)
            raised = max(bound, self._simulated_bound(self._candidates(n, B), split, c, p2p) / self.over)
            lower = min(lower, raised)
            if i >= 20:  # enough simulations: take the rest as they are
                lower = min(lower, min(b for b, _, _ in solved[i + 1:]) if i + 1 < len(solved) else lower)
                break
        return lower

    def _process(self, heap, seq: int, bound: float, c: _Context, item, hidden: int, slack: float = 1.0) -> int:
        """One queue item: expand a context, run a partition search, or solve a split."""
        if item is None or item == "partition":
            for lb, sp in (self._expand(c, hidden) if item is None else self._partition(c)):
                heapq.heappush(heap, (lb, seq, c, sp))
                seq += 1
        else:
            step = self._solve_split(c, item, bound, slack)
            key = (c.pp, c.m, c.schedule, c.v)
            if step is not None and key in self.climb and step < self.climb[key][0]:
                # A split found around the partition's pays off: look one boundary move further.
                for lb, sp in self._neighbours(c, item, self.climb[key][1]):
                    heapq.heappush(heap, (lb, seq, c, sp))
                    seq += 1
                self.climb[key][0] = step
        return seq

    def _unconstrained(self, plan: Plan) -> tuple[int, float]:
        """(rank, bytes): the largest rank's memory if every layer took its fastest strategy of the
        chosen context — above the device memory means memory is what binds."""
        n, B = plan.stage_size, plan.dp_of_batch * plan.micro_batch_size
        cands = self._candidates(n, B)
        pipe = plan.pipeline
        worst = (0, 0.0)
        for r in range(pipe.degree):
            k = in_flight(pipe.schedule.value, pipe.degree, r, plan.num_micro_batches, pipe.virtual_stages)
            mem = buf = 0.0
            for c, (s, e) in enumerate(pipe.stages):
                if pipe.rank_of_chunk(c) != r:
                    continue
                for i in range(s, e):
                    x = cands[self.kind_of[i]].costs
                    j = int(np.argmin(x.fwd + x.bwd + x.step / max(plan.num_micro_batches, 1)))
                    mem += float(x.states[j] + k * x.act[j])
                    buf = max(buf, float(x.buf[j]))
            total = required_memory(mem + buf, self.cluster)
            if total > worst[1]:
                worst = (r, total)
        return worst

    def _expand(self, c: _Context, hidden: int) -> list[tuple[float, object]]:
        """A context's splits with their lower bounds (infeasible ones dropped); where there are
        too many to list, the balanced one and a "partition" item (`_partition`, run when its
        bound comes up) for pipelines of one chunk per rank."""
        self.stats["contexts"] += 1
        n, B = self.world // c.pp, self.workload.global_batch // c.m
        cands = self._candidates(n, B)
        if cands is None:
            return []
        ctx = StepContext(cluster=self.cluster, workload=self.workload, stage_size=n, micro_batch_seqs=B)
        p2p = pipeline_p2p_time(hidden, ctx) if c.pp > 1 else 0.0
        splits, complete = self._splits(cands, c.pp * c.v)
        out: list[tuple[float, object]] = []
        for sp in splits:
            self.stats["splits"] += 1
            lb = self._split_bound(c, cands, sp, p2p)
            if lb < np.inf:
                out.append((lb, sp))
        if complete:
            return out
        anywhere = max(c.estimate / self.over, self._any_split_bound(c, cands))
        if c.v == 1:
            out.append((anywhere, "partition"))
            return out
        self.proven = min(self.proven, anywhere)  # the splits not queued
        if not out and c.pp * c.v <= self.opts.shifted_splits_up_to:
            for sp in self._shifted(splits[0]):  # the balanced cut does not fit: move a boundary
                self.stats["splits"] += 1
                lb = self._split_bound(c, cands, sp, p2p)
                if lb < np.inf:
                    out.append((lb, sp))
        return out

    def _has_runner_up(self) -> bool:
        mine = structure(self.scored[0].plan)
        return any(structure(x.plan) != mine for x in self.scored[1:])

    def _no_plan(self) -> NoFeasiblePlanError:
        dev = self.cluster.device.memory_bytes
        if self.best_infeasible is None:
            msg = (f"no plan of the search space applies to {self.model.name} on {self.world} GPUs with global "
                   f"batch {self.workload.global_batch}; relax the options or change the batch size")
            return NoFeasiblePlanError(msg, float("inf"), dev)
        need, desc = self.best_infeasible
        msg = (f"no plan fits in {dev / GiB:.1f} GiB per GPU: the best candidate needs {need / GiB:.1f} GiB "
               f"({desc}); try more GPUs, a shorter sequence, a smaller micro-batch, or enabling offload")
        return NoFeasiblePlanError(msg, need, dev)


def search(model: ModelSpec, cluster: ClusterSpec, workload: Workload, options: SearchOptions | None = None) -> Plan:
    """The fastest plan of the search space that fits in memory (see the module docstring).

    Raises NoFeasiblePlanError when no plan fits, TesseraError when the problem is larger than the
    search supports (`limits.py`)."""
    check_search_size(num_gpus=cluster.num_gpus, num_layers=len(model.layers), global_batch=workload.global_batch)
    if cluster.device_speeds:  # devices of unequal speed: the strategies at full speed, then re-cut
        from .replan import search_for_speeds

        uniform = cluster.model_copy(update={"device_speeds": {}})
        s = _Search(model, uniform, workload, options or SearchOptions())
        return search_for_speeds(s.run, lambda: [x.plan.model_copy(update={"cluster": cluster}) for x in s.scored],
                                 cluster)
    return _Search(model, cluster, workload, options or SearchOptions()).run()
