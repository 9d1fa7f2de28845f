"""A step's plan: length groups (phases, HotSPa, Ge et al. SOSP'24), each in its own ZeRO working
mode, cut into micro-batches of sequence-parallel groups each with its own recompute (`seqpar`);
the entry point `solve_step`.

A run's strategies (`seqcost.StrategySet`: ZeRO working mode x recompute over one storage layout)
price the same sequences differently: a long document at a high degree has memory to spare and
runs fastest without recompute; short documents beside it fill a device's memory and want
selective or full recompute; a phase with many micro-batches saves its per-micro-batch parameter
gathers by keeping the parameters gathered (working mode 2 or 1), if its memory allows. Recompute
is local to a group's ranks, so it is chosen per group (the classes of `seqpar.Items`); the
working mode is collective over a shard group, so it is chosen per phase. A step runs its phases
one after the other; switching costs what `SeqCostModel.phase_time` charges (a gather when a
phase keeps parameters that the previous one sharded, a reduce-scatter when a phase that
accumulated unsharded gradients ends).

Candidates, each started only while the budget (a `Deadline`, wall clock by default) lasts:
1. the best static degree under the default strategy (so the plan is never predicted slower than
   a static one);
2. one phase in the default working mode, every recompute per group (`solve_adaptive`), and its
   groups moved to every other working mode whose memory holds them (`reprice`);
3. two phases: the long sequences' micro-batch (with the short ones that fit beside them) in the
   mode that runs the longest sequence fastest, then the rest in the modes with the lowest bound
   for them, in the order that hides the most of the gradient sync;
4. one phase solved in the other working mode with the most memory;
5. the exact MILP (`seqmilp`) on each micro-batch of the plan of 2 small enough to solve in the
   time left (HiGHS; at a few hundred sequences on 64+ devices it is not).
`step_lower_bound` bounds every plan over all strategies (a relaxation, see there).

No torch import.
"""
from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import replace

import numpy as np

from ..errors import TesseraError
from ..plan import MicroBatchPlan, PhasePlan, SPGroupAssignment, StepPlan
from .seqcost import SeqCostModel, StrategySet
from .seqpar import (Deadline, Items, MicroBatchSolution, Phase, StepSolution, _solve_split, best_static,
                     fluid_bound, item_options, milp_binaries, peel, solve_adaptive)

log = logging.getLogger(__name__)

_MILP_MAX_BINARIES = 2500
_MILP_MIN_LEFT_S = 0.005


def as_strategy_set(costs) -> StrategySet:
    if isinstance(costs, StrategySet):
        return costs
    if isinstance(costs, SeqCostModel):
        from .seqcost import Layout

        return StrategySet(layout=Layout(num_ranks=costs.num_devices * costs.tp, tp=costs.tp), models=(costs,))
    raise TypeError(f"expected a StrategySet or a SeqCostModel, got {type(costs).__name__}")


def compose(phases: list[Phase], costs: StrategySet) -> float:
    """Seconds of a step that runs these phases in this order (see `SeqCostModel.phase_time`)."""
    phases = [p for p in phases if p.micro_batches]
    if not phases:
        return 0.0
    total = costs.default.optimizer_s
    for i, p in enumerate(phases):
        c = costs.models[p.strategy]
        prev = costs.models[phases[i - 1].strategy] if i else None
        nxt = costs.models[phases[i + 1].strategy] if i + 1 < len(phases) else None
        gather_first = prev is None or prev.zero == 3
        reduce_last = nxt is None or nxt.zero >= 2
        total += c.phase_time([m.slowest_s for m in p.micro_batches], gather_first, reduce_last, nxt is None)
        total += c.accumulate_s * (len(p.micro_batches) - (1 if i == 0 else 0))
    return total


def longest_fitting(costs: StrategySet) -> int:
    """The longest document any strategy can hold (on one group of all units)."""
    return max(c.longest_fitting for c in costs)


def check_lengths(seq_lens, costs: StrategySet) -> None:
    """One sentence for a document longer than any plan holds."""
    lens = np.asarray(seq_lens)
    limit = longest_fitting(costs)
    if lens.size and lens.max() > limit:
        raise TesseraError(f"a document of {int(lens.max())} tokens does not fit in memory under any plan: "
                           f"the longest that fits is {limit} tokens (skip or truncate such documents, or "
                           f"use more devices)")


