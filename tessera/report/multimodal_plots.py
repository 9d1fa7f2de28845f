"""Pictures of multimodal schedules: Optimus bubbles filled with encoder work, Spindle waves.

`plot_optimus` draws one row per LLM pipeline rank: the LLM's forward / backward boxes, the
encoder's forward (EF) and backward (EB) pieces placed in the bubbles, and the idle time left in
grey (boxes carry SVG ids `event-EF-r0-m3`). `plot_waves` draws devices against time: one box per
operator run (forward, then the backward waves in reverse), spanning its device group.
matplotlib is imported inside the functions.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .plots import BUBBLE_COLOUR, EVENT_STYLE, _save

ENCODER_STYLE = {"EF": ("#8172b3", "encoder forward"), "EB": ("#c44e52", "encoder backward")}


def plot_optimus(result: Any, stem: str | Path, title: str = "") -> tuple[Path, ...]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    pp = result.pp
    start = min(p.start for p in result.pieces)
    end = max(p.end for p in result.pieces)
    fig, ax = plt.subplots(figsize=(12, 0.5 * pp + 1.6))
    for r in range(pp):
        ax.barh(r, end - start, left=start, height=0.8, color=BUBBLE_COLOUR, edgecolor="none")
    for p in result.pieces:
        colour = (ENCODER_STYLE.get(p.kind) or EVENT_STYLE.get(p.kind, ("#999999", "")))[0]
        bar = ax.barh(p.rank, p.end - p.start, left=p.start, height=0.8, color=colour, edgecolor="none")
        bar.patches[0].set_gid(f"event-{p.kind}-r{p.rank}-m{p.micro_batch}")
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title or f"Optimus: encoder work in the LLM pipeline's bubbles (pp={pp}, "
                          f"m={result.num_micro_batches}, {result.bubble_filled():.0%} of the bubbles filled)")
    handles = [Patch(color=EVENT_STYLE[k][0], label=f"LLM {EVENT_STYLE[k][1]}") for k in ("F", "B")]
    handles += [Patch(color=c, label=label) for c, label in ENCODER_STYLE.values()]
    handles.append(Patch(color=BUBBLE_COLOUR, label="idle"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=6, fontsize=8, frameon=False)
    fig.tight_layout()
    paths = _save(fig, Path(stem))
    plt.close(fig)
    return paths


def schedule_from_record(record: dict) -> Any:
    """What `plot_optimus` draws, from a plan file's "optimus" record (`tessera plan -o`)."""
    from types import SimpleNamespace

    pieces = tuple(SimpleNamespace(rank=r, kind=k, micro_batch=j, start=s, end=e) for r, k, j, s, e in record["pieces"])
    return SimpleNamespace(pp=record["pp"], num_micro_batches=record["micro_batches"], pieces=pieces,
                           bubble_filled=lambda: record["bubble_filled"])


def plot_waves(timeline: list, gpus: int, stem: str | Path, title: str = "") -> tuple[Path, ...]:
    """`timeline`: (operator, 'F'/'B', first device, devices, start, end) rows
    (`SpindlePlan.timeline`)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({row[0] for row in timeline})
    cmap = plt.get_cmap("tab10")
    colour = {n: cmap(i % 10) for i, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(12, 4.5))
    for name, kind, first, size, s, e in timeline:
        rect = ax.bar(s, size, width=e - s, bottom=first, align="edge", color=colour[name],
                      alpha=1.0 if kind == "F" else 0.65, edgecolor="white", linewidth=0.5)
        rect.patches[0].set_gid(f"op-{kind}-{name.replace('/', '-')}")
        if e - s > 0.03 * max(r[5] for r in timeline):
            ax.text((s + e) / 2, first + size / 2, f"{name}\n{kind}", ha="center", va="center", fontsize=7)
    ax.set_ylim(0, gpus)
    ax.set_ylabel("devices")
    ax.set_xlabel("seconds")
    ax.set_title(title or "Spindle waves: forward waves, then the backward in reverse")
    fig.tight_layout()
    paths = _save(fig, Path(stem))
    plt.close(fig)
    return paths
