"""Re-planning for devices of unequal speed (Malleus): `replan(plan, speeds)`.

A straggler slows every synchronous step to its pace. Malleus answers by re-assigning work, not by
changing the parallel strategy: keep every layer's strategy, the pipeline degree and schedule and
the micro-batch count; move layers between pipeline stages and sequences between data-parallel
replicas so that the slow devices get less of both. Here, with v(r, j) the speed of the slowest
device of replica j on pipeline rank r (`cost/hetero.py`):

Variables
    split    the pipeline's layer ranges (one chunk per rank; interleaved plans keep theirs)
    rows_j   sequences of replica j per step, a multiple of the m micro-batches, sum = G
Objective
    the cost model's step (`evaluate`): the slowest replica's simulated pipeline + the largest tail
Method (each part exact for its own objective; the pairs are then scored by `evaluate`)
    `best_shares`   given a split, rows minimising max_j T_j(rows_j), T_j the replica's predicted
                    makespan (affine in rows_j: simulated at the nominal share and twice it), no
                    replica above the rows whose activations still fit (`max_rows_ratio`). Units
                    of m sequences go one at a time to the replica whose time after taking it is
                    least; for nondecreasing T_j, identical units and per-replica caps that greedy
                    is optimal (an exchange argument; the tests check it against enumeration).
    `best_split`    given rows, the split minimising the largest per-micro-batch stage time
                    max_j rho_j sum_l (F_l + B_l + (1/v(r, j) - 1) C_l) of any rank r, among splits
                    whose every rank fits in memory (the partition program of `partition.py`,
                    exact for that min-max).
    `replan`        scores (current split, equal shares), (current split, best shares),
                    (best split for equal shares, its best shares) and (best split for those
                    shares, its best shares), and returns the fastest that fits.
On 1,024 GPUs it takes tens of milliseconds (the simulator runs once per distinct replica).
"""
from __future__ import annotations

import heapq
import time
from collections.abc import Mapping, Sequence

import numpy as np

from ..cost.evaluate import _per_layer_costs, _scalar, evaluate, plan_context, stage_memory, usable_memory
from ..cost.hetero import block_speed
from ..cost.memory import memory_budget, required_memory
from ..cost.schedule import in_flight, simulate
from ..cost.layer import pipeline_p2p_time
from ..plan import PipelineSpec, Plan, SearchInfo
from ..spec.cluster import ClusterSpec
from .partition import min_max_partition


def with_speeds(plan: Plan, speeds: Mapping[int, float] | Sequence[float], keep_shares: bool = False) -> Plan:
    """`plan` on its cluster with these device speeds (a list per rank, or rank -> speed; speeds
    within 1% of 1 are left out), batch shares equal again unless `keep_shares`."""
    if not isinstance(speeds, Mapping):
        speeds = dict(enumerate(speeds))
    kept = {int(r): round(float(v), 4) for r, v in speeds.items() if abs(float(v) - 1.0) > 0.01}
    cluster = ClusterSpec.model_validate({**plan.cluster.model_dump(), "device_speeds": kept})
    shares = plan.batch_shares if keep_shares else ()
    return _checked(plan.model_copy(update={"cluster": cluster, "batch_shares": shares, "prediction": None}))


def _checked(plan: Plan) -> Plan:
    plan._check()  # model_copy does not validate
    return plan


def _nominal_rows(plan: Plan) -> float:
    return plan.workload.global_batch / plan.dp_of_batch


