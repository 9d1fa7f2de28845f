"""`tessera plan --model <vision-language model> [--tasks tasks.yaml]`: separate encoder and LLM
plans for one task, or Spindle waves for a multi-task workload, with the baseline beside them;
then every plan kind the planner knows (`adapt.vlm_choice`: no pipeline, Optimus, encoder as extra
pipeline stages; Spindle waves, tasks one after another), fastest first, and the chosen one with
why.

`-o plan.json` writes the multimodal plan (kind "multimodal": the waves' timeline, each task's
plans, the Optimus placement when it was priced); `tessera show plan.json` draws the waves and the
encoder's passes in the LLM pipeline's bubbles. No torch import.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from ..errors import TesseraError


def _default_task(args, vlm):
    from ..spec.tasks import TaskSpec

    batch = args.global_batch or 256
    seq = args.seq_len or min(2048, vlm.config.llm.max_seq_len)
    text = seq - vlm.image_tokens
    if text < 0:
        raise TesseraError(f"--seq-len {seq} is shorter than one image's {vlm.image_tokens} tokens")
    return TaskSpec(name="image-text", modalities=("image", "text"), batch=batch, images_per_sample=1,
                    text_tokens=text)


def run_multimodal(args, cluster, out) -> int:
    from ..adapt.spindle import SpindlePlan, sequential_baseline
    from ..adapt.vlm_choice import choose
    from ..search.multimodal import PartPricer, plan_vlm_task
    from ..spec.multimodal import resolve_vlm
    from ..spec.tasks import MultiTaskWorkload, load_tasks

    vlm = resolve_vlm(args.model)
    gpus = cluster.num_gpus
    workload = load_tasks(args.tasks) if args.tasks else MultiTaskWorkload(tasks=(_default_task(args, vlm),))
    workload.check_model(vlm)
    pricer = PartPricer(vlm, cluster, dtype=args.dtype or "bf16")
    out.print(f"[bold]{vlm.name}[/bold]: encoder {vlm.encoder.num_params / 1e9:.2f}B ({vlm.encoder_seq_len} tokens "
              f"per image), projector {vlm.projector.params / 1e6:.0f}M, LLM {vlm.llm.num_params / 1e9:.2f}B "
              f"({vlm.image_tokens} tokens per image) on {cluster.name}")
    start = time.perf_counter()
    plans = [plan_vlm_task(pricer, t, gpus, args.encoder_gpus) for t in workload.tasks]
    record = dict(kind="multimodal", model=vlm.name, gpus=gpus,
                  tasks=[dict(task=p.task, placement=p.placement, encoder_gpus=p.encoder_gpus, step_s=p.step_s,
                              describe=p.describe()) for p in plans])
    for p in plans:
        out.print(f"  {p.describe()}: {p.step_s * 1e3:.1f} ms")
    choice = choose(pricer, workload, gpus, args.encoder_gpus)
    spindle = next((k.result for k in choice.kinds if isinstance(k.result, SpindlePlan)), None)
    if len(workload.tasks) > 1:
        base = sequential_baseline(pricer, workload, gpus)
        out.print(f"tasks one after another (each its best plan without a pipeline): {base.step_s * 1e3:.1f} ms "
                  f"per step")
        record.update(sequential_s=base.step_s)
        if spindle is not None:
            out.print(f"Spindle waves: {spindle.step_s * 1e3:.1f} ms per step ({base.step_s / spindle.step_s:.2f}x)")
            for line in spindle.describe():
                out.print(f"  {line}")
            record.update(spindle_s=spindle.step_s, timeline=spindle.timeline())
    out.print("plan kinds, fastest first:")
    for k in choice.kinds:
        out.print(f"  {k.kind}: {k.step_s * 1e3:.1f} ms per step ({k.detail})")
    for kind, why in choice.skipped:
        out.print(f"  [dim]{kind}: not priced ({why})[/dim]")
    optimus = next((k.result for k in choice.kinds if k.kind == "Optimus"), None)
    if optimus is not None:  # the picture of the encoder's passes in the pipeline's bubbles
        record.update(optimus=dict(
            pp=optimus.pp, micro_batches=optimus.num_micro_batches, shift_s=optimus.shift_s,
            extension_s=optimus.extension_s, bubble_filled=optimus.bubble_filled(),
            counts=[list(row) for row in optimus.counts],
            pieces=[[p.rank, p.kind, p.micro_batch, p.start, p.end] for p in optimus.pieces]))
    best = choice.best
    out.print(f"[bold]chosen: {best.kind}[/bold], {best.step_s * 1e3:.1f} ms per step: {choice.why()}")
    record.update(chosen=dict(kind=best.kind, step_s=best.step_s, detail=best.detail, why=choice.why()),
                  kinds=[dict(kind=k.kind, step_s=k.step_s, detail=k.detail) for k in choice.kinds],
                  not_priced=[dict(kind=k, why=w) for k, w in choice.skipped])
    out.print(f"[dim]planned in {time.perf_counter() - start:.2f} s[/dim]")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(record, indent=1))
        out.print(f"wrote {args.output} (show it with: tessera show {args.output})")
    return 0


def show_multimodal(record: dict, path: Path, out_dir: Path, console, plots: bool) -> int:
    for t in record.get("tasks", []):
        console.print(f"  {t['describe']}: {t['step_s'] * 1e3:.1f} ms")
    if "spindle_s" in record:
        console.print(f"Spindle {record['spindle_s'] * 1e3:.1f} ms vs one after another "
                      f"{record['sequential_s'] * 1e3:.1f} ms")
    if "chosen" in record:
        console.print(f"chosen: {record['chosen']['kind']}, {record['chosen']['step_s'] * 1e3:.1f} ms per step: "
                      f"{record['chosen']['why']}")
    if plots and record.get("timeline"):
        from ..report.multimodal_plots import plot_waves

        files = plot_waves(record["timeline"], record["gpus"], out_dir / f"{path.stem}-waves")
        console.print("waves: " + ", ".join(str(f) for f in files))
    if record.get("optimus"):
        o = record["optimus"]
        console.print(f"Optimus: pp={o['pp']}, {o['micro_batches']} micro-batches, {o['bubble_filled']:.0%} of the "
                      f"bubbles filled with encoder passes (start {o['shift_s'] * 1e3:.1f} ms earlier, end "
                      f"{o['extension_s'] * 1e3:.1f} ms later); images per pipeline rank "
                      f"{[sum(row) for row in o['counts']]}")
        if plots:
            from ..report.multimodal_plots import plot_optimus, schedule_from_record

            files = plot_optimus(schedule_from_record(o), out_dir / f"{path.stem}-optimus")
            console.print("Optimus bubbles: " + ", ".join(str(f) for f in files))
    return 0
