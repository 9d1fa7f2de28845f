"""Run a plan for a few steps with the runtime's trainer and compare with the cost model.

Measured, per rank (every rank runs `run_validation`; all get the same result):
- step time: the wall time of `Trainer.train_step` (forward, backward, gradient sync, clipping,
  optimizer update). A step lasts as long as its slowest rank, so each step counts the largest
  of the ranks' times; the result is the median over the timed steps (medians resist the noise
  of a shared machine), after `warmup` untimed steps and one instrumented step.
- peak memory: model states + activations, as `tessera.profile.memory` measures them (local
  shards of parameters, gradients and optimizer state, taken just before the optimizer step,
  plus the peak bytes of tensors saved for backward during the instrumented step).

Predicted, per pipeline rank (`predicted_memory`): the cost model's peak memory of the rank
minus its transient terms, i.e. parameters + gradients + optimizer state + in-flight activations
(the LM head's logits included): `MemoryBreakdown.total - max layer buffer - reserved bytes`.
The transient buffers (gathered ZeRO-3 weights, a recomputed layer's replay) and the framework
reserve are not what the instrumentation sees, so they are left out on both sides.
"""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass, field

from ..plan import Plan

log = logging.getLogger(__name__)


@dataclass
class RankMeasurement:
    rank: int
    pp_rank: int
    step_s: float  # median of this rank's own step times
    params: float
    grads: float
    optimizer: float
    activations: float
    allocator_peak: float | None = None  # CUDA max_memory_allocated

    @property
    def memory(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations


@dataclass
class Validation:
    plan: str
    world: int
    predicted_step_s: float
    measured_step_s: float
    step_times: list[float]
    predicted_memory: list[float]  # per pipeline rank (see module docstring)
    ranks: list[RankMeasurement] = field(default_factory=list)

    @property
    def time_error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_step_s - self.measured_step_s) / self.measured_step_s

    def memory_error(self, r: RankMeasurement) -> float:
        return (self.predicted_memory[r.pp_rank] - r.memory) / r.memory

    @property
    def peak_memory(self) -> tuple[float, float]:
        """(predicted, measured) peak over ranks."""
        return max(self.predicted_memory), max(r.memory for r in self.ranks)

    @property
    def peak_memory_error(self) -> float:
        p, m = self.peak_memory
        return (p - m) / m

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(time_error=self.time_error, peak_memory_error=self.peak_memory_error)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Validation":
        d = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        d["ranks"] = [RankMeasurement(**r) for r in d.get("ranks", [])]
        return cls(**d)


def predicted_memory(plan: Plan) -> list[float]:
    """Per pipeline rank: states + in-flight activations the cost model predicts (no transients)."""
    import numpy as np

    from ..cost.evaluate import evaluate, plan_context
    from ..cost.layer import StrategyTable, layer_costs

    pred = plan.prediction or evaluate(plan)
    ctx = plan_context(plan)
    pipe = plan.pipeline
    out = []
    for r, mb in enumerate(pred.stage_memory):
        layers = [i for c, (s, e) in enumerate(pipe.stages) if pipe.rank_of_chunk(c) == r for i in range(s, e)]
        bufs = [float(np.asarray(layer_costs(plan.model.layers[i], StrategyTable.build([plan.layers[i]]), ctx).buf)[0])
                for i in layers]
        out.append(mb.total - max(bufs, default=0.0) - plan.cluster.device.reserved_bytes)
    return out


def run_validation(plan: Plan, steps: int = 5, warmup: int = 1, seed: int = 0) -> Validation:
    """Train `plan` for warmup + 1 + `steps` steps on synthetic data and measure (collective call)."""
    import torch
    import torch.distributed as dist

    from ..cost.evaluate import evaluate
    from ..runtime.trainer import TrainConfig, Trainer
    from .memory import SavedActivationMeter, model_state_bytes

    if steps < 1:
        raise ValueError(f"validate needs at least one timed step, got {steps}")
    trainer = Trainer(TrainConfig(plan=plan, steps=warmup + 1 + steps, synthetic_data=True, seed=seed))
    data = iter(trainer.build_data())

    def one_step() -> float:
        batch = next(data)
        dist.barrier()
        t0 = time.perf_counter()
        trainer.train_step(batch.tokens, batch.labels)
        if trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)
        return time.perf_counter() - t0

    for _ in range(warmup):
        one_step()
    # One instrumented step: saved activations, and the model states just before the update
    # (gradients present, optimizer state there since the warm-up).
    states: dict[str, float] = {}
    opt = trainer.optimizer
    local_opt = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps its shard in .optim
    hook = opt.register_step_pre_hook(
        lambda *_: states.update(model_state_bytes(trainer.model_parts, [local_opt])))
    meter = SavedActivationMeter(*trainer.model_parts)
    if trainer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(trainer.device)
    with meter.track():
        one_step()
    hook.remove()
    allocator = float(torch.cuda.max_memory_allocated(trainer.device)) if trainer.device.type == "cuda" else None

    mine = [one_step() for _ in range(steps)]
    world = dist.get_world_size()
    rank = dist.get_rank()
    times = torch.tensor(mine, dtype=torch.float64, device=trainer.device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    step_times = times.tolist()
    me = RankMeasurement(rank=rank, pp_rank=rank // plan.stage_size, step_s=statistics.median(mine),
                         params=states.get("params", 0.0), grads=states.get("grads", 0.0),
                         optimizer=states.get("optimizer", 0.0), activations=float(meter.peak_bytes),
                         allocator_peak=allocator)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, asdict(me))
    trainer.close()
    pred = plan.prediction or evaluate(plan)
    result = Validation(plan=plan.name, world=world, predicted_step_s=pred.step_time_s,
                        measured_step_s=statistics.median(step_times), step_times=step_times,
                        predicted_memory=predicted_memory(plan),
                        ranks=[RankMeasurement(**g) for g in gathered])
    log.info("%s: predicted %.3fs, measured %.3fs", plan.name, result.predicted_step_s, result.measured_step_s)
    return result
