"""`tessera train` of a vision-language model: the planner's encoder and LLM plans, run as planned.

The planner prices every plan kind of the run's one image-text task (`adapt.vlm_choice.choose`:
no pipeline with the encoder colocated or on ranks of its own, Optimus, the encoder as extra
pipeline stages) and picks the fastest. The runtime (`runtime.multimodal.MultimodalTrainer`) runs
a colocated plan: the LLM under any non-pipeline plan, the encoder data parallel on every rank with
its ZeRO stage and recompute. When the planner's choice is another kind, the run takes the best
colocated plan the runtime runs (the encoder searched without tensor, sequence or pipeline
parallelism, the LLM without a pipeline) and says so in one line.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace

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
    from ..plan import Recompute
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
    task_plan, why_not = best.result, _not_runnable(best, world)
    if why_not:
        runnable_llm = replace(options, max_pp=1)
        runnable_encoder = replace(options, max_pp=1, max_tp=1, max_sp=1, allow_cp=False, allow_hsdp=False,
                                   allow_offload=False)
        pricer = PartPricer(spec, cluster, options=runnable_llm, dtype=workload.dtype,
                            encoder_options=runnable_encoder)
        task_plan = plan_vlm_task(pricer, task, world, encoder_gpus=world)
    enc = task_plan.encoder.plan
    encoder = dict(dp=world, first_rank=0, zero=max(s.zero for s in enc.layers),
                   recompute=any(s.recompute != Recompute.NONE for s in enc.layers))
    lines = [f"encoder plan (data parallel on every rank): {task_plan.encoder.describe()}",
             f"LLM plan: {task_plan.llm.describe()}"]
    if why_not:
        lines.append(f"the planner's choice, {best.kind} ({best.step_s * 1e3:.1f} ms per step), {why_not}: running "
                     f"the best colocated plan it runs ({task_plan.step_s * 1e3:.1f} ms per step)")
    else:
        lines.append(f"chosen: {best.kind}, {best.step_s * 1e3:.1f} ms per step ({choice.why()})")
    return VLMPlan(task_plan.llm.plan, encoder, lines)


def _not_runnable(kind, world: int) -> str:
    """Why the runtime cannot run a chosen plan kind yet ('' when it can)."""
    from ..errors import TesseraError
    from ..runtime.multimodal import from_task_plan
    from ..search.multimodal import TaskPlan

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

    return EncoderStrategy(**encoder) if encoder else None


__all__ = ["plan_vlm", "VLMPlan", "write_encoder", "launched_encoder", "encoder_strategy", "LAUNCHED_ENCODER"]
