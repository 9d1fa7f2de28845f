"""Run a plan for a few steps with the runtime's trainer and compare with the cost model.

Measured, per rank (every rank runs `run_validation`; all get the same result):
- step time: the wall time of `Trainer.train_step` (forward, backward, gradient sync, clipping,
  optimizer update). A step lasts as long as its slowest rank, so each step counts the largest
  of the ranks' times; the result is the median over the timed steps (medians resist the noise
  of a shared machine), after `warmup` untimed steps and one instrumented step. Several plans
  run interleaved, one step each in turn, so that load from other jobs falls on all alike.
- peak memory: model states + activations, as `tessera.profile.memory` measures them (local
  shards of parameters, gradients and optimizer state, taken just before the optimizer step,
  plus the peak bytes of tensors saved for backward during the instrumented step).

Predicted, per pipeline rank (`predicted_memory`): the cost model's peak memory of the rank
minus its transient terms, i.e. parameters + gradients + optimizer state + in-flight activations
(the LM head's logits included): `MemoryBreakdown.total - max layer buffer - reserved bytes`.
The transient buffers (gathered ZeRO-3 weights, a recomputed layer's replay) and the framework
reserve are not what the instrumentation sees, so they are left out on both sides.

Machine speed (with the model profile the plans were costed with, `Gauge`): one of the
profile's block measurements is timed again, the same way, before every step and after the last;
profiled / now is `Validation.speed_ratio`. On a machine shared with other jobs it tells an error
of the model from a change in the machine's load between profiling and running. Each step also
keeps the gauge's time around it (`step_gauge_s`), so that it can be converted to the speed the
profile saw (`Validation.at_profiled_speed`): a machine that switches between a fast and a slow
state within seconds (a virtual machine whose cores' neighbours come and go) makes a whole-run
ratio wrong, a step-by-step one not.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

from ..plan import Plan
from .fit import summarize

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
    # With a model profile (`Gauge`): the seconds of its gauge measurement then and during the runs.
    gauge_profiled_s: float | None = None
    gauge_s: float | None = None
    # Per timed step: the mean of the gauge runs just before and just after it.
    step_gauge_s: list[float] | None = None

    @property
    def speed_ratio(self) -> float | None:
        """Machine speed during the runs / speed in the model profile (1.0 = as profiled; None:
        no profile given). The same work timed the same way at both times, so the ratio is the
        machine's, not the model's: a shared machine's load changes it."""
        return self.gauge_profiled_s / self.gauge_s if self.gauge_s and self.gauge_profiled_s else None

    def at_profiled_speed(self, reference_s: float | None = None) -> float | None:
        """The step time the machine would have taken at the speed of the model profile: the
        median over steps of step x reference / the gauge around that step. `reference_s`: the
        gauge's profiled seconds (default `gauge_profiled_s`; a benchmark averaging two profiles
        passes their mean). None without per-step gauges. A median, not `statistic`: the
        conversion already takes the machine's load out, and a minimum would pick the step whose
        gauge run happened to be slowest."""
        import statistics

        reference_s = reference_s or self.gauge_profiled_s
        if not self.step_gauge_s or not reference_s:
            return None
        return statistics.median(t * reference_s / g for t, g in zip(self.step_times, self.step_gauge_s))

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
        out.append(mb.total - mb.fragmentation - max(bufs, default=0.0) - plan.cluster.device.reserved_bytes)
    return out


@dataclass(frozen=True)
class Gauge:
    """A measurement of a model profile to time again during the runs: the first block kind's
    forward + backward at its largest measured size, as the profile timed it (every rank at once,
    the slowest rank's). Their ratio is `Validation.speed_ratio`."""

    kind: str
    block: int  # index among the model's blocks
    batch: int
    seq_len: int
    dtype: str
    profiled_s: float
    window_s: float = 0.0  # each timing's span in the profile, kept in the runs (`model.time_sample`)

    @classmethod
    def of(cls, profile, model) -> "Gauge":
        """The gauge of `profile` (a ModelProfile) of `model` (the ModelSpec the plans train)."""
        from ..errors import TesseraError
        from ..spec.model import LayerKind
        from .apply import refuse_other_model

        refuse_other_model(profile, model)
        if model.config is None:
            raise TesseraError(f"model '{model.name}' has no architecture config, so no profiled block can be rerun")
        blocks = [k for k in profile.layers if k.kind not in (LayerKind.EMBEDDING, LayerKind.LM_HEAD)]
        if not blocks:
            raise TesseraError("the model profile has no block measurement to time again")
        k = blocks[0]
        m = max(k.measurements, key=lambda m: (m.tokens, m.seq_len))
        index = [layer.name for layer in model.layers if layer.kind not in (LayerKind.EMBEDDING, LayerKind.LM_HEAD)]
        return cls(kind=k.kind.value, block=index.index(k.layer) if k.layer in index else 0, batch=m.batch,
                   seq_len=m.seq_len, dtype=profile.dtype, profiled_s=m.forward_s + m.backward_s,
                   window_s=profile.window_s)

    def runner(self, model_spec, device):
        """The block on random inputs of the gauge's size, to time as the profile did."""
        from ..spec.model import LayerKind
        from .model import _TORCH_DTYPES, _LayerRunner, build_in_dtype

        dtype = _TORCH_DTYPES[self.dtype]
        model = build_in_dtype(model_spec.config, device, dtype)
        return _LayerRunner(model, model_spec.config, LayerKind(self.kind), self.block, self.batch, self.seq_len,
                            device, dtype)


