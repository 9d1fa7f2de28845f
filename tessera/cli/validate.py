"""`tessera validate`: run plans for a few steps; predicted vs measured step time and peak memory.

    torchrun --nproc-per-node 4 -m tessera validate --plan plan.json --steps 20 [--plot out.png]

Memory, two ways (see `tessera.profile.results`): model states + saved activations, measured by
instrumentation, against the cost model without its transient buffers; and the allocator's peak
for the plan (everything it allocated) against the cost model's whole peak without the framework
reserve. Step time is the median over the timed steps of the slowest rank.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ..errors import TesseraError
from ..profile.fit import STATISTICS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", nargs="+", required=True, help="plan JSON file(s), run one after another")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per plan (default 20)")
    parser.add_argument("--untimed-steps", dest="warmup", type=int, default=1, metavar="N",
                        help="untimed steps first, for lazy initialisation (default 1)")
    parser.add_argument("--warmup", dest="warmup", type=int, help=argparse.SUPPRESS)  # the earlier name
    parser.add_argument("--statistic", choices=tuple(STATISTICS), default="median",
                        help="summary of the timed steps (default: median, as the model profile's; see "
                             "tessera.profile.fit.STATISTICS)")
    parser.add_argument("--plot", default=None, help="write a bar chart of predicted vs measured here (PNG)")
    parser.add_argument("--json", default=None, help="write the results here as JSON")
    parser.add_argument("--model-profile", default=None,
                        help="the model profile the plans were costed with: one of its block timings is rerun "
                             "alongside the steps to report the machine's speed against the profile's")


def run(args: argparse.Namespace) -> int:
    from ..plan import Plan

    if args.steps < 1:
        raise TesseraError(f"--steps must be at least 1, got {args.steps}")
    plans = [Plan.load(p) for p in args.plan]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    from ..runtime.machine import check_plan_fits_machine, this_machine

    machine, local_world = this_machine(), int(os.environ.get("LOCAL_WORLD_SIZE", world))
    for path, plan in zip(args.plan, plans):
        if plan.world_size != world:
            raise TesseraError(f"plan {path} was made for {plan.world_size} ranks, but {world} are running; "
                               f"launch with torchrun --nproc-per-node {plan.world_size}")
        check_plan_fits_machine(plan, machine, local_world, f"plan {path}")  # its predictions are of that machine
    gauge = None
    if args.model_profile:
        from ..profile.apply import load_model_profile
        from ..profile.results import Gauge

        profile = load_model_profile(args.model_profile)
        for plan in plans:  # refused unless every plan trains the profile's model
            gauge = Gauge.of(profile, plan.model)
    import torch.distributed as dist

    from ..profile.apply import write_atomic
    from ..profile.measure.validate import run_validations
    from ..runtime.parallelize import check_plan_supported

    runnable, skipped = [], []
    for path, plan in zip(args.plan, plans):
        try:
            check_plan_supported(plan, world, pipeline_available=True)
            runnable.append(plan)
        except TesseraError as e:  # the runtime refuses it (on every rank alike): go on without it
            skipped.append((path, str(e)))
    try:
        results = run_validations(runnable, steps=args.steps, warmup=args.warmup, statistic=args.statistic,
                                  gauge=gauge) if runnable else []
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    print_results(results)
    for path, why in skipped:
        print(f"skipped {path}: {why}")
    if args.json:
        write_atomic(args.json, json.dumps({"results": [r.to_dict() for r in results],
                                            "skipped": [{"plan": p, "reason": w} for p, w in skipped]}, indent=1))
    if args.plot:
        plot_results(results, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def print_results(results) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for v in results:
        t = Table(title=f"{v.plan}: {v.world} ranks, {len(v.step_times)} timed steps")
        for col in ("rank", "pp", "pred step s", "meas step s", "err", "pred mem MiB", "meas mem MiB", "err"):
            t.add_column(col, justify="right")
        for r in v.ranks:
            t.add_row(str(r.rank), str(r.pp_rank), f"{v.predicted_step_s:.3f}", f"{r.step_s:.3f}",
                      _pct((v.predicted_step_s - r.step_s) / r.step_s), f"{v.predicted_memory[r.pp_rank] / 2**20:.1f}",
                      f"{r.memory / 2**20:.1f}", _pct(v.memory_error(r)))
        console.print(t)
        p, m = v.peak_memory
        console.print(f"step (slowest rank, median): predicted {v.predicted_step_s:.3f} s, measured "
                      f"{v.measured_step_s:.3f} s ({_pct(v.time_error)}); peak memory predicted {p / 2**20:.1f} MiB, "
                      f"measured {m / 2**20:.1f} MiB ({_pct(v.peak_memory_error)})"
                      + _allocator(v)
                      + (f"; machine speed during the runs {v.speed_ratio:.2f}x the model profile's"
                         if v.speed_ratio is not None else "") + _at_profiled_speed(v))


def _allocator(v) -> str:
    pair = v.peak_allocated
    if pair is None:
        return ""
    p, m = pair
    return f"; allocator peak predicted {p / 2**20:.1f} MiB, measured {m / 2**20:.1f} MiB ({_pct((p - m) / m)})"


def _at_profiled_speed(v) -> str:
    t = v.at_profiled_speed()
    if t is None:
        return ""
    return (f"; measured at the profile's speed (step by step): {t:.3f} s "
            f"({_pct((v.predicted_step_s - t) / t)})")


def plot_results(results, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [v.plan for v in results]
    x = np.arange(len(results))
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(max(8, 1.2 * len(results) + 4), 4.5))
    w = 0.38
    ax_t.bar(x - w / 2, [v.predicted_step_s for v in results], w, label="predicted")
    ax_t.bar(x + w / 2, [v.measured_step_s for v in results], w, label="measured")
    ax_t.set_ylabel("step time (s)")
    ax_m.bar(x - w / 2, [v.peak_memory[0] / 2**20 for v in results], w, label="predicted")
    ax_m.bar(x + w / 2, [v.peak_memory[1] / 2**20 for v in results], w, label="measured")
    ax_m.set_ylabel("peak memory per rank (MiB)")
    for ax in (ax_t, ax_m):
        ax.set_xticks(x, names, rotation=30, ha="right")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
