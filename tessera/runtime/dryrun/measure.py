"""Measure one rank of a plan: its model-state bytes and the collectives of one training step.

`measure_rank(plan, rank, materialize)` builds the rank with the trainer's own code
(`build.rank_trainer`) inside a fake process group of the plan's world size, then runs training
steps (`Trainer.train_step`: the micro-batch loop or the pipeline schedule, gradient rescale,
global-norm clipping, AdamW) and counts the collectives of one of them (below). With `materialize`
the tensors are real (a model that fits this machine); otherwise they are fake
(`world.fake_execution`: exact shapes and dtypes, no data, any size).

Which step is counted: the first. A pipeline schedule's first step begins with a one-off
initialisation (a vote between stages and a forward and backward that infer the stages' shapes):
its collectives are not counted (`_initialize_pp_stages`, torch >= 2.13; with an older torch the
second step is counted), but the model states it holds are (its forward unshards every chunk's
parameters at once: a peak the first training step meets). DDP rebuilds its gradient buckets at the start
of the second step, which reads data that fake tensors do not have: what is counted for a DDP
plan are its initial buckets.

Model states, sampled before and after every forward of every model part, before the optimizer
step and after it (`StateProbe`), each category at its largest (bytes on the device; what CPU offload
keeps in host memory is counted apart):
    params     the working copies the forward reads and that stay between micro-batches:
               parameters in the plan's dtype, and FSDP2's unsharded (all-gathered) parameters
               of units that do not reshard after forward (ZeRO <= 2)
    grads      `.grad` of every parameter, plus FSDP2's unsharded gradients accumulated across
               micro-batches while gradient sync is off
    optimizer  AdamW state, plus the fp32 master copies: parameters stored in fp32 under a bf16
               or fp16 plan (FSDP2 keeps its sharded parameters in fp32 and casts for compute;
               the DDP path keeps fp32 parameters and autocasts)
"""
from __future__ import annotations

import contextlib
import resource
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from ...plan import Plan
from ..comm_count import CollectiveCounter, CollectiveRecord

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class StateBytes:
    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    def peak(self, other: "StateBytes") -> "StateBytes":
        return StateBytes(max(self.params, other.params), max(self.grads, other.grads),
                          max(self.optimizer, other.optimizer))


@dataclass
class RankMeasurement:
    rank: int
    pp_rank: int
    mode: str  # "materialized" or "fake"
    device: StateBytes
    host: StateBytes  # CPU offload
    collectives: list[CollectiveRecord]
    counted_step: int  # 1 or 2 (0: built only)
    build_s: float = 0.0
    step_s: float = 0.0
    peak_rss_bytes: float = 0.0
    notes: list[str] = field(default_factory=list)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = _local(t)
    return t.numel() * t.element_size()


def _fsdp_params(module: nn.Module):
    """(FSDPParam, reshards after forward) of every FSDP2 unit under `module` (torch internals)."""
    from torch.distributed.fsdp import FSDPModule

    seen: set[int] = set()  # the modules of one unit share its state
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        if id(state) in seen:
            continue
        seen.add(id(state))
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch < 2.13: one group per unit
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        for group in groups:
            keeps = group.post_forward_mesh_info is None  # no reshard after forward (ZeRO <= 2)
            for fsdp_param in group.fsdp_params:
                yield fsdp_param, keeps


