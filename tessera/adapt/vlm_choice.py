"""The fastest plan of every kind the planner knows for a vision-language model, and which one wins.

Kinds (each priced by the cost model, the step in predicted seconds):
    one task
        no pipeline      the encoder and the LLM with their own data/tensor-parallel plans, colocated
                         or on separate device groups (`search.multimodal.plan_vlm_task`, the best
                         placement, or the one `encoder_gpus` forces)
        Optimus          the LLM in a 1F1B pipeline, the encoder's work in its bubbles
                         (`adapt.optimus.optimus_schedule`, the best over the pipeline degrees)
        extra stages     the encoder's layers as extra pipeline work in front of the LLM's
                         (`adapt.optimus.extra_stage_baseline`, same degrees)
    several tasks
        Spindle waves    the tasks' operators side by side in waves (`adapt.spindle.plan_spindle`)
        one after another  each task with its fastest single-task kind above, one after the
                         other, the gradients accumulated into one optimizer step:
                         step = sum of the tasks' steps less their tails + the largest tail
A kind that does not apply (no images, no pipeline plan, a forced placement) is listed with why.
`choose` returns them fastest first; the first is the plan. No torch import.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import TesseraError
from ..search.multimodal import PartPricer, plan_vlm_task
from ..spec.tasks import MultiTaskWorkload, TaskSpec
from .optimus import compare
from .spindle import plan_spindle

PIPELINE_DEGREES = (2, 4, 8, 16)


@dataclass(frozen=True)
class PlanKind:
    kind: str
    step_s: float
    tail_s: float
    detail: str  # the plan in words
    result: object = field(default=None, repr=False, compare=False)

    @property
    def busy_s(self) -> float:
        return self.step_s - self.tail_s


@dataclass(frozen=True)
class Choice:
    kinds: tuple[PlanKind, ...]  # fastest first
    skipped: tuple[tuple[str, str], ...]  # (kind, why it does not apply)

    @property
    def best(self) -> PlanKind:
        return self.kinds[0]

    def why(self) -> str:
        """One sentence: the winner, its margin over the next kind, the kinds priced."""
        best = self.best
        priced = ", ".join(f"{k.kind} {k.step_s:.3f} s" for k in self.kinds)
        if len(self.kinds) == 1:
            return f"{best.kind} is the only plan kind that applies ({priced})"
        second = self.kinds[1]
        return (f"{best.kind} is the fastest of the {len(self.kinds)} plan kinds priced ({priced}); the next, "
                f"{second.kind}, is {second.step_s / best.step_s - 1:.1%} slower")


def task_kinds(pricer: PartPricer, task: TaskSpec, gpus: int, encoder_gpus: int | None = None,
               degrees=PIPELINE_DEGREES) -> tuple[list[PlanKind], list[tuple[str, str]]]:
    """Every kind of one task (see the module docstring): (priced kinds, [(kind, why not)])."""
    flat = plan_vlm_task(pricer, task, gpus, encoder_gpus)
    kinds = [PlanKind(f"no pipeline ({flat.placement})", flat.step_s, flat.tail_s, flat.describe(), flat)]
    skipped: list[tuple[str, str]] = []
    if encoder_gpus is not None:
        skipped.append(("pipeline kinds", f"--encoder-gpus {encoder_gpus} fixes the placement"))
    elif not task.has_images:
        skipped.append(("pipeline kinds", f"task '{task.name}' has no images"))
    else:
        usable = tuple(d for d in degrees if gpus % d == 0 and d <= len(pricer.vlm.llm.layers) and d < gpus)
        try:
            opt, base = compare(pricer, task, gpus, usable)
        except TesseraError as e:
            skipped.append(("Optimus / extra stages", str(e)))
        else:
            kinds.append(PlanKind("Optimus", opt.step_s, opt.tail_s,
                                  f"LLM pipeline pp={opt.pp} with {opt.num_micro_batches} micro-batches, encoder "
                                  f"work in its bubbles ({opt.bubble_filled():.0%} of them filled), encoder "
                                  f"{opt.describe_encoder()} on every rank group", opt))
            kinds.append(PlanKind("encoder as extra pipeline stages", base.step_s, base.tail_s,
                                  f"pp={base.pp}, {base.num_micro_batches} micro-batches, the encoder's "
                                  f"{base.encoder_layers} layers in front of the LLM's, stages {list(base.stages)}",
                                  base))
    return sorted(kinds, key=lambda k: k.step_s), skipped


def choose(pricer: PartPricer, workload: MultiTaskWorkload, gpus: int, encoder_gpus: int | None = None,
           degrees=PIPELINE_DEGREES) -> Choice:
    """Every kind of the workload, fastest first (see the module docstring)."""
    workload.check_model(pricer.vlm)
    if len(workload.tasks) == 1:
        kinds, skipped = task_kinds(pricer, workload.tasks[0], gpus, encoder_gpus, degrees)
        return Choice(tuple(kinds), tuple(skipped))
    skipped: list[tuple[str, str]] = []
    per_task = []
    for t in workload.tasks:
        kinds, why = task_kinds(pricer, t, gpus, encoder_gpus, degrees)
        per_task.append((t.name, kinds[0]))
        skipped += [(f"{t.name}: {k}", w) for k, w in why]
    busy = sum(k.busy_s for _, k in per_task)
    tail = max(k.tail_s for _, k in per_task)
    kinds = [PlanKind("tasks one after another", busy + tail, tail,
                      "; ".join(f"{name}: {k.kind} {k.step_s * 1e3:.0f} ms" for name, k in per_task), per_task)]
    try:
        sp = plan_spindle(pricer, workload, gpus)
    except TesseraError as e:
        skipped.append(("Spindle waves", str(e)))
    else:
        kinds.append(PlanKind("Spindle waves", sp.step_s, sp.tail_s,
                              f"{len(sp.waves)} waves on device groups, {len(sp.round_ends) or 1} rounds", sp))
    kinds = sorted(kinds, key=lambda k: k.step_s)
    if not math.isfinite(kinds[0].step_s):
        raise TesseraError(f"no plan of {pricer.vlm.name} fits on {gpus} GPUs")
    return Choice(tuple(kinds), tuple(skipped))
