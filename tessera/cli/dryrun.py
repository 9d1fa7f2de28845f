"""`tessera dryrun --plan plan.json [--ranks first,last,...]`: run a plan's ranks at its real world size.

Each sampled rank (default: the first rank of the first pipeline stage and the last rank of the
last) is built by the trainer's own code in PyTorch's fake process group at the plan's world
size, and one training step runs: with real tensors for a small model, with fake ones (shapes,
no data) otherwise. Printed per rank: the model-state bytes (parameters, gradients, optimizer
state) and the collectives of the step (kind, group size, bytes, count), measured beside the cost
model's prediction, mismatches flagged. Needs no GPU.
"""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", required=True, help="plan JSON written by `tessera plan -o`")
    p.add_argument("--ranks", default=None,
                   help="ranks to run, comma-separated numbers or first/last (default: first,last)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--materialize", dest="materialize", action="store_true", default=None,
                      help="real tensors (the whole model must fit this machine in fp32)")
    mode.add_argument("--fake", dest="materialize", action="store_false",
                      help="fake tensors: exact shapes and no data, any model size (default above 128M parameters)")
    p.add_argument("--all", action="store_true", help="list every collective, not only mismatches")


def run(args: argparse.Namespace) -> int:
    from ..plan import Plan
    from ..report.tables import make_console
    from ..runtime.dryrun.run import dry_run, parse_ranks

    plan = Plan.load(args.plan)
    ranks = parse_ranks(args.ranks, plan) if args.ranks else None
    console = make_console()
    with console.status(f"dry run of {plan.model.name} at {plan.world_size} ranks", spinner="dots"):
        result = dry_run(plan, ranks, args.materialize)
    render_dry_run(result, console, everything=args.all)
    for line in result.not_fitting():
        console.print(f"[bold red]does not fit:[/] {line}")
    return 0


def size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def render_dry_run(result, console, everything: bool = False) -> None:
    """Per sampled rank: a state-memory table and a collectives table."""
    from rich.table import Table

    plan = result.plan
    for r in result.ranks:
        c, m = r.comparison, r.measurement
        console.print(f"[bold]rank {c.rank}[/] (pipeline stage {c.pp_rank}) of {plan.world_size}: {c.mode} tensors, "
                      f"built in {m.build_s:.1f} s, step {m.counted_step} counted, stepped in {m.step_s:.1f} s, "
                      f"peak RSS {size(m.peak_rss_bytes)}")
        state = Table(title="model states per device", title_justify="left")
        for col in ("", "predicted", "measured", "error", "host (offload)"):
            state.add_column(col, justify="right" if col else "left")
        for row in c.state:
            flag = "" if row.matches else " [red]![/]"
            state.add_row(row.name, size(row.predicted), size(row.measured), f"{row.error:+.1%}{flag}",
                          size(row.host) if row.host else "")
        console.print(state)
        shown = [row for row in c.collectives if everything or not row.matches]
        coll = Table(title=f"collectives of one step: {c.count_mismatches} of {len(c.collectives)} groups differ"
                           + ("" if everything else " (--all lists every group)"), title_justify="left")
        for col in ("kind", "group", "bytes", "predicted", "measured", "", "predicted as"):
            coll.add_column(col, justify="right" if col in ("group", "bytes", "predicted", "measured") else "left")
        for row in shown:
            coll.add_row(row.kind, str(row.group_size), size(row.bytes), str(row.predicted), str(row.measured),
                         "" if row.matches else "[red]![/]", row.why)
        if shown:
            console.print(coll)
        else:
            console.print(coll.title)
        for note in c.notes:
            console.print(f"note: {note}")
        console.print()
