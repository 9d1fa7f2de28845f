"""What a validation run measured and what the cost model predicted for it (no torch import).

`tessera.profile.measure.validate` runs plans and fills these records; the planner side, the CLI
and the fidelity benchmark read them without torch.

Memory, two ways (per rank; `RankMeasurement`):
- `allocator_peak`: the peak bytes the torch allocator held for the plan during one step, counted
  from before the plan's trainer was built: everything the run allocated (model states, gradient
  buckets, gathered ZeRO-3 weights, activations, temporaries, the optimizer's scratch). Predicted
  by `predicted_allocated`: the cost model's peak of the pipeline rank without the framework
  reserve, `MemoryBreakdown.total - reserved_bytes` (the reserve is what the allocator does not
  hand out: CUDA context, communication libraries).
- instrumented (`memory`): the local shards of parameters, gradients and optimizer state plus the
  peak of tensors saved for backward (`tessera.profile.measure.memory`), the terms the cost model
  names. Predicted by `predicted_memory`: `MemoryBreakdown.total - max layer buffer - reserved`.
  The profile's activation fit is taken with the same saved-tensor meter, so this comparison
  checks the cost model's arithmetic on the profile's own numbers, not the profile itself.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..plan import Plan


@dataclass
class RankMeasurement:
    rank: int
    pp_rank: int
    step_s: float  # median of this rank's own step times
    params: float
    grads: float
    optimizer: float
    activations: float
    # Peak bytes the torch allocator held for the plan during one step, counted from before its
    # trainer was built (see `tessera.profile.measure.validate`). None: not measured.
    allocator_peak: float | None = None

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
    predicted_allocated: list[float] | None = None  # per pipeline rank (see module docstring)
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

    @property
    def peak_allocated(self) -> tuple[float, float] | None:
        """(predicted, measured) allocator peak over ranks; None where not measured."""
        if not self.predicted_allocated or any(r.allocator_peak is None for r in self.ranks) or not self.ranks:
            return None
        return max(self.predicted_allocated), max(r.allocator_peak for r in self.ranks)

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
    """Per pipeline rank: states + in-flight saved activations the cost model predicts, the terms
    the instrumented count sees: no transients, no copies of the states the runtime keeps beside
    ZeRO's (DDP's gradients accumulated under no_sync), no logits held by the loop."""
    import numpy as np

    from ..cost.evaluate import evaluate, plan_context
    from ..cost.layer import StrategyTable, layer_costs
    from ..cost.schedule import in_flight

    pred = plan.prediction or evaluate(plan)
    ctx = plan_context(plan)
    pipe = plan.pipeline
    out = []
    for r, mb in enumerate(pred.stage_memory):
        layers = [i for c, (s, e) in enumerate(pipe.stages) if pipe.rank_of_chunk(c) == r for i in range(s, e)]
        k = in_flight(pipe.schedule.value, pipe.degree, r, plan.num_micro_batches, pipe.virtual_stages)
        costs = [layer_costs(plan.model.layers[i], StrategyTable.build([plan.layers[i]]), ctx) for i in layers]
        first = lambda x: float(np.asarray(x)[0]) if x is not None else 0.0  # noqa: E731
        unseen = sum(first(c.copies) + k * first(c.held) for c in costs)
        out.append(mb.total - mb.fragmentation - max((first(c.buf) for c in costs), default=0.0)
                   - plan.cluster.device.reserved_bytes - unseen)
    return out


def predicted_allocated(plan: Plan) -> list[float]:
    """Per pipeline rank: the cost model's peak bytes without the framework reserve (what an
    allocator's peak counts; see the module docstring)."""
    from ..cost.evaluate import evaluate

    pred = plan.prediction or evaluate(plan)
    return [mb.total - mb.fragmentation - plan.cluster.device.reserved_bytes for mb in pred.stage_memory]


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