def replica_times(plan: Plan) -> list[tuple[float, float]]:
    """Per replica j, (a_j, b_j) with T_j(rows) = a_j + b_j * rows / nominal: its predicted
    pipeline makespan plus tail, simulated at the nominal share and twice it."""
    ctx = plan_context(plan)
    costs = _per_layer_costs(plan, ctx)
    pipe = plan.pipeline
    hidden = max(layer.hidden for layer in plan.model.layers)
    p2p = pipeline_p2p_time(hidden, ctx) if pipe.degree > 1 else 0.0
    chunk = [[(_scalar(costs[i], "fwd"), _scalar(costs[i], "bwd"), _scalar(costs[i], "wgrad"),
               _scalar(costs[i], "compute_fwd"), _scalar(costs[i], "compute_bwd")) for i in range(s, e)]
             for s, e in pipe.stages]
    sums = [tuple(sum(x[k] for x in c) for k in range(5)) for c in chunk]
    cache: dict[tuple, tuple[float, float]] = {}
    out = []
    for j in range(plan.dp_of_batch):
        speeds = tuple(block_speed(plan, r, j) for r in range(pipe.degree))
        if speeds not in cache:
            slow = [1.0 / speeds[pipe.rank_of_chunk(c)] - 1.0 for c in range(len(sums))]
            at = []
            for rho in (1.0, 2.0):
                sim = simulate(pipe.schedule.value,
                               [rho * (f + s * cf) for (f, _, _, cf, _), s in zip(sums, slow)],
                               [rho * (b + s * cb) for (_, b, _, _, cb), s in zip(sums, slow)],
                               plan.num_micro_batches, pipe.degree, pipe.virtual_stages, p2p,
                               [rho * w * (1.0 + s) for (_, _, w, _, _), s in zip(sums, slow)])
                at.append(sim.step_time)
            cache[speeds] = (2 * at[0] - at[1], at[1] - at[0])
        out.append(cache[speeds])
    return out


def max_rows_ratio(plan: Plan) -> float:
    """The largest rows / nominal share a replica may run and still fit: a replica's micro-batches
    grow with its rows, and so do its activations (`stage_memory` of the plan at equal shares)."""
    even = plan.model_copy(update={"batch_shares": ()})
    budget = memory_budget(plan.cluster)
    ratio = np.inf
    for mb in stage_memory(even):
        fixed = mb.params + mb.grads + mb.optimizer + mb.buffers - plan.cluster.device.reserved_bytes
        if mb.activations > 0:
            ratio = min(ratio, (budget - fixed) / mb.activations)
    return ratio