def by_zero(costs: StrategySet) -> dict[int, list[int]]:
    """Model indices per ZeRO working mode, the default's recompute (or the default) first: the
    classes of one phase's items (`seqpar.Items`)."""
    default_rc = costs.default.strategy.recompute
    out: dict[int, list[int]] = {}
    for k, c in enumerate(costs):
        out.setdefault(c.zero, []).append(k)
    for z, ks in out.items():
        ks.sort(key=lambda k: (k != 0, costs.models[k].strategy.recompute != default_rc, k))
    return out


def phase_items(lens: np.ndarray, costs: StrategySet, models: list[int]) -> Items:
    return Items.of_sequences(lens, [costs.models[k] for k in models], models[0])


def step_lower_bound(items: list[Items], costs: StrategySet) -> float:
    """No plan over these strategies is faster: every sequence runs in some class (degree,
    recompute, working mode) that finishes it within T, the devices are shared fluidly
    (device-seconds <= N (T - the least fixed cost of a group)) and memory binds each sequence
    alone; the smallest such T, plus the least any strategy adds to one micro-batch of it (its
    traffic, the gradient sync, the optimizer)."""
    fixed = min(float(b.alpha.min()) for b in items)
    t = fluid_bound([item_options(b) for b in items], items[0].N, fixed)
    return min(c.step_time([t]) for c in costs)


def _bound(b: Items, idx: np.ndarray) -> float:
    """A quick lower bound of one phase running `idx`: max(slowest item, device-seconds / N)."""
    if idx.size == 0:
        return 0.0
    if not b.fits(idx):
        return math.inf
    t, area = b.best_times(idx)
    return max(float(t.max()), float(area.sum()) / b.N)


def reprice(phase: Phase, to: list[int], costs: StrategySet, lens: np.ndarray) -> Phase | None:
    """The same groups under another working mode (`to`: its models, one per recompute): each
    group keeps its degree and recompute, so its compute; None if a group does not fit there."""
    src = costs.models[phase.strategy]
    dst = {costs.models[k].strategy.recompute: costs.models[k] for k in to}
    here = {costs.models[k].strategy.recompute: costs.models[k] for k in by_zero(costs)[src.zero]}
    mbs = []
    for mb in phase.micro_batches:
        groups = []
        for g in mb.groups:
            rc = g.recompute or src.strategy.recompute
            model = dst.get(rc)
            if model is None:
                return None
            j = model.degree_index(g.degree)
            old = here[rc]
            if lens[g.sequences].sum() > model.cap_tokens[j] * (1 + 1e-12):
                return None
            groups.append(replace(g, time_s=g.time_s - old.alpha_s[j] + model.alpha_s[j]))
        slowest = max((g.time_s for g in groups), default=0.0)
        mbs.append(MicroBatchSolution(groups, costs.models[to[0]].micro_batch_time(slowest), slowest))
    return Phase(to[0], mbs)


def _variants(phase: Phase, costs: StrategySet, lens: np.ndarray) -> list[Phase]:
    """The phase under every working mode whose memory holds its groups."""
    out = [phase]
    src = costs.models[phase.strategy].zero
    for z, ks in by_zero(costs).items():
        if z != src:
            moved = reprice(phase, ks, costs, lens)
            if moved is not None:
                out.append(moved)
    return out


def _best_variant(phases: list[Phase], costs: StrategySet, lens: np.ndarray, method: str) -> StepSolution:
    """The fastest of every combination of the phases' variants, in either order (two phases)."""
    best = None
    for combo in itertools.product(*(_variants(p, costs, lens) for p in phases)):
        orders = (list(combo),) if len(combo) == 1 else (list(combo), list(combo)[::-1])
        for order in orders:
            t = compose(order, costs)
            if best is None or t < best.time_s:
                best = StepSolution(order, t, method)
    return best


