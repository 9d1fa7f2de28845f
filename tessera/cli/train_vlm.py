"""`tessera train` of a vision-language model: the planner's encoder and LLM plans, run as planned.

The planner prices every plan kind of the run's one image-text task (`adapt.vlm_choice.choose`:
no pipeline with the encoder colocated or on ranks of its own, Optimus, the encoder as extra
pipeline stages) and picks the fastest. The runtime (`runtime.multimodal.MultimodalTrainer`) runs
a colocated plan (the LLM under any non-pipeline plan, the encoder data parallel on every rank with
its ZeRO stage and recompute) and Optimus (`runtime/vlm_pipeline.py`: the LLM's 1F1B pipeline,
the encoder on every rank, its passes placed in the bubbles as the planner placed them) when the
Optimus encoder plan is data parallel (replicated, or ZeRO-sharded over each stage and replicated
across stages). When the planner's choice is another kind, the run takes the faster of the best colocated plan and the best Optimus plan the
runtime runs (the encoder searched without tensor, sequence or pipeline parallelism; the
colocated LLM without a pipeline) and says so in one line.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace

from ..adapt.optimus import OptimusResult

# The encoder strategy the launcher chose, for the ranks it starts (beside LAUNCHED_PLAN).
LAUNCHED_ENCODER = "TESSERA_RUN_ENCODER"
ENCODER_FILE = "encoder.json"


class VLMPlan:
    """What `plan_vlm` returns: the LLM's plan (a `Plan` the text runtime checks), the encoder's
    strategy (an `EncoderStrategy` as a dict) and the lines that say what was chosen."""

    def __init__(self, llm_plan, encoder: dict, lines: list[str]):
        self.plan, self.encoder, self.lines = llm_plan, encoder, lines


def plan_vlm(vlm, llm_model, world: int, workload, cluster) -> VLMPlan:
    """The planned encoder and LLM plans for `world` ranks of `cluster` (see the module docstring);
    `llm_model` is the LLM's ModelSpec (a measured profile applied, if any)."""
    from ..adapt.vlm_choice import choose
    from ..search.multimodal import PartPricer, plan_vlm_task
    from ..spec.multimodal import VLMSpec
    from ..spec.tasks import MultiTaskWorkload, TaskSpec
    from .plan import search_options

    spec = VLMSpec.from_config(vlm).model_copy(update={"llm": llm_model})
    task = TaskSpec(name="image-text", modalities=("image", "text"), batch=workload.global_batch,
                    images_per_sample=1, text_tokens=max(0, workload.seq_len - vlm.image_tokens))
    options = search_options(cluster)
    choice = choose(PartPricer(spec, cluster, options=options, dtype=workload.dtype), MultiTaskWorkload(tasks=(task,)),
                    world)
    best = choice.best
    chosen, why_not = best.result, _not_runnable(best, world)
    if why_not:
        runnable_llm = replace(options, max_pp=1)
        runnable_encoder = replace(options, max_pp=1, max_tp=1, max_sp=1, allow_cp=False, allow_hsdp=False,
                                   allow_offload=False)
        pricer = PartPricer(spec, cluster, options=runnable_llm, dtype=workload.dtype,
                            encoder_options=runnable_encoder)
        chosen = plan_vlm_task(pricer, task, world, encoder_gpus=world)
        optimus = _runnable_optimus(spec, cluster, options, workload.dtype, task, world)
        if optimus is not None and optimus.step_s < chosen.step_s:
            chosen = optimus
    from ..runtime.multimodal import from_optimus, from_task_plan

    if isinstance(chosen, OptimusResult):
        llm_plan, strategy = from_optimus(chosen, world)
        encoder = _as_json(strategy)
        kind = "Optimus"
        placed = (f"ZeRO-{strategy.zero} over each stage, replicated across stages" if strategy.zero
                  else "replicated on every rank")
        lines = [f"encoder plan ({placed}, its passes in the LLM pipeline's bubbles): "
                 f"{chosen.describe_encoder()}; images encoded per pipeline rank "
                 f"{[sum(row) for row in chosen.counts]}",
                 f"LLM plan: pipeline pp={chosen.pp} with {chosen.num_micro_batches} micro-batches, "
                 f"{chosen.bubble_filled():.0%} of its bubbles filled"]
    else:
        llm_plan, strategy = from_task_plan(chosen, world)
        encoder, kind = _as_json(strategy), "the colocated plan"
        lines = [f"encoder plan (data parallel on every rank): {chosen.encoder.describe()}",
                 f"LLM plan: {chosen.llm.describe()}"]
    if why_not:
        lines.append(f"the planner's choice, {best.kind} ({best.step_s * 1e3:.1f} ms per step), {why_not}: running "
                     f"the fastest plan it runs, {kind} ({chosen.step_s * 1e3:.1f} ms per step)")
    else:
        lines.append(f"chosen: {best.kind}, {best.step_s * 1e3:.1f} ms per step ({choice.why()})")
    return VLMPlan(llm_plan, encoder, lines)


