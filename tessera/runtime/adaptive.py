"""`tessera train --adaptive`: every step's documents run on per-step sequence-parallel groups.

The static plan must keep the model replicated (pp=1, tp=1, no ZeRO): the groups change every
step, so no layout can be baked into the parameters. Each step:

1. the step's global batch (the same on every rank) is cut into its documents: a packed row of
   the data loader holds several, split where `doc_ids` change; each document keeps the labels it
   has in the packed row, so the loss equals the static run's on the same batch;
2. rank 0 plans the step (`tessera.adapt.plan_step`: group sizes, which documents each runs),
   having started it in the background while the previous step trained, and broadcasts it;
3. `AdaptiveStepRunner` runs each group's documents packed with Ulysses attention and all-reduces
   the gradients of the global mean loss.

The data position advances exactly as in a static run (the next batch is read with `batch_at`,
which does not move it), so checkpoints and resume are unchanged.
"""
from __future__ import annotations

import logging

import torch

from ..errors import TesseraError
from ..plan import Plan

log = logging.getLogger(__name__)


def check_adaptive_plan(plan: Plan) -> None:
    """Refuse a static plan whose parameters are not replicated on every rank."""
    if plan.pipeline.degree != 1:
        raise TesseraError(f"--adaptive needs a plan without pipeline parallelism (pipeline.degree is {plan.pipeline.degree})")
    cfg = plan.model.config
    if cfg is not None and (cfg.router_aux_loss_coef or cfg.router_z_loss_coef):
        raise TesseraError("--adaptive does not add the MoE router losses to the loss; set the model's "
                           "router_aux_loss_coef and router_z_loss_coef to 0 or train without --adaptive")
    for i, s in enumerate(plan.layers):
        if s.tp != 1 or s.sp_degree != 1 or s.zero != 0 or s.ep != 1:
            raise TesseraError(
                f"--adaptive needs a replicated data-parallel plan (tp=1, no Ulysses, zero=0, ep=1); "
                f"layer {i} has {s.describe()}")


def documents(batch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) of every document of every row, in row order."""
    docs = []
    doc_ids = getattr(batch, "doc_ids", None)
    for row in range(batch.tokens.shape[0]):
        tokens, labels = batch.tokens[row], batch.labels[row]
        if doc_ids is None:
            docs.append((tokens, labels))
            continue
        lens = torch.unique_consecutive(doc_ids[row], return_counts=True)[1].tolist()
        docs.extend(zip(tokens.split(lens), labels.split(lens)))
    return docs


class AdaptiveSteps:
    """Plans and runs the steps of an adaptive run for a `Trainer` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, plan: Plan, time_budget_s: float = 0.1):
        from ..adapt import cost_model
        from .varlen import AdaptiveStepRunner

        check_adaptive_plan(plan)
        cost = cost_model(plan.model, plan.cluster, plan)
        self.runner = AdaptiveStepRunner(model, cost=cost, time_budget_s=time_budget_s)
        self.last_plan = None

    def forward_backward(self, step: int, batch, next_batch=None) -> float:
        """Gradients of the global mean loss of `batch` (on every rank); returns that loss."""
        docs = documents(batch)
        lens = [int(x.numel()) for x, _ in docs]
        step_plan = self.runner.plan(step, lens)
        if next_batch is not None:  # rank 0 solves the next step while this one trains
            self.runner.prefetch(step + 1, [int(x.numel()) for x, _ in documents(next_batch)])
        self.last_plan = step_plan
        return self.runner.forward_backward(step_plan, docs)

    def close(self) -> None:
        self.runner.close()