def best_shares(plan: Plan) -> tuple[int, ...]:
    """The rows per replica minimising the slowest replica's predicted time (module docstring),
    none above what fits in memory (equal shares when nothing else fits)."""
    m, G, dp = plan.num_micro_batches, plan.workload.global_batch, plan.dp_of_batch
    nominal = _nominal_rows(plan)
    cap = max(1, int(np.floor(max_rows_ratio(plan) * nominal / m + 1e-9))) if np.isfinite(max_rows_ratio(plan)) \
        else G // m
    if cap * dp < G // m:
        return tuple(plan.replica_rows())
    times = replica_times(plan)
    units = [1] * dp
    heap = [(a + b * 2 * m / nominal, j) for j, (a, b) in enumerate(times) if cap > 1]
    heapq.heapify(heap)
    for _ in range(G // m - dp):
        _, j = heapq.heappop(heap)
        units[j] += 1
        if units[j] < cap:
            a, b = times[j]
            heapq.heappush(heap, (a + b * (units[j] + 1) * m / nominal, j))
    return tuple(u * m for u in units)


def best_split(plan: Plan) -> tuple[tuple[int, int], ...] | None:
    """The stage split minimising the largest per-micro-batch stage time over replicas, among
    splits that fit in memory (one chunk per rank only; None: no split fits)."""
    pipe = plan.pipeline
    if pipe.degree == 1 or pipe.virtual_stages > 1:
        return pipe.stages
    ctx = plan_context(plan)
    costs = _per_layer_costs(plan, ctx)
    L = len(plan.model.layers)
    per_layer = np.array([[_scalar(c, "fwd") + _scalar(c, "bwd"), _scalar(c, "compute_fwd") + _scalar(c, "compute_bwd"),
                           _scalar(c, "params") + _scalar(c, "grads") + _scalar(c, "optimizer"), _scalar(c, "act"),
                           _scalar(c, "buf")] for c in costs])
    prefix = np.vstack([np.zeros(5), np.cumsum(per_layer, axis=0)])
    nominal = _nominal_rows(plan)
    rows = plan.replica_rows()
    rows_scale = max(rows) / nominal
    # per pipeline rank: distinct (rho, 1/v - 1) of its replicas
    factors = []
    for r in range(pipe.degree):
        seen = {(rows[j] / nominal, 1.0 / block_speed(plan, r, j) - 1.0) for j in range(plan.dp_of_batch)}
        factors.append(sorted(seen))
    budget = usable_memory(plan.cluster)

    def cost(r: int, s: int, e: int) -> float:
        total, compute, states, act, _ = prefix[e] - prefix[s]
        k = in_flight(pipe.schedule.value, pipe.degree, r, plan.num_micro_batches, 1)
        buf = float(per_layer[s:e, 4].max())
        if required_memory(states + k * act * rows_scale + buf, plan.cluster) > budget:
            return np.inf
        return max(rho * (total + slow * compute) for rho, slow in factors[r])

    _, split = min_max_partition(L, pipe.degree, cost)
    return split


def replan(plan: Plan, speeds: Mapping[int, float] | Sequence[float]) -> Plan:
    """`plan` re-cut for these device speeds (module docstring), with its prediction; the search
    info says what changed and the predicted step before and after."""
    t0 = time.perf_counter()
    base = with_speeds(plan, speeds)
    current = evaluate(with_speeds(plan, speeds, keep_shares=True))  # the plan as it runs, at these speeds
    before = evaluate(base)
    tried: list[Plan] = []

    def variant(stages, shares) -> Plan:
        pipe = base.pipeline.model_copy(update={"stages": tuple(stages)})
        p = _checked(base.model_copy(update={"pipeline": PipelineSpec.model_validate(pipe.model_dump()),
                                             "batch_shares": tuple(shares) if len(set(shares)) > 1 else ()}))
        tried.append(p)
        return p

    if plan.batch_shares:
        variant(base.pipeline.stages, plan.batch_shares)
    variant(base.pipeline.stages, ())
    variant(base.pipeline.stages, best_shares(base))
    split = best_split(base)
    if split is not None and split != base.pipeline.stages:
        even = variant(split, ())
        p = variant(split, best_shares(even))
        split2 = best_split(p)
        if split2 is not None and split2 != split:
            variant(split2, best_shares(variant(split2, ())))
    scored = [(pred.step_time_s, i, p, pred) for i, p in enumerate(tried)
              if (pred := evaluate(p)).fits or not before.fits]
    if not scored:
        return base.model_copy(update={"prediction": before})
    step, _, best, pred = min(scored, key=lambda x: (x[0], x[1]))
    slow = ", ".join(f"rank {r} at {v:g}x" for r, v in sorted(best.cluster.device_speeds.items())[:8])
    notes = (f"re-planned for unequal device speeds ({slow or 'all equal'}): predicted step "
             f"{current.step_time_s:.4g} s as the plan ran, {before.step_time_s:.4g} s with its split and "
             f"equal shares, {step:.4g} s now",
             f"layers per stage: {[e - s for s, e in best.pipeline.stages]}; sequences per data-parallel "
             f"replica: {best.replica_rows()}")
    info = SearchInfo(search_time_s=time.perf_counter() - t0, candidates=len(tried), explanation=notes)
    return best.model_copy(update={"prediction": pred, "search": info})


def search_for_speeds(run_search, plans_of, cluster: ClusterSpec, runner_ups: int = 10) -> Plan:
    """The static search on a cluster with device speeds: search as if every device ran at full
    speed (`run_search`), then re-plan its best plans of distinct structure (`plans_of`: the
    scored plans, best first) for the real speeds, and keep the fastest. The strategies come from
    the homogeneous search, the split and shares from `replan`; the search's proved lower bound
    holds when no device is faster than 1.0 (slower devices only lengthen a step)."""
    best = run_search()
    seen, out = set(), []
    for p in plans_of():
        key = (p.pipeline.degree, p.pipeline.schedule, p.num_micro_batches, p.layers)
        if key in seen:
            continue
        seen.add(key)
        out.append(replan(p, cluster.device_speeds))
        if len(out) >= runner_ups:
            break
    chosen = min(out, key=lambda p: p.prediction.step_time_s)
    bound = best.search.step_lower_bound_s if max(cluster.device_speeds.values(), default=1.0) <= 1.0 else 0.0
    info = best.search.model_copy(update={
        "step_lower_bound_s": bound, "explanation": chosen.search.explanation + best.search.explanation})
    return chosen.model_copy(update={"search": info})