class _Run:
    """One plan's trainer, data and measurements during an interleaved validation."""

    def __init__(self, plan: Plan, seed: int):
        from ..runtime.trainer import TrainConfig, Trainer

        self.plan = plan
        self.trainer = Trainer(TrainConfig(plan=plan, steps=10**6, synthetic_data=True, seed=seed))
        self.data = iter(self.trainer.build_data())
        self.times: list[float] = []
        self.states: dict[str, float] = {}
        self.activations = 0.0
        self.allocator: float | None = None

    def step(self) -> float:
        import torch
        import torch.distributed as dist

        batch = next(self.data)
        dist.barrier()
        t0 = time.perf_counter()
        self.trainer.train_step(batch.tokens, batch.labels)
        if self.trainer.device.type == "cuda":
            torch.cuda.synchronize(self.trainer.device)
        return time.perf_counter() - t0

    def instrumented_step(self) -> None:
        """Saved activations, and the model states just before the update (gradients present,
        optimizer state there since the warm-up)."""
        import torch

        from .memory import SavedActivationMeter, model_state_bytes

        t = self.trainer
        local_opt = getattr(t.optimizer, "optim", t.optimizer)  # ZeroRedundancyOptimizer's own shard
        hook = t.optimizer.register_step_pre_hook(
            lambda *_: self.states.update(model_state_bytes(t.model_parts, [local_opt])))
        meter = SavedActivationMeter(*t.model_parts)
        if t.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(t.device)
        with meter.track():
            self.step()
        hook.remove()
        self.activations = float(meter.peak_bytes)
        if t.device.type == "cuda":
            self.allocator = float(torch.cuda.max_memory_allocated(t.device))


def run_validations(plans: list[Plan], steps: int = 5, warmup: int = 1, seed: int = 0,
                    statistic: str = "median", gauge: Gauge | None = None) -> list[Validation]:
    """Train each plan for warmup + 1 + `steps` steps on synthetic data and measure (collective call).

    The plans run interleaved, one step of each in turn, so that a change in the machine's load
    (other jobs on a shared machine) touches every plan alike. With a `gauge`, its block is
    also timed before every step and after the last, so the machine's speed during the runs can
    be set against the speed the model profile saw (`Validation.speed_ratio`, and step by step
    `Validation.at_profiled_speed`). `statistic` summarises the timed steps (and
    the gauge's) as the model profile summarised its timings (`fit.STATISTICS`).
    """
    import torch
    import torch.distributed as dist

    from ..cost.evaluate import evaluate
    from .model import _slowest_rank, runs_filling, time_once, time_sample

    if steps < 1:
        raise ValueError(f"validate needs at least one timed step, got {steps}")
    runs = [_Run(plan, seed) for plan in plans]
    for _ in range(warmup):
        for run in runs:
            run.step()
    for run in runs:
        run.instrumented_step()
    device = runs[0].trainer.device if runs else torch.device("cpu")

    gauge_runs: list[float] = []  # this rank's gauge seconds: before every step, and after the last
    runner = gauge.runner(plans[0].model, device) if gauge is not None and runs else None
    runs_per_gauge = 1
    if runner is not None:
        time_once(runner, device)  # warm-up
        runs_per_gauge = runs_filling([runner], device, gauge.window_s)[0]

    def time_gauge() -> None:
        if runner is not None:
            gauge_runs.append(sum(time_sample(runner, device, runs_per_gauge)))

    for _ in range(steps):
        for run in runs:
            time_gauge()
            run.times.append(run.step())
    time_gauge()
    gauge_s, around = None, None
    if runner is not None:
        gauge_runs = _slowest_rank(gauge_runs, device)
        gauge_s = summarize(gauge_runs, statistic)
        around = [(a + b) / 2 for a, b in zip(gauge_runs, gauge_runs[1:])]  # step j of the interleaving
    world, rank = dist.get_world_size(), dist.get_rank()
    results = []
    for k, run in enumerate(runs):
        plan, t = run.plan, run.trainer
        times = torch.tensor(run.times, dtype=torch.float64, device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        me = RankMeasurement(rank=rank, pp_rank=rank // plan.stage_size, step_s=summarize(run.times, statistic),
                             params=run.states.get("params", 0.0), grads=run.states.get("grads", 0.0),
                             optimizer=run.states.get("optimizer", 0.0), activations=run.activations,
                             allocator_peak=run.allocator)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, asdict(me))
        t.close()
        pred = plan.prediction or evaluate(plan)
        step_times = times.tolist()
        results.append(Validation(plan=plan.name, world=world, predicted_step_s=pred.step_time_s,
                                  measured_step_s=summarize(step_times, statistic), step_times=step_times,
                                  predicted_memory=predicted_memory(plan),
                                  ranks=[RankMeasurement(**g) for g in gathered], gauge_s=gauge_s,
                                  gauge_profiled_s=gauge.profiled_s if gauge_s is not None else None,
                                  step_gauge_s=around[k::len(runs)] if around else None))
        log.info("%s: predicted %.3fs, measured %.3fs", plan.name, pred.step_time_s, results[-1].measured_step_s)
    return results


def run_validation(plan: Plan, steps: int = 5, warmup: int = 1, seed: int = 0,
                   statistic: str = "median", gauge: Gauge | None = None) -> Validation:
    """`run_validations` of one plan."""
    return run_validations([plan], steps, warmup, seed, statistic=statistic, gauge=gauge)[0]
