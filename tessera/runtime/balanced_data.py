"""Data-parallel ranks balanced by predicted time (OVERLORD / MegaScale-Omni), not by rows.

A packed global batch holds the same number of tokens in every row, but not the same work: the
attention term is quadratic in each document's length, so a row holding one long document costs
far more than a row of short ones, and the rank that gets it sets the step. `BalancedLoader`
reads the whole global batch, predicts each row's time from its documents' lengths (the static
plan's cost per token and per token**2, `tessera.adapt.seqcost.plan_sequence_cost`) and gives
rank r, micro-batch m the rows `tessera.adapt.balance.balance_rows` assigns (the same number to
every rank and micro-batch). It only permutes rows within a global batch: the data position, the
global batch and so the loss and gradients are those of the unbalanced loader (exact resume at
any world size). Each batch carries the predicted time of every rank (`rank_times_s`), which the
trainer logs as max / mean.
"""
from __future__ import annotations

import numpy as np
import torch

from ..adapt.balance import balance_rows, sequence_costs


def row_costs(doc_ids: torch.Tensor, lin: float, attn: float) -> np.ndarray:
    """Predicted seconds of every row: the sum over its documents of lin L + attn L**2."""
    out = np.zeros(doc_ids.shape[0])
    for r, row in enumerate(doc_ids.cpu()):
        lens = torch.unique_consecutive(row, return_counts=True)[1].numpy()
        out[r] = float(sequence_costs(lens, lin, attn).sum())
    return out


class BalancedLoader:
    """This rank's rows of each global batch, assigned by predicted time (module docstring)."""

    def __init__(self, loader, dp_rank: int, dp_size: int, num_micro_batches: int, lin: float, attn: float):
        if loader.dp_size != 1:
            raise ValueError("BalancedLoader wraps a loader that reads whole global batches (dp_size 1)")
        self.loader = loader
        self.dp_rank, self.dp_size, self.num_micro_batches = dp_rank, dp_size, num_micro_batches
        self.lin, self.attn = lin, attn

    def __getattr__(self, name):  # samples_seen, vocab_size, epoch, ... of the wrapped loader
        return getattr(self.loader, name)

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.loader)
        return self._mine(batch)

    def _mine(self, batch):
        costs = row_costs(batch.doc_ids, self.lin, self.attn)
        assignment = balance_rows(costs, self.dp_size, self.num_micro_batches)
        rows = [i for m in range(self.num_micro_batches) for i in assignment.parts[m][self.dp_rank]]
        index = torch.tensor(rows, dtype=torch.long)
        mine = type(batch)(*(t[index] for t in (batch.tokens, batch.labels, batch.positions, batch.doc_ids)),
                           packed=batch.packed, num_targets=batch.num_targets)
        mine.rank_times_s = assignment.loads.sum(axis=0).tolist()
        return mine

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)