def _two_phases(items: dict[int, Items], costs: StrategySet, lens: np.ndarray, best: float,
                deadline: Deadline) -> StepSolution | None:
    """The long sequences' micro-batch under the working mode fastest for the longest sequence,
    the rest under the modes with the lowest bound for them (module docstring)."""
    idx = np.arange(len(lens))
    longest = {z: b.slowest_item_s(idx) if b.fits(idx) else math.inf for z, b in items.items()}
    za = min(longest, key=longest.get)
    if not np.isfinite(longest[za]):
        return None
    out = peel(items[za], idx, longest[za])
    if out is None or out[2].size == 0:
        return None
    first, _, rest = out
    ranked = sorted((z for z, b in items.items() if b.fits(rest)), key=lambda z: _bound(items[z], rest))
    result = None
    for z in ranked[:2]:
        if deadline.passed():
            break
        if _bound(items[z], rest) + longest[za] > best:
            continue
        then, _ = _solve_split(items[z], rest, deadline)
        if then is None:
            continue
        if z == za:
            phases = [Phase(items[za].strategy, sorted([first] + then.micro_batches, key=lambda m: m.slowest_s))]
        else:
            phases = [Phase(items[za].strategy, [first]), Phase(items[z].strategy, then.micro_batches)]
        sol = _best_variant(phases, costs, lens, "switching")
        if result is None or sol.time_s < result.time_s:
            result = sol
    return result


def _refine_with_milp(sol: StepSolution, bundles: list[Items], costs: StrategySet,
                      deadline: Deadline) -> StepSolution:
    """Each micro-batch (one phase) re-solved exactly where its MILP is small enough for the time left."""
    from .seqmilp import milp_micro_batch  # scipy.optimize: imported only when it runs

    if len(sol.phases) != 1 or len(bundles) != len(sol.micro_batches):
        return sol
    refined, changed = [], False
    for mb, bundle in zip(sol.micro_batches, bundles):
        left = deadline.left()
        idx = np.arange(bundle.n)
        exact = None
        if (left > _MILP_MIN_LEFT_S and mb.slowest_s > bundle.lower_bound(idx) * (1 + 1e-3)
                and milp_binaries(bundle.n, bundle) <= _MILP_MAX_BINARIES):
            exact = milp_micro_batch(bundle, idx, time_limit_s=left)
        better = exact is not None and exact.time_s < mb.time_s * (1 - 1e-9)
        refined.append(exact if better else mb)
        changed |= better
    if not changed:
        return sol
    phase = Phase(sol.phases[0].strategy, sorted(refined, key=lambda m: m.slowest_s))
    return StepSolution([phase], compose([phase], costs), sol.method + "+milp")


