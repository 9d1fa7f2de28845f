"""Run a per-step `StepPlan` (tessera.adapt): sequence-parallel groups that change every step.

For each micro-batch of the plan, every rank finds its group, packs the group's sequences into one
sequence (document ids over the whole packed sequence for document-causal attention, positions
restarting at each document, padded to a multiple of the group size), takes its contiguous slice
of it and runs the model with `UlyssesAttention(group)` in every block (a group of one runs plain
attention).

Exactness: the step's loss is sum(per-token cross-entropy over the global batch) / (number of
target tokens in the global batch). Each rank back-propagates its slice's sum divided by that
global count, gradients accumulate over the micro-batches, and one all-reduce (sum) over all
ranks gives every rank the gradient of the global loss: sequence slices of one document add up
to its gradient, and ranks with nothing to run add zeros.

Groups: every aligned power-of-two block of consecutive ranks is created once at start, on all
ranks in the same order (`SPGroupCache`); a plan only selects among them.

Planning one step ahead: `AdaptiveStepRunner.prefetch(step, seq_lens)` starts rank 0 planning the
next step in a background thread while this one trains; `plan(step, seq_lens)` then takes that
result (or plans now) and broadcasts it, so every rank runs the same plan even when the solver's
time budget makes it depend on timing.

Attention is the model's document attention (`tessera.models.attention`): flex_attention with a
block-sparse document mask on CUDA, length-bucketed causal SDPA on CPU; never an S x S mask.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..plan import StepPlan
from .attention import UlyssesAttention

log = logging.getLogger(__name__)

IGNORE_INDEX = -100


class SPGroupCache:
    """Process groups for every aligned block of 2^k consecutive ranks (k = 0 .. log2 world)."""

    def __init__(self, world_size: int | None = None):
        self.world_size = world_size or dist.get_world_size()
        self.groups: dict[tuple[int, int], object] = {}
        size = 1
        while size <= self.world_size:
            for start in range(0, self.world_size - size + 1, size):
                # new_group is collective: every rank creates every group, in this order
                self.groups[(start, size)] = dist.new_group(list(range(start, start + size)))
            size *= 2

    def get(self, ranks: tuple[int, ...]):
        start, size = ranks[0], len(ranks)
        key = (start, size)
        if key not in self.groups or tuple(ranks) != tuple(range(start, start + size)):
            raise ValueError(f"ranks {ranks} are not an aligned power-of-two block of consecutive ranks")
        return self.groups[key]


@dataclass
class PackedShard:
    """This rank's slice of a group's packed sequence."""

    tokens: torch.Tensor  # (1, T/d)
    targets: torch.Tensor  # (1, T/d), IGNORE_INDEX on padding
    positions: torch.Tensor  # (1, T/d)
    doc_ids: torch.Tensor  # (1, T): document of every token of the FULL packed sequence


def pack_group(samples: list[tuple[torch.Tensor, torch.Tensor]], group_size: int, group_rank: int) -> PackedShard:
    """Concatenate (inputs, targets) documents, pad to a multiple of `group_size` (padding is one
    extra document whose targets are ignored), and cut out slice `group_rank`."""
    lens = [int(x.numel()) for x, _ in samples]
    total = sum(lens)
    pad = -total % group_size
    tokens = torch.cat([x.reshape(-1) for x, _ in samples] + [torch.zeros(pad, dtype=torch.long)])
    targets = torch.cat([y.reshape(-1) for _, y in samples] + [torch.full((pad,), IGNORE_INDEX, dtype=torch.long)])
    doc_lens = torch.tensor(lens + ([pad] if pad else []))
    doc = torch.repeat_interleave(torch.arange(len(doc_lens)), doc_lens)
    starts = torch.cumsum(doc_lens, 0) - doc_lens
    positions = torch.arange(total + pad) - starts[doc]
    n = total + pad
    part = slice(group_rank * n // group_size, (group_rank + 1) * n // group_size)
    return PackedShard(tokens[None, part], targets[None, part], positions[None, part], doc[None])


def install_ulysses(model: nn.Module) -> list[UlyssesAttention]:
    """Replace every block's attention core with a UlyssesAttention (group set per micro-batch)."""
    cores = []
    for block in model.layers.values():
        core = UlyssesAttention(None)
        block.attention.core = core
        cores.append(core)
    return cores


