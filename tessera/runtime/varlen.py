"""Run a per-step `StepPlan` (tessera.adapt): sequence-parallel groups that change every step, on
a model whose parameters are sharded (FSDP2 ZeRO/HSDP) or replicated (DDP), with tensor
parallelism inside each group where the plan has it.

The model is the static plan's, parallelised by `parallelize` with the Ulysses degree folded into
data parallelism (`storage_plan`): FSDP2 (or DDP) over all N / tp units of tp ranks, DTensor TP
inside a unit. Every block's attention core becomes a `UlyssesAttention` whose group is set per
micro-batch, and its forward a `RecomputeSwitch` (none / selective / full per micro-batch, the
group's recompute: activation checkpointing is local to a rank).

For each phase and micro-batch of the plan, every rank finds its group (a block of units), packs
the group's sequences into one sequence (document ids over the whole packed sequence for
document-causal attention, positions restarting at each document, padded to a multiple of the
group's sequence shards), takes its contiguous slice (the TP ranks of a unit share it) and runs
the model. A rank without sequences runs a dummy slice whose labels are all ignored: FSDP2 gathers
and reduce-scatters over the shard group in every micro-batch, so every rank runs every layer.

Working modes (`PhasePlan.zero`, the cost model's `SeqCostModel.phase_time`) through FSDP2's flags,
per micro-batch: 3 reshards after forward and after backward and reduce-scatters every
micro-batch; 2 keeps the gathered parameters for the phase and reduce-scatters every
micro-batch; 1 keeps parameters and accumulates unsharded gradients, reduce-scattered when the
phase ends. Parameters are resharded when the next phase is in mode 3 (or the step ends), the
unsharded gradients reduced when the next phase is in mode 2 or 3 (or the step ends); the HSDP
replica all-reduce runs once, in the step's last backward. DDP (a replicated plan) reduces once.

Exactness: the step's loss is sum(per-token cross-entropy over the global batch) / (targets in the
global batch). Each rank back-propagates its slice's sum times pieces / targets (`ParallelLoss`'s
target scale, pieces = N / tp), and FSDP2 / DDP average over the N / tp data-parallel pieces:
every parameter's gradient is that of the global loss (sequence slices of one document add up to
its gradient, idle ranks add zeros).

Groups: every aligned block of 2^k units and, for tp > 1, its strided sub-groups (the ranks of one
TP position) are created once at start on all ranks in the same order (`SPGroupCache`).

Planning one step ahead: `AdaptiveStepRunner.prefetch(step, seq_lens)` starts rank 0 planning the
next step in a background thread while this one trains; `plan(step, seq_lens)` then takes that
result (or plans now) and broadcasts it, so every rank runs the same plan even when the solver's
time budget makes it depend on timing.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from ..plan import Plan, Recompute, SPKind, StepPlan
from .attention import UlyssesAttention

log = logging.getLogger(__name__)

IGNORE_INDEX = -100


class SPGroupCache:
    """Process groups for every aligned block of 2^k units of `tp` ranks, and, within each block,
    the ranks that share one TP position (the Ulysses group of a group with TP inside)."""

    def __init__(self, world_size: int | None = None, tp: int = 1):
        self.world_size = world_size or dist.get_world_size()
        self.tp = tp
        self.groups: dict[tuple[int, ...], object] = {}
        units = self.world_size // tp
        size = 1
        while size <= units:
            for start in range(0, units - size + 1, size):
                # new_group is collective: every rank creates every group, in this order
                for t in range(tp):
                    ranks = tuple(start * tp + t + j * tp for j in range(size))
                    self.groups[ranks] = dist.new_group(list(ranks))
            size *= 2

    def sequence_group(self, ranks: tuple[int, ...], rank: int):
        """The Ulysses group of `rank` in the group `ranks` (its TP position's ranks, in order)."""
        ranks = tuple(ranks)
        tp = self.tp
        start, size = ranks[0], len(ranks) // tp
        if (len(ranks) % tp or start % (size * tp) or ranks != tuple(range(start, start + size * tp))
                or size & (size - 1)):
            raise ValueError(f"ranks {ranks} are not an aligned power-of-two block of units of {tp} ranks")
        key = tuple(start + rank % tp + j * tp for j in range(size))
        return self.groups[key]

    def get(self, ranks: tuple[int, ...]):
        """The group of a block of ranks (tp = 1)."""
        return self.sequence_group(ranks, ranks[0])


@dataclass
class PackedShard:
    """This rank's slice of a group's packed sequence."""

    tokens: torch.Tensor  # (1, T/d)
    targets: torch.Tensor  # (1, T/d), IGNORE_INDEX on padding
    positions: torch.Tensor  # (1, T/d)
    doc_ids: torch.Tensor  # (1, T): document of every token of the FULL packed sequence

    def to(self, device) -> "PackedShard":
        return PackedShard(*(t.to(device) for t in (self.tokens, self.targets, self.positions, self.doc_ids)))


def pack_group(samples: list[tuple[torch.Tensor, torch.Tensor]], group_size: int, group_rank: int,
               multiple: int = 1) -> PackedShard:
    """Concatenate (inputs, targets) documents, pad to a multiple of `group_size` x `multiple`
    (padding is one extra document whose targets are ignored), and cut out slice `group_rank`."""
    lens = [int(x.numel()) for x, _ in samples]
    total = sum(lens)
    pad = -total % (group_size * multiple)
    tokens = torch.cat([x.reshape(-1) for x, _ in samples] + [torch.zeros(pad, dtype=torch.long)])
    targets = torch.cat([y.reshape(-1) for _, y in samples] + [torch.full((pad,), IGNORE_INDEX, dtype=torch.long)])
    doc_lens = torch.tensor(lens + ([pad] if pad else []))
    doc = torch.repeat_interleave(torch.arange(len(doc_lens)), doc_lens)
    starts = torch.cumsum(doc_lens, 0) - doc_lens
    positions = torch.arange(total + pad) - starts[doc]
    n = total + pad
    part = slice(group_rank * n // group_size, (group_rank + 1) * n // group_size)
    return PackedShard(tokens[None, part], targets[None, part], positions[None, part], doc[None])


def idle_shard(multiple: int) -> PackedShard:
    """What a rank without sequences runs: `multiple` tokens, no target."""
    zeros = torch.zeros((1, multiple), dtype=torch.long)
    return PackedShard(zeros, torch.full_like(zeros, IGNORE_INDEX), torch.arange(multiple)[None],
                       torch.zeros_like(zeros))


# --- the model's switches --------------------------------------------------------------------------


class RecomputeState:
    """The activation recompute every block of this rank runs in the current micro-batch."""

    def __init__(self, mode: Recompute = Recompute.NONE):
        self.mode = mode


def _switchable_forward(state: RecomputeState, forward, *args, **kwargs):
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from .parallelize import _selective_policy

    if state.mode == Recompute.NONE or not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    extra = {}
    if state.mode == Recompute.SELECTIVE:
        extra["context_fn"] = partial(create_selective_checkpoint_contexts, _selective_policy())
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **extra, **kwargs)


def install_switches(chunk: nn.Module) -> tuple[list[UlyssesAttention], RecomputeState]:
    """Every block's attention core becomes a UlyssesAttention (group set per micro-batch) and its
    forward a recompute switch (FSDP2's hooks stay outside it, as around a checkpoint wrapper)."""
    state = RecomputeState()
    cores = []
    for block in chunk.layers.values():
        core = UlyssesAttention(None)
        block.attention.core = core
        cores.append(core)
        block.forward = partial(_switchable_forward, state, block.forward)
    return cores, state


def storage_plan(plan: Plan) -> Plan:
    """The static plan as the adaptive runtime lays its parameters out: Ulysses folded into data
    parallelism (the groups change every step), TP without Megatron sequence parallelism, ZeRO
    over the layout's shard group of units (`tessera.adapt.seqcost.layout_of_plan`), no static
    recompute (switched per micro-batch)."""
    from ..adapt.seqcost import layout_of_plan

    layout = layout_of_plan(plan)
    units = layout.units
    shard = layout.shard_units if layout.shard_units < units else 0
    layers = tuple(s.model_copy(update={"dp": units, "sp": SPKind.NONE, "sp_degree": 1,
                                        "dp_shard": shard if s.zero else 0, "recompute": Recompute.NONE})
                   for s in plan.layers)
    workload = plan.workload.model_copy(update={"global_batch": units})
    return plan.model_copy(update={"layers": layers, "workload": workload, "micro_batch_size": 1,
                                   "num_micro_batches": 1, "prediction": None})


# --- the runner --------------------------------------------------------------------------------------


class AdaptiveStepRunner:
    """Runs StepPlans on a parallelised model (`parallelize(storage_plan(plan))`, materialised).

    runner = AdaptiveStepRunner(parallel, costs, tp=..., default_recompute=...)   # every rank
    runner.prefetch(step + 1, next_seq_lens)        # optional: plan the next step in background
    plan = runner.plan(step, seq_lens)              # same StepPlan on every rank
    loss = runner.forward_backward(plan, samples)   # samples: [(inputs, targets)] of the global batch
    (then clip and step the optimizer)

    `samples` is the whole global batch, in the same order on every rank (each rank runs the
    sequences its groups are assigned); `loss` is the global mean per-token loss.
    """

    def __init__(self, parallel, costs=None, time_budget_s: float = 0.1, tp: int = 1,
                 default_zero: int = 3, default_recompute: Recompute = Recompute.NONE, sequence_multiple: int = 1,
                 group_cache: SPGroupCache | None = None):
        self.parallel = parallel
        self.module = parallel.module
        self.costs = costs
        self.time_budget_s = time_budget_s
        self.tp = tp
        self.default_zero = default_zero
        self.default_recompute = Recompute(default_recompute)
        self.multiple = sequence_multiple  # tokens of a slice must divide by this (Megatron SP: tp)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.groups = group_cache or SPGroupCache(self.world, tp)
        self.cores, self.recompute = install_switches(parallel.chunk)
        self.autocast = nullcontext()  # the DDP path's bf16 autocast on a GPU (set by the trainer)
        self._pool = ThreadPoolExecutor(max_workers=1) if self.rank == 0 else None
        self._pending: dict[int, Future] = {}
        if self.rank == 0 and costs is not None:
            from ..adapt import seqmilp  # noqa: F401  (scipy.optimize's import, once, not in a step's budget)

    # --- planning ---------------------------------------------------------------------------
    def _solve(self, step: int, seq_lens) -> StepPlan:
        from ..adapt import plan_step

        if self.costs is None:
            raise ValueError("AdaptiveStepRunner needs a cost model (tessera.adapt.cost_model) to plan steps")
        return plan_step(step, list(seq_lens), self.costs, self.time_budget_s)

    def prefetch(self, step: int, seq_lens) -> None:
        """Start planning `step` on rank 0 in the background (call while the previous step trains)."""
        if self._pool is not None and step not in self._pending:
            self._pending[step] = self._pool.submit(self._solve, step, list(seq_lens))

    def plan(self, step: int, seq_lens) -> StepPlan:
        """The StepPlan for this step, planned on rank 0 (prefetched or now) and broadcast."""
        payload = [None]
        if self.rank == 0:
            future = self._pending.pop(step, None)
            try:
                plan = future.result() if future is not None else self._solve(step, seq_lens)
                payload = [plan.model_dump_json()]
            except Exception as e:  # every rank raises the same error instead of waiting forever
                payload = [f"error:{type(e).__name__}:{e}"]
        dist.broadcast_object_list(payload, src=0)
        if payload[0].startswith("error:"):
            from ..errors import TesseraError

            raise TesseraError(payload[0].split(":", 2)[2])
        return StepPlan.model_validate_json(payload[0])

    # --- execution --------------------------------------------------------------------------
    def _units(self):
        return [u.module for u in self.parallel.sync.units]

    def _before_forward(self, keep_gathered: bool) -> None:
        for m in self._units():
            m.set_reshard_after_forward(not keep_gathered, recurse=False)

    def _before_backward(self, reduce_now: bool, reshard: bool, last: bool) -> None:
        for m in self._units():
            m.set_requires_gradient_sync(reduce_now, recurse=False)
            if reduce_now:
                m.set_requires_all_reduce(last, recurse=False)
            m.set_reshard_after_backward(reshard, recurse=False)
            m.set_is_last_backward(last)

    def forward_backward(self, plan: StepPlan, samples: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        if len(samples) != len(plan.seq_lens):
            raise ValueError(f"the plan is for {len(plan.seq_lens)} sequences, the batch has {len(samples)}")
        for (x, _), n in zip(samples, plan.seq_lens):
            if x.numel() != n:
                raise ValueError(f"a sequence has {x.numel()} tokens where the plan says {n}")
        if plan.tp != self.tp:
            raise ValueError(f"the plan's groups are in units of {plan.tp} ranks, this run's of {self.tp}")
        total_targets = sum(int((y != IGNORE_INDEX).sum()) for _, y in samples)
        loss_fn = self.parallel.loss
        loss_fn.target_scale = loss_fn.pieces / max(total_targets, 1)
        loss_fn.real_seq_len = None
        device = next(self.parallel.chunk.parameters()).device
        local = torch.zeros((), dtype=torch.float64, device=device)
        ddp = hasattr(self.module, "no_sync")
        phases = [p for p in plan.phases if p.micro_batches]
        count = sum(len(p.micro_batches) for p in phases)
        i = 0
        for k, phase in enumerate(phases):
            zero = phase.zero or self.default_zero
            nxt = (phases[k + 1].zero or self.default_zero) if k + 1 < len(phases) else None
            for j, mb in enumerate(phase.micro_batches):
                i += 1
                last, phase_end = i == count, j == len(phase.micro_batches) - 1
                mine = next((g for g in mb.groups if self.rank in g.ranks), None)
                if mine is None:
                    raise ValueError(f"rank {self.rank} is in no group of a micro-batch of step {plan.step}")
                self._before_forward(keep_gathered=zero <= 2)
                ends = phase_end and (nxt is None or nxt == 3)
                reduce_now = zero >= 2 or (phase_end and (nxt is None or nxt >= 2))
                self._before_backward(reduce_now, reshard=zero == 3 or ends, last=last)
                local += self._run_group(mine, samples, device, ddp and not last)
        settle_and_scale(self.parallel)
        dist.all_reduce(local)
        return float(local) / self.tp / max(total_targets, 1)

    def evaluation_rows(self, rows: int) -> slice:
        """Forward-only evaluation: every unit of tp ranks runs its own share of `rows` alone (its
        attention cores on the unit's own sequence group, no recompute); the rows of this rank."""
        unit = tuple(range(self.rank - self.rank % self.tp, self.rank - self.rank % self.tp + self.tp))
        group = self.groups.sequence_group(unit, self.rank)
        for core in self.cores:
            core.group = group
        self.recompute.mode = Recompute.NONE
        units, index = self.world // self.tp, self.rank // self.tp
        return slice(index * rows // units, (index + 1) * rows // units)

    def _run_group(self, group, samples, device, no_sync: bool) -> torch.Tensor:
        """Forward and backward of this rank's slice of its group; returns its summed token loss."""
        units = len(group.ranks) // self.tp if group.sequences else 1  # idle: alone in its unit
        unit = tuple(range(self.rank - self.rank % self.tp, self.rank - self.rank % self.tp + self.tp))
        ulysses = self.groups.sequence_group(group.ranks if group.sequences else unit, self.rank)
        for core in self.cores:
            core.group = ulysses
        self.recompute.mode = Recompute(group.recompute or self.default_recompute)
        if group.sequences:
            position = group.ranks.index(self.rank) // self.tp
            shard = pack_group([samples[s] for s in group.sequences], units, position, self.multiple)
        else:
            shard = idle_shard(self.multiple)
        shard = shard.to(device)
        loss_fn = self.parallel.loss
        context = self.module.no_sync() if no_sync else nullcontext()
        with context, loss_fn.context():
            with self.autocast:
                logits = self.module(shard.tokens, shard.positions, shard.doc_ids)
                loss = loss_fn(logits, shard.targets)
            loss.backward()
        value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        return value.detach().double() / loss_fn.target_scale

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def settle_and_scale(parallel) -> None:
    """What a static step does after its backward: TP gradients laid out like their parameters,
    layer-wise rescaling, tied weights' gradients summed."""
    from .grad_sync import settle_gradients

    settle_gradients(list(parallel.chunk.parameters()))
    parallel.rescale_grads()
    parallel.sync_tied_grads()
