"""Run plans for a few steps with the runtime's trainer and measure them (the torch side of validate).

Measured, per rank (every rank runs `run_validations`; all get the same results, the records of
`tessera.profile.results`):
- step time: the wall time of `Trainer.train_step` (forward, backward, gradient sync, clipping,
  optimizer update). A step lasts as long as its slowest rank, so each step counts the largest
  of the ranks' times; the result is the median over the timed steps (medians resist the noise
  of a shared machine). The timed steps of all plans run interleaved, one step each in turn, so
  that load from other jobs falls on all alike.
- allocator peak (`AllocatorWindow`): each plan is built, warmed up and stepped once more on its
  own, with the allocator watched from before its trainer is built; the peak live bytes during
  that step are the plan's whole footprint (states, gradient buckets, gathered weights,
  activations, temporaries, the optimizer's scratch). On CUDA: `max_memory_allocated` above
  `memory_allocated` before the build. On CPU, which keeps no allocator statistics, the live total
  that PyTorch's CPU allocator reports to the profiler (`profile_memory=True`): it counts only
  allocations made while the profiler runs, so other plans' tensors, built before, are not in it.
- instrumented memory: model states of the local shards just before the optimizer step plus the
  peak of tensors saved for backward (`tessera.profile.measure.memory`), in one more step.

Machine speed (with the model profile the plans were costed with, `Gauge`): one of the profile's
block measurements is timed again, the same way, before every step and after the last;
profiled / now is `Validation.speed_ratio`. Each step also keeps the gauge's time around it
(`step_gauge_s`, see `Validation.at_profiled_speed`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import asdict

from ...plan import Plan
from ..fit import summarize
from ..results import (Gauge, RankMeasurement, Validation, predicted_allocated,  # noqa: F401 (re-exported)
                       predicted_memory)

log = logging.getLogger(__name__)

MEASURED_STEP = "tessera.validate.allocator_step"


def gauge_runner(gauge: Gauge, model_spec, device):
    """The gauge's block on random inputs of its size, to time as the profile did."""
    from ...spec.model import LayerKind
    from .model import _TORCH_DTYPES, _LayerRunner, build_in_dtype

    dtype = _TORCH_DTYPES[gauge.dtype]
    model = build_in_dtype(model_spec.config, device, dtype)
    return _LayerRunner(model, model_spec.config, LayerKind(gauge.kind), gauge.block, gauge.batch, gauge.seq_len,
                        device, dtype)


class AllocatorWindow:
    """Peak live bytes the torch allocator holds for what is built and run inside the window, during
    the `measured()` part of it (see the module docstring). Use:

        with AllocatorWindow(device) as window:
            ...build, warm up...
            with window.measured():
                ...one step...
        window.peak_bytes
    """

    def __init__(self, device):
        self.device = device
        self.peak_bytes: float | None = None
        self._profiler = None

    def __enter__(self) -> "AllocatorWindow":
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.__enter__()
        return self

    @contextlib.contextmanager
    def measured(self):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            torch.cuda.synchronize(self.device)
            self.peak_bytes = float(torch.cuda.max_memory_allocated(self.device) - self._base)
        else:
            with torch.profiler.record_function(MEASURED_STEP):
                yield

    def __exit__(self, *exc) -> None:
        if self._profiler is None:
            return
        self._profiler.__exit__(*exc)
        if exc[0] is None:
            self.peak_bytes = cpu_allocator_peak(self._profiler, MEASURED_STEP)


def cpu_allocator_peak(prof, marker: str) -> float:
    """The largest sum of live blocks the CPU allocator reported to `prof` during the `marker`
    range, counted from the profiler's start (`live_peak`).

    Rebuilt from the allocation events, not read from their running total: the CPU allocator
    reports (and takes off its total) only what threads with the profiler enabled allocate and
    free, and tensors a collective used are often freed by the gloo thread that ran it (functional
    collectives' outputs, all-to-all buffers, FSDP2's reduce-scatter inputs), so the running total
    never drops them; in a tensor-parallel fp32 step it ran 12 MiB over what was live (and kept
    growing). The events show such a block once its address is handed out again.

    The total also moves only while memory profiling is on: blocks allocated under an earlier
    profiler and freed after it stopped are never taken off (without counting from this
    profiler's events, a second plan measured in the same process counted the first plan's model
    states again)."""
    from torch._C._profiler import _EventType

    window, events, order = None, [], 0
    stack = list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while stack:  # depth first, children in the order they ran
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            events.append((node.start_time_ns, order, fields.ptr, fields.alloc_size))
            order += 1
        elif window is None and node.name == marker:
            window = (node.start_time_ns, node.end_time_ns)
        stack.extend(reversed(node.children))
    if window is None:
        raise RuntimeError(f"the profiler recorded no '{marker}' range")
    events.sort()
    return live_peak([(t, ptr, size) for t, _, ptr, size in events], window)


