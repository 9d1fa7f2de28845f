"""Per-step decisions on the live workload (no torch import).

`plan_step` is the entry point for variable-length batches: it returns the `StepPlan` (length
groups with their strategies, micro-batches, sequence-parallel groups, which sequences each group
runs) predicted fastest for this step's lengths; see `switching` (strategies per length group,
the solver's budget), `seqpar` (groups under one strategy), `seqcost` (the cost of a group,
priced by `tessera.cost`) and `balance` (data-parallel rank balancing by predicted time).
"""
from __future__ import annotations

from ..plan import Plan, StepPlan
from ..spec.cluster import ClusterSpec
from ..spec.model import ModelSpec
from .balance import RankAssignment, balance_ranks
from .seqcost import (Layout, SeqCostModel, Strategy, StrategySet, build_cost_model, cost_model_from_budget,
                      cost_model_from_plan)
from .switching import check_lengths, longest_fitting, plan_sequence_parallel, solve_step

__all__ = ["plan_step", "cost_model", "SeqCostModel", "Strategy", "StrategySet", "Layout", "build_cost_model",
           "cost_model_from_budget", "cost_model_from_plan", "plan_sequence_parallel", "solve_step",
           "check_lengths", "longest_fitting", "balance_ranks", "RankAssignment"]


def cost_model(model: ModelSpec, cluster: ClusterSpec, plan: Plan | None = None, recompute: str = "selective",
               dtype: str = "bf16", switching: bool = False) -> StrategySet:
    """The strategies of an adaptive run: a static plan gives its layout (TP, ZeRO shard group),
    recompute and ZeRO stage; without one, ZeRO-3 over all devices with `recompute`."""
    if isinstance(plan, Plan):
        plan.check_matches(model, cluster.num_gpus)
        return cost_model_from_plan(plan, switching)
    return cost_model_from_budget(model, cluster, recompute, dtype, switching=switching)


def plan_step(step: int, seq_lens, costs: StrategySet | SeqCostModel, time_budget_s: float = 0.1) -> StepPlan:
    """The predicted-fastest StepPlan for this step's sequence lengths (never slower than the best
    single static SP degree under the run's own strategy). Build `costs` once per run."""
    return plan_sequence_parallel(step, seq_lens, costs, time_budget_s)