class AdaptiveStepRunner:
    """Runs StepPlans on a model that is replicated on every rank (gradients all-reduced here).

    runner = AdaptiveStepRunner(model, cost=seq_cost_model)       # on every rank, after init_process_group
    runner.prefetch(step + 1, next_seq_lens)                       # optional: plan the next step in background
    plan = runner.plan(step, seq_lens)                             # same StepPlan on every rank
    loss = runner.forward_backward(plan, samples)                  # samples: [(inputs, targets)] of the global batch
    optimizer.step(); optimizer.zero_grad()

    `samples` is the whole global batch, in the same order on every rank (each rank runs the
    sequences its groups are assigned); `loss` is the global mean per-token loss.
    """

    def __init__(self, model: nn.Module, cost=None, time_budget_s: float = 0.1, group_cache: SPGroupCache | None = None):
        self.model = model
        self.cost = cost
        self.time_budget_s = time_budget_s
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.groups = group_cache or SPGroupCache(self.world)
        self.cores = install_ulysses(model)
        self._pool = ThreadPoolExecutor(max_workers=1) if self.rank == 0 else None
        self._pending: dict[int, Future] = {}

    # --- planning ---------------------------------------------------------------------------
    def _solve(self, step: int, seq_lens) -> StepPlan:
        from ..adapt import plan_step

        if self.cost is None:
            raise ValueError("AdaptiveStepRunner needs a cost model (tessera.adapt.cost_model) to plan steps")
        return plan_step(step, list(seq_lens), None, None, self.cost, self.time_budget_s)

    def prefetch(self, step: int, seq_lens) -> None:
        """Start planning `step` on rank 0 in the background (call while the previous step trains)."""
        if self._pool is not None and step not in self._pending:
            self._pending[step] = self._pool.submit(self._solve, step, list(seq_lens))

    def plan(self, step: int, seq_lens) -> StepPlan:
        """The StepPlan for this step, planned on rank 0 (prefetched or now) and broadcast."""
        payload = [None]
        if self.rank == 0:
            future = self._pending.pop(step, None)
            plan = future.result() if future is not None else self._solve(step, seq_lens)
            payload = [plan.model_dump_json()]
        dist.broadcast_object_list(payload, src=0)
        return StepPlan.model_validate_json(payload[0])

    # --- execution --------------------------------------------------------------------------
    def forward_backward(self, plan: StepPlan, samples: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        if len(samples) != len(plan.seq_lens):
            raise ValueError(f"the plan is for {len(plan.seq_lens)} sequences, the batch has {len(samples)}")
        for (x, _), n in zip(samples, plan.seq_lens):
            if x.numel() != n:
                raise ValueError(f"a sequence has {x.numel()} tokens where the plan says {n}")
        total_targets = sum(int((y != IGNORE_INDEX).sum()) for _, y in samples)
        device = next(self.model.parameters()).device
        local_loss = torch.zeros((), dtype=torch.float64, device=device)
        for mb in plan.micro_batches:
            mine = next((g for g in mb.groups if self.rank in g.ranks), None)
            if mine is None:
                raise ValueError(f"rank {self.rank} is in no group of a micro-batch of step {plan.step}")
            if not mine.sequences:
                continue
            group = self.groups.get(mine.ranks)
            for core in self.cores:
                core.group = group
            shard = pack_group([samples[i] for i in mine.sequences], len(mine.ranks), mine.ranks.index(self.rank))
            shard = PackedShard(*(t.to(device) for t in (shard.tokens, shard.targets, shard.positions, shard.doc_ids)))
            logits = self.model(shard.tokens, positions=shard.positions, doc_ids=shard.doc_ids)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), shard.targets.flatten(),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
            (loss / total_targets).backward()
            local_loss += loss.detach().double()
        self._all_reduce_grads()
        dist.all_reduce(local_loss)
        return float(local_loss) / total_targets

    def _all_reduce_grads(self) -> None:
        for p in self.model.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