class StateProbe:
    """Largest model-state bytes seen at the sample points (module docstring)."""

    def __init__(self, parts: list[nn.Module], optimizers: list, dtype: str, stages: list = ()):
        self.parts, self.optimizers = parts, optimizers
        self.working = _DTYPES[dtype]
        self.device, self.host = StateBytes(), StateBytes()
        self.handles = [h for p in parts for h in (p.register_forward_pre_hook(lambda *_: self.sample()),
                                                   p.register_forward_hook(lambda *_: self.sample()))]
        for opt in optimizers:
            self.handles.append(opt.register_step_pre_hook(lambda *_: self.sample()))
            self.handles.append(opt.register_step_post_hook(lambda *_: self.sample()))
        # After each pipeline backward too: under GPipe every backward follows every forward, and
        # the gradients a ZeRO-0/1 unit accumulates over the step peak before the last one.
        self.stages = list(stages)
        for stage in self.stages:
            stage.backward_maybe_with_nosync = self._sampled(stage.backward_maybe_with_nosync)

    def _sampled(self, backward):
        def run(*args, **kwargs):
            out = backward(*args, **kwargs)
            self.sample()
            return out
        return run

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        for stage in self.stages:
            del stage.backward_maybe_with_nosync  # the class's method again

    def sample(self) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState


        device, host = StateBytes(), StateBytes()
        fsdp = [item for part in self.parts for item in _fsdp_params(part)]
        handled, offloaded = set(), set()
        for fp, keeps in fsdp:
            where = host if fp.offload_to_cpu else device
            sharded = fp.sharded_param
            handled.update((id(sharded), id(getattr(fp, "_unsharded_param", None))))
            if fp.offload_to_cpu:
                offloaded.add(id(sharded))
            self._add_param(where, fp._sharded_param_data)
            where.grads += _nbytes(sharded.grad)
            unsharded = fp.sharded_state == ShardedState.UNSHARDED
            if keeps and unsharded:  # the all-gathered working copy stays until the next reshard
                device.params += _nbytes(fp._unsharded_param)
            acc = fp.unsharded_accumulated_grad
            if acc is None and unsharded:
                acc = fp._unsharded_param.grad
            device.grads += _nbytes(acc)
        for part in self.parts:
            for p in part.parameters():
                if id(p) in handled:
                    continue
                handled.add(id(p))
                self._add_param(device, p)
                device.grads += _nbytes(p.grad)
        for opt in self.optimizers:
            inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer wraps the local AdamW
            for param, state in inner.state.items():
                where = host if id(param) in offloaded else device
                where.optimizer += sum(_nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
        self.device, self.host = self.device.peak(device), self.host.peak(host)

    def _add_param(self, where: StateBytes, t: torch.Tensor) -> None:
        if _local(t).dtype == self.working:
            where.params += _nbytes(t)
        else:  # an fp32 master copy of bf16/fp16 working weights
            where.optimizer += _nbytes(t)


def _register_fake_backend_hooks(trainer) -> None:
    """DDP refuses the fake backend's empty futures: give it its default hook with a full one."""
    from torch.nn.parallel import DistributedDataParallel

    from .world import allreduce_hook

    module = trainer.parallel.module if trainer.parallel is not None else None
    if isinstance(module, DistributedDataParallel):
        module.register_comm_hook(module.process_group, allreduce_hook)


def _skip_pipeline_setup(trainer, counter: CollectiveCounter) -> bool:
    """Count no collective during a pipeline schedule's one-off initialisation; False when this
    torch's schedule has no separate initialisation to wrap (then the second step is counted)."""
    if trainer.pipeline is None:
        return True
    schedule = trainer.pipeline.schedule
    setup = getattr(schedule, "_initialize_pp_stages", None)
    if setup is None:
        return False

    def quietly(*args, **kwargs):
        counter.paused = True
        try:
            return setup(*args, **kwargs)
        finally:
            counter.paused = False

    schedule._initialize_pp_stages = quietly
    return True


def _pipeline_stages(trainer) -> list:
    """This rank's torch.distributed.pipelining stages (none without a pipeline)."""
    schedule = getattr(getattr(trainer, "pipeline", None), "schedule", None)
    if schedule is None:
        return []
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


def _step_whatever_the_values(trainer) -> None:
    """The fake process group leaves collective outputs unwritten (any bytes, NaN included), so a
    materialized rank's loss and norm mean nothing: the optimizer steps as the plan does, and the
    non-finite guard (for real runs) is not consulted."""
    step_as_planned = trainer.optimizer_step
    trainer.optimizer_step = lambda *_: step_as_planned()


def measure_rank(plan: Plan, rank: int, materialize: bool = False, step: bool = True) -> RankMeasurement:
    """Build and step `rank` of the plan in a fake world (see the module docstring).

    `step=False` only builds: parameters are measured, no gradient, optimizer state or
    collective (a quick check that the plan applies)."""
    from .build import rank_trainer, step_batch
    from .world import fake_rank, fake_execution

    pp_rank = rank // plan.stage_size
    with fake_rank(plan, rank):
        world = fake_execution(plan) if not materialize else contextlib.nullcontext()
        with world:
            start = time.perf_counter()
            trainer = rank_trainer(plan, rank)
            _register_fake_backend_hooks(trainer)
            _step_whatever_the_values(trainer)
            built = time.perf_counter()
            tokens, labels = step_batch(trainer, fake=not materialize)
            probe = StateProbe(trainer.model_parts, trainer.optimizers, plan.workload.dtype, _pipeline_stages(trainer))
            counter = CollectiveCounter()
            counted = 0
            if step:
                counted = 1 if _skip_pipeline_setup(trainer, counter) else 2
                if counted == 2:
                    trainer.train_step(tokens, labels)
                with counter:
                    trainer.train_step(tokens, labels)
            probe.sample()
            probe.close()
            stepped = time.perf_counter()
    return RankMeasurement(
        rank=rank, pp_rank=pp_rank, mode="materialized" if materialize else "fake",
        device=probe.device, host=probe.host, collectives=counter.records, counted_step=counted,
        build_s=built - start, step_s=stepped - built,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0)