def solve_step(seq_lens, costs: StrategySet | SeqCostModel, time_budget_s: float = 0.1,
               use_milp: bool = True, clock=time.perf_counter) -> StepSolution:
    """The fastest plan found for this step within `time_budget_s` of wall time (module docstring;
    `clock`: another clock for the budget, e.g. `time.process_time`).

    Never predicted slower than the best static degree under the default strategy, whose plan is
    computed first. `details`: the static and adaptive (default strategy) times, wall seconds."""
    start = time.perf_counter()
    deadline = Deadline(time_budget_s, clock)
    costs = as_strategy_set(costs)
    lens = np.asarray(seq_lens, dtype=np.float64)
    if lens.size == 0:
        raise TesseraError("a step needs at least one sequence")
    check_lengths(lens, costs)
    b0 = Items.of_sequences(lens, costs.default, 0)
    static = None
    if b0.fits():
        statics = [s for s in (best_static(b0, "cost"), best_static(b0, "tokens")) if s is not None]
        static = min(statics, key=lambda s: s.time_s, default=None)
    candidates = [static] if static is not None else []
    zeros = by_zero(costs)
    items = {z: phase_items(lens, costs, ks) for z, ks in zeros.items()}
    # One phase under the run's own working mode, every recompute per group, and its groups
    # moved to the other working modes; two phases; then, while time is left, one phase solved
    # under the other mode with the most memory.
    adaptive, bundles = None, []
    began = deadline.clock()
    if items[costs.default.zero].fits():
        adaptive, bundles = solve_adaptive(items[costs.default.zero], deadline=deadline)
    took = deadline.clock() - began  # what a whole solve costs: start another only with that much left
    if adaptive is not None:
        candidates.append(adaptive)
        if len(zeros) > 1:
            candidates.append(_best_variant(adaptive.phases, costs, lens, "adaptive"))
    best_time = min((s.time_s for s in candidates), default=math.inf)
    if len(zeros) > 1 and deadline.left() > 0.5 * took:
        two = _two_phases(items, costs, lens, best_time, deadline)
        if two is not None:
            candidates.append(two)
    others = sorted((z for z in items if z != costs.default.zero), key=lambda z: -items[z].cap.max())
    for z in others[:1]:
        if deadline.left() < took or not items[z].fits():
            continue
        sol, _ = solve_adaptive(items[z], deadline=deadline)
        if sol is not None:
            candidates += [sol, _best_variant(sol.phases, costs, lens, "adaptive")]
    if not candidates:
        raise TesseraError("no sequence-parallel plan fits this batch in memory; use more devices or recompute")
    best = min(candidates, key=lambda s: s.time_s)
    if use_milp and best is adaptive and not deadline.passed():
        best = _refine_with_milp(best, bundles, costs, deadline)
    if best is not static:
        own = costs.default.strategy.recompute
        switched = (len(best.phases) > 1 or best.phases[0].strategy != 0
                    or any(g.recompute not in ("", own) for m in best.micro_batches for g in m.groups))
        best.method = ("switching" if switched else "adaptive") + ("+milp" if best.method.endswith("+milp") else "")
    best.details = {"static_best_s": static.time_s if static else math.inf,
                    "static_best_method": static.method if static else None,
                    "adaptive_s": adaptive.time_s if adaptive else math.inf,
                    "solve_s": time.perf_counter() - start}
    return best


# --- the StepPlan the runtime runs ------------------------------------------------------------------


def layout(mb: MicroBatchSolution, num_units: int, tp: int = 1) -> MicroBatchPlan:
    """Largest groups first at aligned offsets (in units of tp ranks); spare units become idle
    groups of one unit."""
    groups = sorted(mb.groups, key=lambda g: (-g.degree, g.sequences[:1]))
    out, offset = [], 0
    for g in groups:
        ranks = tuple(range(offset * tp, (offset + g.degree) * tp))
        out.append(SPGroupAssignment(ranks=ranks, sequences=tuple(g.sequences), recompute=g.recompute or None,
                                     predicted_time_s=float(g.time_s)))
        offset += g.degree
    for u in range(offset, num_units):
        out.append(SPGroupAssignment(ranks=tuple(range(u * tp, (u + 1) * tp)), sequences=()))
    return MicroBatchPlan(groups=tuple(out), predicted_time_s=mb.time_s)


def to_step_plan(step: int, seq_lens, sol: StepSolution, costs: StrategySet) -> StepPlan:
    costs = as_strategy_set(costs)
    tp = costs.layout.tp
    phases = []
    for p in sol.phases:
        phases.append(PhasePlan(zero=costs.models[p.strategy].zero,
                                micro_batches=tuple(layout(m, costs.layout.units, tp) for m in p.micro_batches)))
    return StepPlan(step=step, seq_lens=tuple(int(x) for x in seq_lens), tp=tp, phases=tuple(phases),
                    predicted_time_s=sol.time_s,
                    strategy="static" if sol.method.startswith("static") else
                    ("switching" if len(phases) > 1 or sol.method.startswith("switching") else "adaptive"))


def plan_sequence_parallel(step: int, seq_lens, costs: StrategySet | SeqCostModel,
                           time_budget_s: float = 0.1) -> StepPlan:
    """StepPlan for one step's batch (see the module docstring)."""
    costs = as_strategy_set(costs)
    sol = solve_step(seq_lens, costs, time_budget_s)
    log.debug("step %d: %s %.4fs (best static %.4fs) solved in %.1f ms", step, sol.method, sol.time_s,
              sol.details["static_best_s"], 1e3 * sol.details["solve_s"])
    return to_step_plan(step, seq_lens, sol, costs)
