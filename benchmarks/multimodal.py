"""Multimodal and multi-task planning: Spindle waves, Optimus bubble scheduling, planning time.

All figures are the cost model's predictions (H100-80GB nodes of 8, the preset cluster), not runs.
(a) Spindle: the 4-task workload of examples/tasks.yaml (captioning, text-only, interleaved, VQA)
    on a LLaVA-1.5-7B-shaped model at 64 and 512 GPUs: the wave schedule (tessera.adapt.spindle)
    vs the tasks one after another on all GPUs, each with its best plan (colocated or separate
    encoder placement, tessera.search.multimodal), gradients accumulated into one optimizer step.
    The wave schedule keeps every device within memory: the states of every part whose group
    holds it, across waves, plus its fullest round's activations (spindle.device_memory).
(b) Optimus: an InternViT-6B-shaped encoder with a LLaMA-3-70B LLM on 512 GPUs, 256 samples of
    4096 LLM tokens; dynamic-resolution images of 12 tiles of 448 px (InternVL-style, 3,072 image
    tokens + 1,024 text tokens per sample), and for comparison 6 tiles: encoder work in the LLM
    1F1B pipeline's bubbles vs the encoder as extra pipeline work (the best over pp = 4, 8, 16 and
    every tensor-parallel degree of a node, for each; the extra stages memory-checked like any pipeline rank, with the encoder's fastest or
    leanest plan). Optimus is priced as the runtime runs it (adapt/bubbles.py): whole images per
    pipeline rank and micro-batch, encoder forward passes in each rank's warm-up bubble, backward
    passes in its cool-down bubble; the idle time between a rank's LLM operations stays idle.
    The best pipeline-free plan (encoder and LLM colocated or on separate device groups, each its
    own data/tensor-parallel plan) is priced beside them, and the best plan of all three kinds is
    reported (tessera.adapt.vlm_choice, what `tessera plan` picks).
    Each pipeline rank's memory is its own LLM stage's peak (1F1B's later stages hold fewer
    micro-batches) plus its encoder replica with the images it encodes; refined, the replicas may
    recompute fewer encoder blocks on the ranks with room (optimus._rank_plans). The chosen
    pipeline plan's placement is refined, then the best placement found and the most promising
    per-rank recompute choice are solved as MILPs side by side (bubbles.exact, a node limit that
    keeps planning within seconds, HiGHS without the GIL, while the baselines are priced); `--prove` solves, for every pipeline plan
    Optimus is placed on, its fastest encoder plan's placement again (to the end for the chosen
    one, else with 20,000 nodes) and prints the optimum (or the best found and the MILP's
    bound) beside the S + E that 1.15x would need (minutes).
(c) Planning time: wall seconds of the Spindle plan at 512 GPUs and of the Optimus plan (each
    with a cold cache), measured on whatever machine runs it (on a shared machine, under load),
    and beside it the CPU seconds this process spent (what the planning costs without the load).

Last line: `summary: spindle_speedup=<x> optimus_speedup=<y> plan_s=<z>`, x at 512 GPUs, y at
12 tiles, z the larger planning time.

    python benchmarks/multimodal.py [--prove]
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tessera.adapt.optimus import compare, llm_pipeline_plans, optimus_schedule  # noqa: E402
from tessera.adapt.spindle import plan_spindle, sequential_baseline  # noqa: E402
from tessera.adapt.vlm_choice import Choice, PlanKind  # noqa: E402
from tessera.search.multimodal import PartPricer, plan_vlm_task  # noqa: E402
from tessera.spec.multimodal import resolve_vlm  # noqa: E402
from tessera.spec.presets.clusters import make_cluster  # noqa: E402
from tessera.spec.tasks import TaskSpec, load_tasks  # noqa: E402

TASKS = Path(__file__).resolve().parents[1] / "examples" / "tasks.yaml"


def spindle_part(console: Console) -> tuple[float, float]:
    vlm = resolve_vlm("llava-1.5-7b")
    tasks = load_tasks(TASKS)
    table = Table(title="(a) Spindle waves vs tasks one after another (llava-1.5-7b, predicted step, s)")
    for col in ("GPUs", "sequential best", "Spindle", "speedup", "waves", "plan s (wall / CPU)", "searches"):
        table.add_column(col)
    speedup, plan_s = 0.0, (0.0, 0.0)
    for gpus in (64, 512):
        pricer = PartPricer(vlm, make_cluster(num_gpus=gpus))
        t0, c0 = time.perf_counter(), time.process_time()
        sp = plan_spindle(pricer, tasks, gpus)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        base = sequential_baseline(pricer, tasks, gpus)
        speedup = base.step_s / sp.step_s
        plan_s = (dt, dc)
        table.add_row(str(gpus), f"{base.step_s:.3f}", f"{sp.step_s:.3f}", f"{speedup:.2f}x", str(len(sp.waves)),
                      f"{dt:.2f} / {dc:.2f}", str(sp.searches))
        console.print(f"[bold]{gpus} GPUs[/bold] sequential: " + "; ".join(
            f"{p.task} {p.step_s * 1e3:.0f} ms ({p.placement})" for p in base.plans))
        for line in sp.describe():
            console.print(f"  {line}")
    console.print(table)
    return speedup, plan_s


def optimus_part(console: Console, prove: bool = False) -> tuple[float, float]:
    vlm = resolve_vlm("vit6b-llama3-70b")
    gpus = 512
    table = Table(title="(b) ViT-6B + 70B on 512 GPUs: Optimus vs encoder as extra pipeline work (predicted step, s)")
    for col in ("tiles", "extra stages", "Optimus", "speedup", "Optimus pp/m", "bubble filled",
                "no-pipeline plan", "plan s (wall / CPU)"):
        table.add_column(col)
    result, plan_s = 0.0, (0.0, 0.0)
    best = []
    for tiles in (6, 12):
        text = 4096 - tiles * vlm.image_tokens
        task = TaskSpec(name=f"hires{tiles}", modalities=("image", "text"), batch=256, images_per_sample=tiles,
                        text_tokens=text)
        pricer = PartPricer(vlm, make_cluster(num_gpus=gpus))
        t0, c0 = time.perf_counter(), time.process_time()
        opt, base = compare(pricer, task, gpus, degrees=(4, 8, 16))
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        flat = plan_vlm_task(pricer, task, gpus)
        speedup = base.step_s / opt.step_s
        kinds = sorted([PlanKind(f"no pipeline ({flat.placement})", flat.step_s, flat.tail_s, flat.describe()),
                        PlanKind("Optimus", opt.step_s, opt.tail_s, f"pp={opt.pp}, m={opt.num_micro_batches}"),
                        PlanKind("encoder as extra pipeline stages", base.step_s, base.tail_s,
                                 f"pp={base.pp}, m={base.num_micro_batches}")], key=lambda k: k.step_s)
        best.append((tiles, Choice(tuple(kinds), ())))
        # Four decimals: the 12-tile speedup sits within 0.01% of the 1.15x goal.
        table.add_row(str(tiles), f"{base.step_s:.4f} (pp{base.pp} m{base.num_micro_batches})", f"{opt.step_s:.4f}",
                      f"{speedup:.4f}x", f"{opt.pp}/{opt.num_micro_batches}", f"{opt.bubble_filled():.0%}",
                      f"{flat.step_s:.3f}", f"{dt:.2f} / {dc:.2f}")
        if tiles == 12:
            result, plan_s = speedup, (dt, dc)
            console.print(f"Optimus at 12 tiles: LLM pipeline {opt.pipeline_s:.3f} s + start shift {opt.shift_s * 1e3:.1f} ms "
                          f"+ end extension {opt.extension_s * 1e3:.1f} ms (no placement in these bubbles below "
                          f"{opt.least_extra_s * 1e3:.0f} ms for both) + tails {opt.tail_s * 1e3:.1f} ms; encoder per "
                          f"rank group {opt.encoder.fwd_s * 1e3:.0f} ms fwd + {opt.encoder.bwd_s * 1e3:.0f} ms bwd "
                          f"({opt.describe_encoder()})")
        how = "proven optimal" if opt.placement_optimal else "not proven optimal within the node limit"
        console.print(f"  {tiles} tiles, placement S + E = {(opt.shift_s + opt.extension_s) * 1e3:.1f} ms ({how})")
        if prove:
            prove_placements(console, pricer, task, gpus, base.step_s, opt)
    console.print(table)
    for tiles, choice in best:
        console.print(f"best plan found at {tiles} tiles: [bold]{choice.best.kind}[/bold] {choice.best.step_s:.3f} s "
                      f"({choice.best.detail}): {choice.why()}")
    return result, plan_s


def prove_placements(console: Console, pricer, task, gpus: int, baseline_s: float, opt, goal: float = 1.15,
                     nodes: int = 20000) -> None:
    """For every pipeline plan Optimus is placed on: its step without S + E (pipeline and tails),
    the S + E that would reach `goal` x the baseline, and its chosen encoder plan's placement
    solved to proven optimality (the pipeline plan of `opt`, Optimus's choice) or with `nodes`
    branch-and-bound nodes (the best found and the MILP's bound)."""
    target = baseline_s / goal
    for plan in llm_pipeline_plans(pricer, task, gpus, (4, 8, 16)):
        res = optimus_schedule(pricer, task, plan, refined=True)
        fixed = res.step_s - res.shift_s - res.extension_s
        head = (f"  --prove pp{res.pp} m{res.num_micro_batches} {plan.layers[1].describe()}: pipeline + tails "
                f"{fixed:.3f} s, {goal}x needs S + E <= {(target - fixed) * 1e3:.1f} ms")
        if fixed >= target:
            console.print(f"{head}: out of reach whatever the placement")
            continue
        t0 = time.perf_counter()
        chosen = res.llm_plan.layers == opt.llm_plan.layers and res.num_micro_batches == opt.num_micro_batches
        solved = res.problem.solve(node_limit=None if chosen else nodes)  # the chosen one to the end (1-2 minutes)
        value = solved.placed.shift_s + solved.placed.extension_s if solved else math.inf
        bound = solved.bound_s if solved else 0.0
        verdict = ("optimum" if solved and solved.optimal else "best found") + f" {value * 1e3:.1f} ms, bound {bound * 1e3:.1f} ms"
        console.print(f"{head}; {res.describe_encoder()}: {verdict} ({time.perf_counter() - t0:.0f} s): "
                      f"{baseline_s / (fixed + value):.3f}x at best found, never above {baseline_s / (fixed + bound):.3f}x")


def main() -> None:
    console = Console(width=160)
    x, t_spindle = spindle_part(console)
    y, t_optimus = optimus_part(console, prove="--prove" in sys.argv[1:])
    console.print(f"(c) planning time: wall {max(t_spindle[0], t_optimus[0]):.2f} s (a shared machine's load inflates "
                  f"it), CPU {max(t_spindle[1], t_optimus[1]):.2f} s of this process")
    print(f"summary: spindle_speedup={x:.2f} optimus_speedup={y:.2f} plan_s={max(t_spindle[0], t_optimus[0]):.2f}")


if __name__ == "__main__":
    main()
