"""Per-step decisions on the live workload (no torch import).

`plan_step` is the entry point for variable-length batches: it returns the `StepPlan` (micro-
batches, sequence-parallel groups, which sequences each group runs) predicted fastest for this
step's lengths; see `seqpar` (groups), `seqcost` (the cost of a sequence at an SP degree) and
`balance` (data-parallel rank balancing).
"""
from __future__ import annotations

from ..plan import Plan, StepPlan
from ..spec.cluster import ClusterSpec
from ..spec.model import ModelSpec
from .balance import RankAssignment, balance_ranks
from .seqcost import SeqCostModel, cost_model_from_budget, cost_model_from_plan
from .seqpar import plan_sequence_parallel, solve_step

__all__ = ["plan_step", "cost_model", "SeqCostModel", "cost_model_from_budget", "cost_model_from_plan",
           "plan_sequence_parallel", "solve_step", "balance_ranks", "RankAssignment"]


def cost_model(model: ModelSpec, cluster: ClusterSpec, plan_or_budget: Plan | float | None,
               recompute: str = "selective", dtype: str = "bf16") -> SeqCostModel:
    """A static plan gives budget, recompute and ZeRO stage; a number is the activation budget in
    bytes per device (ZeRO-3 over all devices, `recompute`); None derives it from ZeRO-3."""
    if isinstance(plan_or_budget, Plan):
        plan_or_budget.check_matches(model, cluster.num_gpus)
        return cost_model_from_plan(plan_or_budget)
    return cost_model_from_budget(model, cluster, plan_or_budget, recompute, dtype)


def plan_step(step: int, seq_lens, model: ModelSpec, cluster: ClusterSpec,
              plan_or_budget: Plan | float | SeqCostModel | None, time_budget_s: float = 0.1) -> StepPlan:
    """The predicted-fastest StepPlan for this step's sequence lengths (never slower than the best
    single static SP degree). Pass a prebuilt `SeqCostModel` to skip rebuilding it every step."""
    cost = plan_or_budget if isinstance(plan_or_budget, SeqCostModel) else cost_model(model, cluster, plan_or_budget)
    return plan_sequence_parallel(step, seq_lens, cost, time_budget_s)
