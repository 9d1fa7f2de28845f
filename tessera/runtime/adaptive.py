"""`tessera train --adaptive`: every step's documents run on per-step sequence-parallel groups,
each length group under its own strategy (ZeRO working mode, recompute per group).

The static plan gives the layout (pipeline degree 1; one tp / zero / dp_shard for every layer):
its parameters are sharded as it says (FSDP2 ZeRO / HSDP over units of tp ranks, DTensor TP inside
a unit) or replicated (DDP), and the groups change every step (`runtime/varlen.py`). Each step:

1. the step's global batch (the same on every rank) is cut into its documents: a packed row of
   the data loader holds several, split where `doc_ids` change; each document keeps the labels it
   has in the packed row, so the loss equals the static run's on the same batch. A document longer
   than any plan holds is refused in one line, skipped or truncated (`long_documents`);
2. rank 0 plans the step (`tessera.adapt.plan_step`: phases, group sizes, which documents each
   runs), having started it in the background while the previous step trained, and broadcasts it;
3. `AdaptiveStepRunner` runs each group's documents packed with Ulysses attention.

The data position advances exactly as in a static run (the next batch is read with `batch_at`,
which does not move it), so checkpoints and resume are unchanged.
"""
from __future__ import annotations

import logging

import torch

from ..errors import TesseraError
from ..plan import Plan, Recompute

log = logging.getLogger(__name__)

LONG_DOCUMENTS = ("error", "skip", "truncate")


def check_adaptive_plan(plan: Plan) -> None:
    """Refuse, in one line, a static plan whose layout per-step groups cannot run on."""
    from ..adapt.seqcost import layout_of_plan

    cfg = plan.model.config
    if cfg is not None and (cfg.router_aux_loss_coef or cfg.router_z_loss_coef):
        raise TesseraError("--adaptive does not add the MoE router losses to the loss; set the model's "
                           "router_aux_loss_coef and router_z_loss_coef to 0 or train without --adaptive")
    layout_of_plan(plan)


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


def fit_documents(docs, longest: int, policy: str, step: int,
                  warn: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Documents no plan can hold (longer than `longest` tokens): refused, skipped or truncated."""
    too_long = [int(x.numel()) for x, _ in docs if x.numel() > longest]
    if not too_long:
        return docs
    if policy == "error":
        raise TesseraError(f"step {step}: a document of {max(too_long)} tokens does not fit in memory under any "
                           f"plan: the longest that fits is {longest} tokens (train with --long-documents skip "
                           f"or truncate, or use more devices)")
    if warn:
        log.warning("step %d: %d document(s) longer than the %d tokens that fit (longest %d): %s", step,
                    len(too_long), longest, max(too_long), "skipped" if policy == "skip" else "truncated")
    if policy == "skip":
        kept = [(x, y) for x, y in docs if x.numel() <= longest]
        if not kept:
            raise TesseraError(f"step {step}: every document is longer than the {longest} tokens that fit")
        return kept
    return [(x[:longest], y[:longest]) for x, y in docs]


class AdaptiveSteps:
    """Plans and runs the steps of an adaptive run for a `Trainer` (see the module docstring)."""

    def __init__(self, parallel, plan: Plan, time_budget_s: float = 0.1, switching: bool = True,
                 long_documents: str = "error"):
        from ..adapt import cost_model, longest_fitting
        from ..adapt.seqcost import default_strategy, layout_of_plan
        from .varlen import AdaptiveStepRunner

        if long_documents not in LONG_DOCUMENTS:
            raise TesseraError(f"long_documents must be one of {', '.join(LONG_DOCUMENTS)}, not {long_documents!r}")
        layout = layout_of_plan(plan)
        default = default_strategy(plan)
        self.costs = cost_model(plan.model, plan.cluster, plan, switching=switching)
        self.longest = longest_fitting(self.costs)
        self.long_documents = long_documents
        self.runner = AdaptiveStepRunner(parallel, costs=self.costs, time_budget_s=time_budget_s, tp=layout.tp,
                                         default_zero=default.zero, default_recompute=Recompute(default.recompute))
        self.last_plan = None

    def _documents(self, step: int, batch, warn: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return fit_documents(documents(batch), self.longest, self.long_documents, step, warn)

    def forward_backward(self, step: int, batch, next_batch=None) -> float:
        """Gradients of the global mean loss of `batch` (on every rank); returns that loss."""
        docs = self._documents(step, batch)
        lens = [int(x.numel()) for x, _ in docs]
        step_plan = self.runner.plan(step, lens)
        if next_batch is not None:  # rank 0 solves the next step while this one trains
            try:
                ahead = [int(x.numel()) for x, _ in self._documents(step + 1, next_batch, warn=False)]
            except TesseraError:
                ahead = None  # refused when its turn comes
            if ahead is not None:
                self.runner.prefetch(step + 1, ahead)
        self.last_plan = step_plan
        return self.runner.forward_backward(step_plan, docs)

    def close(self) -> None:
        self.runner.close()
