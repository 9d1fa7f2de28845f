"""`tessera show plan.json [-o DIR]`: a plan as tables, and as pictures (PNG and SVG).

Pictures: `<plan>.timeline.{png,svg}` (the pipeline schedule: stages x time, forward, backward,
weight-gradient, p2p sends and the bubble) and `<plan>.memory.{png,svg}` (memory per pipeline
rank against the device). They go to DIR, or next to the plan file. No torch import.
"""
from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="plan JSON written by `tessera plan -o`")
    p.add_argument("-o", "--out", dest="output_dir", metavar="DIR",
                   help="where to write the pictures (default: next to the plan file)")
    p.add_argument("--output-dir", dest="output_dir", help=argparse.SUPPRESS)  # the earlier name
    p.add_argument("--no-plots", action="store_true", help="tables only")


def run(args: argparse.Namespace) -> int:
    from ..plan import Plan
    from ..report.tables import make_console, render_plan
    from .plan import evaluated

    console = make_console()
    plan = evaluated(Plan.load(args.plan))
    render_plan(plan, console)
    if args.no_plots:
        return 0
    from ..report.plots import plot_plan

    path = Path(args.plan)
    out_dir = Path(args.output_dir) if args.output_dir else path.parent
    files = plot_plan(plan, out_dir, stem=path.stem)
    console.print()
    for kind, paths in files.items():
        console.print(f"{kind}: " + ", ".join(str(p) for p in paths))
    return 0
