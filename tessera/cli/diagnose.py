"""`tessera diagnose RUN_DIR`: a run's per-rank timeline, where the time went, the slowest rank.

    tessera diagnose runs/tiny-llama                  # per-rank summary, last steps, events, verdict
    tessera diagnose runs/tiny-llama --last 40 --plot timeline.png

Reads `metrics.jsonl` and `events.jsonl` of the run directory (`tessera/report/diagnosis.py`).
No torch.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import TesseraError

MAX_RANK_COLUMNS = 8


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run directory (tessera train --out), or its metrics.jsonl")
    p.add_argument("--last", type=int, default=20, help="steps shown in the timeline (default 20)")
    p.add_argument("--threshold", type=float, default=1.25,
                   help="compute per unit of work, over a typical fast rank's, above which a rank is slow (default 1.25)")
    p.add_argument("--plot", metavar="PNG", help="also draw the timeline (step times, per-rank compute) here")


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..report.diagnosis import describe_event, diagnose, read_run

    if args.last < 1:
        raise TesseraError(f"--last must be at least 1, got {args.last}")
    if not 1.0 < args.threshold < 100:
        raise TesseraError(f"--threshold must be a ratio above 1, got {args.threshold}")
    records, events = read_run(args.run)
    d = diagnose(records, events, args.threshold)
    console = Console()
    fmt = lambda x, unit="s": "-" if x is None else (f"{100 * x:.1f}%" if unit == "%" else f"{x:.3g}")  # noqa: E731
    table = Table(title=f"{args.run}: {d.steps} steps on {d.world} ranks (means over the steps after the first)")
    for col in ("rank", "compute s", "comm s", "data s", "bubble s", "MFU", "compute / fast ranks'"):
        table.add_column(col, justify="right")
    for r in d.ranks:
        style = "bold red" if r.rank == d.slowest else None
        table.add_row(str(r.rank), fmt(r.compute_s), fmt(r.comm_s), fmt(r.data_s), fmt(r.bubble_s),
                      fmt(r.mfu, "%"), "-" if r.slowness is None else f"{r.slowness:.2f}x", style=style)
    console.print(table)
    console.print(_timeline(d, args.last))
    saves = [e for e in d.events if e.get("event") == "checkpoint"]
    listed = [e for e in d.events if e.get("event") != "checkpoint"]
    if listed:
        console.print("[bold]events[/bold]")
        for e in listed:
            console.print(f"  {describe_event(e)}")
    if saves:
        waits = [float(e.get("blocking_s", 0.0)) for e in saves]
        console.print(f"checkpoints: {len(saves)} saved; the training loop waited {sum(waits) / len(waits):.3g} s per "
                      f"save on average ({max(waits):.3g} s at most)")
    if d.slowest is None:
        console.print("no straggler: every rank's compute per unit of work is within "
                      f"{args.threshold:.2f}x of the fast ranks'")
    else:
        console.print(f"[bold]slowest rank: {d.slowest}[/bold]")
        for line in d.evidence:
            console.print(f"  - {line}")
    if args.plot:
        _plot(d, Path(args.plot))
        console.print(f"timeline: {args.plot}")
    return 0


def _timeline(d, last: int):
    """The last steps: step time, then each rank's compute / communication seconds."""
    from rich.table import Table

    from ..report.diagnosis import slowness

    shown = list(range(d.world)) if d.world <= MAX_RANK_COLUMNS else \
        sorted({0, d.world - 1, *([d.slowest] if d.slowest is not None else [])})
    table = Table(title="per-rank timeline: compute / communication seconds of each step"
                        + ("" if d.world <= MAX_RANK_COLUMNS else f" (ranks {shown} of {d.world})"))
    table.add_column("step", justify="right")
    table.add_column("step s", justify="right")
    for r in shown:
        table.add_column(f"rank {r}", justify="right")
    for rec in d.records[-last:]:
        compute, comm = rec.get("compute_s"), rec.get("comm_s")
        ratio = slowness(rec)
        cells = []
        for r in shown:
            if isinstance(compute, list) and r < len(compute) and isinstance(comm, list):
                cell = f"{compute[r]:.3f} / {comm[r]:.3f}"
                cells.append(f"[red]{cell}[/red]" if ratio and ratio[r] > 1.25 else cell)
            else:
                cells.append("-")
        table.add_row(str(rec["step"]), f"{rec.get('step_time_s', 0):.3f}", *cells)
    return table


def _plot(d, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    steps = [r["step"] for r in d.records]
    compute = np.array([r["compute_s"] if isinstance(r.get("compute_s"), list) and len(r["compute_s"]) == d.world
                        else [np.nan] * d.world for r in d.records], dtype=float)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, height_ratios=(1, 2))
    top.plot(range(len(steps)), [r.get("step_time_s", np.nan) for r in d.records], marker=".")
    top.set_ylabel("step s")
    for e in d.events:
        if e.get("event") in ("resume", "switch", "rollback", "nonfinite"):
            hits = [i for i, s in enumerate(steps) if s == e.get("step")]
            if hits:
                top.axvline(hits[-1], color="grey", linestyle=":")
                top.annotate(e["event"], (hits[-1], top.get_ylim()[1]), fontsize=7, rotation=90, va="top")
    image = bottom.imshow(compute.T, aspect="auto", interpolation="nearest", cmap="magma")
    bottom.set_ylabel("rank")
    bottom.set_xlabel("logged step (in order, restarts included)")
    fig.colorbar(image, ax=bottom, label="compute s")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