def _as_json(strategy) -> dict:
    """An `EncoderStrategy` as the JSON the launcher hands its ranks (`encoder_strategy` reads it)."""
    from dataclasses import asdict

    out = asdict(strategy)
    for key in ("bubbles", "recompute_blocks"):
        out[key] = [list(row) for row in getattr(strategy, key)]
    return out


def _runnable_optimus(spec, cluster, options, dtype, task, world: int):
    """The fastest Optimus plan whose encoder plan the runtime runs (data parallel, with or
    without ZeRO), or None; `options`: the run's search options, which the encoder's are narrowed from."""
    from ..adapt.optimus import llm_pipeline_plans, optimus_schedule
    from ..adapt.vlm_choice import PIPELINE_DEGREES
    from ..errors import TesseraError
    from ..search.multimodal import PartPricer

    encoder_options = replace(options, max_pp=1, max_tp=1, max_sp=1, allow_cp=False, allow_hsdp=False,
                              allow_offload=False)
    pricer = PartPricer(spec, cluster, dtype=dtype, encoder_options=encoder_options)
    degrees = tuple(d for d in PIPELINE_DEGREES if world % d == 0 and d <= len(spec.llm.layers) and d < world)
    best = None
    for plan in llm_pipeline_plans(pricer, task, world, degrees):
        try:
            result = optimus_schedule(pricer, task, plan, lean=False)
        except TesseraError:
            continue
        if not _optimus_why_not(result, world) and (best is None or result.step_s < best.step_s):
            best = result
    if best is not None:  # its placement refined and solved exactly, as `tessera plan` does for its choice
        refined = optimus_schedule(pricer, task, best.llm_plan, lean=False, refined=True)
        if refined is not None and not _optimus_why_not(refined, world) and refined.step_s <= best.step_s:
            best = refined
    return best


def _optimus_why_not(result, world: int) -> str:
    """Why the runtime cannot run an Optimus plan ('' when it can)."""
    from ..errors import TesseraError
    from ..runtime.multimodal import from_optimus

    try:
        from_optimus(result, world)
    except TesseraError as e:
        return f"is not run by this runtime yet ({e})"
    return ""


def _not_runnable(kind, world: int) -> str:
    """Why the runtime cannot run a chosen plan kind yet ('' when it can)."""
    from ..errors import TesseraError
    from ..runtime.multimodal import from_task_plan
    from ..search.multimodal import TaskPlan

    if isinstance(kind.result, OptimusResult):
        return _optimus_why_not(kind.result, world)
    if not isinstance(kind.result, TaskPlan):
        return "is not run by this runtime yet"
    try:
        llm_plan, _ = from_task_plan(kind.result, world)
    except TesseraError as e:
        return f"is not run by this runtime yet ({e})"
    if llm_plan.pipeline.degree > 1:
        return "has an LLM pipeline, which this runtime does not run for a vision-language model yet"
    return ""


def write_encoder(encoder: dict, run_dir) -> str:
    path = os.path.join(str(run_dir), ENCODER_FILE)
    with open(path, "w") as f:
        json.dump(encoder, f)
    return path


def launched_encoder() -> dict | None:
    """The launcher's encoder strategy, on a rank it started (None: the runtime's default)."""
    path = os.environ.get(LAUNCHED_ENCODER)
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def encoder_strategy(encoder: dict | None):
    from ..runtime.multimodal import EncoderStrategy

    if not encoder:
        return None
    rows = {k: tuple(tuple(row) for row in encoder.get(k, ())) for k in ("bubbles", "recompute_blocks")}
    return EncoderStrategy(**{**encoder, **rows})


__all__ = ["plan_vlm", "VLMPlan", "write_encoder", "launched_encoder", "encoder_strategy", "LAUNCHED_ENCODER"]