def live_peak(events, window: tuple[int, int]) -> float:
    """Largest sum of live blocks after any event inside `window` (with none inside, the sum
    when it opens).

    `events`: (time, address, signed size) in the order they happened; a negative size frees the
    block at that address. An allocation at an address still live means that block was freed
    where no event was recorded (another thread): it is dropped there, never earlier, so at every
    event the sum counts all that was really live."""
    live: dict[int, int] = {}
    total, peak = 0, None
    for t, ptr, size in events:
        if t > window[1]:
            break
        if size > 0:
            total += size - live.get(ptr, 0)
            live[ptr] = size
        else:
            total -= live.pop(ptr, 0)
        if t >= window[0]:
            peak = total if peak is None else max(peak, total)
    return float(total if peak is None else peak)


class _Run:
    """One plan's trainer, data and measurements during an interleaved validation: built, warmed
    up and stepped once under an `AllocatorWindow`."""

    def __init__(self, plan: Plan, seed: int, warmup: int, device):
        from ...runtime.trainer import TrainConfig, Trainer

        self.plan = plan
        self.times: list[float] = []
        self.states: dict[str, float] = {}
        self.activations = 0.0
        with AllocatorWindow(device) as window:
            self.trainer = Trainer(TrainConfig(plan=plan, steps=10**6, synthetic_data=True, seed=seed))
            self.data = iter(self.trainer.build_data())
            for _ in range(max(1, warmup)):  # optimizer state exists from the first step on
                self.step()
            with window.measured():
                self.step()
        self.allocator = window.peak_bytes

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
        from .memory import SavedActivationMeter, model_state_bytes

        t = self.trainer
        local_opt = getattr(t.optimizer, "optim", t.optimizer)  # ZeroRedundancyOptimizer's own shard
        hook = t.optimizer.register_step_pre_hook(
            lambda *_: self.states.update(model_state_bytes(t.model_parts, [local_opt])))
        meter = SavedActivationMeter(*t.model_parts)
        with meter.track():
            self.step()
        hook.remove()
        self.activations = float(meter.peak_bytes)


def run_validations(plans: list[Plan], steps: int = 5, warmup: int = 1, seed: int = 0,
                    statistic: str = "median", gauge: Gauge | None = None) -> list[Validation]:
    """Train each plan for warmup + 2 + `steps` steps on synthetic data and measure (collective call).

    Each plan is built, warmed up (at least one step) and measured by the allocator on its own,
    then stepped once more with the instrumentation. The timed steps run interleaved, one step of
    each plan in turn, so that a change in the machine's load
    (other jobs on a shared machine) touches every plan alike. With a `gauge`, its block is
    also timed before every step and after the last, so the machine's speed during the runs can
    be set against the speed the model profile saw (`Validation.speed_ratio`, and step by step
    `Validation.at_profiled_speed`). `statistic` summarises the timed steps (and
    the gauge's) as the model profile summarised its timings (`fit.STATISTICS`).
    """
    import torch
    import torch.distributed as dist

    from ...cost.evaluate import evaluate
    from .model import _slowest_rank, runs_filling, time_once, time_sample

    if steps < 1:
        raise ValueError(f"validate needs at least one timed step, got {steps}")
    # The trainer's device (`Trainer.build_distributed`).
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available()
              else torch.device("cpu"))
    runs = [_Run(plan, seed, warmup, device) for plan in plans]
    for run in runs:
        run.instrumented_step()

    gauge_runs: list[float] = []  # this rank's gauge seconds: before every step, and after the last
    runner = gauge_runner(gauge, plans[0].model, device) if gauge is not None and runs else None
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
                                  predicted_allocated=predicted_allocated(plan),
                                  ranks=[RankMeasurement(**g) for g in gathered], gauge_s=gauge_s,
                                  gauge_profiled_s=gauge.profiled_s if gauge_s is not None else None,
                                  step_gauge_s=around[k::len(runs)] if around else None))
        log.info("%s: predicted %.3fs, measured %.3fs", plan.name, pred.step_time_s, results[-1].measured_step_s)
    return results


def run_validation(plan: Plan, steps: int = 5, warmup: int = 1, seed: int = 0,
                   statistic: str = "median", gauge: Gauge | None = None) -> Validation:
    """`run_validations` of one plan."""
    return run_validations([plan], steps, warmup, seed, statistic=statistic, gauge=gauge)[0]
