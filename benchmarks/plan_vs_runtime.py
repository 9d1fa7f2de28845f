"""Does the runtime run what the cost model priced? Searched plans dry-run at their real world size.

Searches llama2-7b on 64 H100s (global batch 512 x 4,096 tokens), llama3-70b on 1,024 (1,024 x
8,192), gpt3-175b on 1,024 (1,536 x 2,048: GPT-3's 3.2M-token batch) and llama3-405b on 16,384
(16,384 x 8,192), then dry-runs the first rank of the first pipeline stage and the last rank of
the last (`tessera.runtime.dryrun`: the trainer's own code on PyTorch's fake process group, fake
tensors, one training step) and prints, per rank, predicted vs measured model-state bytes and
the step's collectives grouped by (kind, group size, bytes), mismatches only (`--all`: every
group). Ends with
    summary: plans=<n> runnable=<n> max_state_mem_err_pct=<x> collective_count_mismatches=<n>
where the state error is that of the total of parameters, gradients and optimizer state per
device, and a count mismatch is a (kind, group size, bytes) group whose predicted and measured
counts differ. Run: python benchmarks/plan_vs_runtime.py [--only llama2-7b] [--all]
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.table import Table  # noqa: E402

from tessera.cli.dryrun import render_dry_run, size  # noqa: E402
from tessera.report.tables import make_console  # noqa: E402
from tessera.runtime.dryrun.run import dry_run  # noqa: E402
from tessera.search import search  # noqa: E402
from tessera.spec import Workload  # noqa: E402
from tessera.spec.presets import get_model, make_cluster  # noqa: E402

CASES = [  # (model, GPUs, global batch, sequence length)
    ("llama2-7b", 64, 512, 4096),
    ("llama3-70b", 1024, 1024, 8192),
    ("gpt3-175b", 1024, 1536, 2048),
    ("llama3-405b", 16384, 16384, 8192),
]


def describe(plan) -> str:
    p = plan.pipeline
    layouts = sorted({s.describe() for s in plan.layers}, key=lambda d: -sum(s.describe() == d for s in plan.layers))
    return (f"pp{p.degree} {p.schedule.value}{f' v{p.virtual_stages}' if p.virtual_stages > 1 else ''} "
            f"m{plan.num_micro_batches}x{plan.micro_batch_size} | {layouts[0]}"
            + (f" (+{len(layouts) - 1} other layouts)" if len(layouts) > 1 else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="run only this model")
    parser.add_argument("--all", action="store_true", help="list every collective group, not only mismatches")
    args = parser.parse_args()
    console = make_console()
    start = time.perf_counter()
    summary = Table(title="plan vs runtime: sampled ranks", title_justify="left")
    for col in ("model", "GPUs", "plan", "rank", "states predicted", "measured", "error", "collective groups differing",
                "dry run s", "peak RSS"):
        summary.add_column(col)
    plans = runnable = mismatches = 0
    worst = 0.0
    for name, gpus, batch, seq in CASES:
        if args.only and name != args.only:
            continue
        plans += 1
        model, cluster = get_model(name), make_cluster("h100-80gb", gpus)
        plan = search(model, cluster, Workload(global_batch=batch, seq_len=seq))
        console.rule(f"{name} on {gpus} GPUs, {batch} x {seq}: {describe(plan)}")
        t0 = time.perf_counter()
        try:
            result = dry_run(plan, materialize=False)
        except Exception as e:  # noqa: BLE001 (a plan the runtime cannot run is a result here)
            console.print(f"[red]not runnable:[/] {str(e).splitlines()[0]}")
            summary.add_row(name, str(gpus), describe(plan), "-", "-", "-", "-", "not runnable", "-", "-")
            continue
        runnable += 1
        render_dry_run(result, console, everything=args.all)
        for line in result.not_fitting():
            console.print(f"[red]does not fit:[/] {line}")
        worst = max(worst, result.max_state_error)
        mismatches += result.count_mismatches
        for r in result.ranks:
            c, m = r.comparison, r.measurement
            total = c.state[-1]
            summary.add_row(name, str(gpus), describe(plan), str(c.rank), size(total.predicted), size(total.measured),
                            f"{total.error:+.1%}", f"{c.count_mismatches} of {len(c.collectives)}",
                            f"{m.build_s + m.step_s:.0f}", size(m.peak_rss_bytes))
        console.print(f"dry run of {name}: {time.perf_counter() - t0:.0f} s")
    console.print(summary)
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    console.print(f"wall time {time.perf_counter() - start:.0f} s on this machine (shared, 2 cores); peak RSS "
                  f"{size(own)} (this process), {size(kids)} (largest rank process)")
    print(f"summary: plans={plans} runnable={runnable} max_state_mem_err_pct={100 * worst:.1f} "
          f"collective_count_mismatches={mismatches}")


if __name__ == "__main__":
    main()
