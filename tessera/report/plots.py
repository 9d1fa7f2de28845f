"""A plan as pictures: the pipeline schedule timeline and the memory of each pipeline rank.

`plot_timeline` draws the events of the schedule simulator (`tessera.cost.schedule.simulate`):
one row per pipeline rank, one box per forward (F), backward (B, or input-gradient under
zero-bubble) and weight-gradient (W) event, thin bars for the point-to-point sends between
stages, and grey boxes for the idle time (the bubble). Every event box carries an SVG id
(`event-F-s0-m3-c0`), so the picture can be checked against the simulation it came from.

A schedule of many micro-batches (more than `ZOOM_OVER`, e.g. 8 stages x 64) is too dense to
read whole: the step is drawn on top and, below it, two zooms of the same events at a readable
scale, the start of the step (the warm-up: which micro-batch enters each stage when) and its end
(the cool-down), each box labelled with its micro-batch.

`plot_memory` stacks parameters, gradients, optimizer state, activations and buffers per
pipeline rank against the device capacity.

matplotlib is imported inside the functions, so planning never pays for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..plan import Plan
from .tables import GiB, MEMORY_PARTS, fmt_seconds

EVENT_STYLE = {  # kind -> (colour, legend label)
    "F": ("#4c72b0", "forward"),
    "B": ("#dd8452", "backward"),
    "W": ("#55a868", "weight grad"),
}
COMM_COLOUR = "#8172b3"
TAIL_COLOUR = "#64b5cd"
BUBBLE_COLOUR = "#d9d9d9"
MEMORY_COLOURS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868",
                  "activations": "#c44e52", "buffers": "#937860", "fragmentation": "#8c8c8c"}
FORMATS = ("png", "svg")
MAX_PATCHES = 3000  # events drawn one SVG element each; beyond, painted into one image
ZOOM_OVER = 16  # micro-batches beyond which the start and end of the step are also drawn zoomed


@dataclass(frozen=True)
class TimelineDrawing:
    """What `plot_timeline` drew: the files and how many boxes of each sort."""

    paths: tuple[Path, ...]
    event_boxes: int
    bubble_boxes: int
    comm_boxes: int


def _margins(fig: Any, left: float, right: float, top: float, bottom: float) -> None:
    """Fixed margins in inches: cheaper than bbox_inches="tight", which draws every figure twice."""
    w, h = fig.get_size_inches()
    fig.subplots_adjust(left=left / w, right=1 - right / w, top=1 - top / h, bottom=bottom / h)


def _save(fig: Any, stem: Path) -> tuple[Path, ...]:
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in FORMATS:
        path = stem.with_name(f"{stem.name}.{fmt}")
        tmp = path.with_name(path.name + ".tmp")
        fig.savefig(tmp, format=fmt, dpi=150)
        tmp.replace(path)
        paths.append(path)
    return tuple(paths)


def idle_intervals(events: Iterable[Any], num_stages: int, end: float) -> list[tuple[int, float, float]]:
    """(stage, start, stop) of every gap in each stage's busy time between 0 and `end`."""
    busy: dict[int, list[tuple[float, float]]] = {s: [] for s in range(num_stages)}
    for e in events:
        busy[e.stage].append((e.start, e.end))
    gaps = []
    for stage, spans in busy.items():
        t = 0.0
        for start, stop in sorted(spans):
            if start > t + 1e-12 * max(end, 1.0):
                gaps.append((stage, t, start))
            t = max(t, stop)
        if end > t + 1e-12 * max(end, 1.0):
            gaps.append((stage, t, end))
    return gaps


@dataclass
class _Boxes:
    """Rectangles of one sort: drawn one patch each (with SVG ids) or as one rasterised collection."""

    colour: str
    hatch: str | None = None
    zorder: float = 1.0
    xs: list = field(default_factory=list)  # (x, y, width, height, alpha, gid)

    def add(self, x: float, y: float, w: float, h: float, gid: str, alpha: float = 1.0) -> None:
        self.xs.append((x, y, w, h, alpha, gid))

    def draw(self, ax: Any, window: tuple[float, float] | None = None) -> None:
        """One patch per box; with `window` (x from, to), only the boxes in it, without SVG ids."""
        from matplotlib.patches import Rectangle

        edge = dict(edgecolor="white", linewidth=0.5) if self.hatch is None else dict(edgecolor="none")
        for x, y, w, h, alpha, gid in self.xs:
            if window is not None and (x + w < window[0] or x > window[1]):
                continue
            ax.add_patch(Rectangle((x, y), w, h, facecolor=self.colour, alpha=alpha, hatch=self.hatch,
                                   gid=gid if window is None else None, zorder=self.zorder, **edge))

    def paint(self, img: Any, x_px: float, y0: float, y_px: float) -> None:
        """Paint the boxes into an RGB image (row 0 at the top, `y0` the data y of its bottom edge)."""
        from matplotlib.colors import to_rgb

        rgb = to_rgb(self.colour)
        rows, cols = img.shape[:2]
        for x, y, w, h, alpha, _ in self.xs:
            c0, c1 = int(x * x_px), max(int(x * x_px) + 1, int((x + w) * x_px))
            r1 = rows - int((y - y0) * y_px)
            r0 = rows - int((y + h - y0) * y_px)
            img[max(r0, 0):max(r1, 0), c0:min(c1, cols)] = [alpha * c + (1 - alpha) for c in rgb]


def plot_timeline(events: Sequence[Any], num_stages: int, stem: str | Path, *, title: str = "",
                  p2p: float = 0.0, tails: Sequence[float] = (),
                  max_patches: int = MAX_PATCHES, zoom_over: int = ZOOM_OVER) -> TimelineDrawing:
    """Draw schedule events (stage, kind, micro_batch, chunk, start, end) to `stem`.png and .svg.

    `tails[r]`: seconds rank r spends after its last event on the once-per-step work (exposed
    gradient sync, optimizer update), drawn as one box; the step ends when the last tail does.
    Up to `max_patches` events each box is its own SVG element (id `event-F-s0-m3-c0`); beyond,
    the boxes are painted into one image so that a 128-stage schedule still draws in seconds. More
    than `zoom_over` micro-batches: the start and the end of the step are drawn again, zoomed."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    makespan = max((e.end for e in events), default=0.0)
    end = makespan + max(tails, default=0.0)
    scale, unit = (1e3, "ms") if end < 2 else (1.0, "s")
    num_chunks = max((e.chunk for e in events), default=0) + 1
    virtual = max(1, num_chunks // num_stages)
    one_by_one = len(events) <= max_patches
    micro_batches = max((e.micro_batch for e in events), default=0) + 1
    zoom = micro_batches > zoom_over
    rows_height = min(0.55 * num_stages, 12.0)
    fig = Figure(figsize=(12, 1.5 + rows_height * (2.2 if zoom else 1.0)))
    _margins(fig, left=0.9, right=0.2, top=0.75, bottom=0.55)
    if zoom:
        grid = fig.add_gridspec(2, 2, hspace=0.28, wspace=0.06)
        ax = fig.add_subplot(grid[0, :])
        zooms = [fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])]
    else:
        ax, zooms = fig.add_subplot(), []
    height = 0.8
    min_label_width = end / 60  # label a box with its micro-batch only where the number fits
    label = one_by_one and num_stages <= 32
    # The zoomed windows span about (stages + 4) micro-batches' share of the step.
    span = end * min(0.5, (num_stages + 4) / (micro_batches + num_stages))
    windows = [(0.0, span), (end - span, end)] if zoom else []
    labels: list[tuple[float, float, str]] = []  # (x, y, micro-batch) of every event, for the zooms

    def row(stage: int) -> float:
        return num_stages - 1 - stage - height / 2  # stage 0 on top

    boxes = {k: _Boxes(colour) for k, (colour, _) in EVENT_STYLE.items()}
    comm, tail_boxes = _Boxes(COMM_COLOUR, zorder=2), _Boxes(TAIL_COLOUR)
    bubbles = _Boxes(BUBBLE_COLOUR, hatch="///", zorder=0)
    for e in events:
        # A rank's later model chunks (interleaved schedules) drawn lighter to tell them apart;
        # `chunk` is the global chunk index, chunk // num_stages the rank's virtual stage.
        alpha = 1.0 - 0.4 * (e.chunk // num_stages) / max(1, virtual - 1)
        boxes[e.kind].add(e.start * scale, row(e.stage), (e.end - e.start) * scale, height,
                          f"event-{e.kind}-s{e.stage}-m{e.micro_batch}-c{e.chunk}", alpha)
        if label and e.end - e.start >= min_label_width:
            ax.text((e.start + e.end) / 2 * scale, row(e.stage) + height / 2, str(e.micro_batch),
                    ha="center", va="center", fontsize=7, color="white")
        if zoom and num_stages <= 32:
            labels.append(((e.start + e.end) / 2, e.end - e.start, row(e.stage) + height / 2, str(e.micro_batch)))
        # A forward sends to the next chunk, a backward to the previous one, except at the ends.
        sends = (e.kind == "F" and e.chunk < num_chunks - 1) or (e.kind == "B" and e.chunk > 0)
        if p2p > 0 and sends and num_stages > 1:
            comm.add(e.end * scale, row(e.stage), p2p * scale, height * 0.2,
                     f"comm-{e.kind}-s{e.stage}-m{e.micro_batch}-c{e.chunk}")
    for stage, tail in enumerate(tails):
        if tail > 0:
            tail_boxes.add(makespan * scale, row(stage), tail * scale, height, f"tail-s{stage}")
    for i, (stage, start, stop) in enumerate(idle_intervals(events, num_stages, makespan)):
        bubbles.add(start * scale, row(stage), (stop - start) * scale, height, f"bubble-{i}")
    x_max, y_lo, y_hi = (end * scale * 1.01 if end else 1.0), -0.6, num_stages - 0.4
    groups = (bubbles, *boxes.values(), comm, tail_boxes)
    if one_by_one:
        for group in groups:
            group.draw(ax)
    else:
        # Too many boxes for one artist each: paint them into an image at the figure's resolution.
        import numpy as np

        cols, rows = 1800, max(200, 12 * num_stages)
        img = np.ones((rows, cols, 3))
        for group in groups:
            group.paint(img, cols / x_max, y_lo, rows / (y_hi - y_lo))
        ax.imshow(img, extent=(0, x_max, y_lo, y_hi), aspect="auto", interpolation="nearest", zorder=0)
    comm_boxes = len(comm.xs)
    ax.set_xlim(0, x_max)
    ax.set_ylim(y_lo, y_hi)
    every = max(1, -(-num_stages // 32))  # at most ~32 stage labels
    shown = range(0, num_stages, every)
    ax.set_yticks([num_stages - 1 - s for s in shown], [f"pp rank {s}" for s in shown])
    ax.set_xlabel(f"time ({unit})")
    for zax, (lo, hi), what in zip(zooms, windows, ("start of the step (warm-up)", "end of the step (cool-down)")):
        for group in groups:
            group.draw(zax, (lo * scale, hi * scale))
        for x, width, y, text in labels:
            if lo <= x <= hi and width >= (hi - lo) / 60:
                zax.text(x * scale, y, text, ha="center", va="center", fontsize=7, color="white")
        zax.set_xlim(lo * scale, hi * scale)
        zax.set_ylim(y_lo, y_hi)
        zax.set_title(f"zoom: {what}, boxes labelled by micro-batch", loc="left", fontsize=9)
        zax.set_xlabel(f"time ({unit})")
        zax.set_yticks([num_stages - 1 - s for s in shown], [f"pp rank {s}" for s in shown] if zax is zooms[0] else [])
        for side in ("top", "right"):
            zax.spines[side].set_visible(False)
        ax.axvspan(lo * scale, hi * scale, ymin=0, ymax=1, facecolor="none", edgecolor="black", linewidth=0.8,
                   linestyle=":", zorder=5)
    ax.set_title(title, loc="left", fontsize=10, pad=24)
    kinds = [k for k in EVENT_STYLE if any(e.kind == k for e in events)]
    handles = [Patch(facecolor=EVENT_STYLE[k][0], label=EVENT_STYLE[k][1]) for k in kinds]
    if virtual > 1:
        handles.append(Patch(facecolor=EVENT_STYLE["F"][0], alpha=0.6, label="lighter: later chunk"))
    if comm_boxes:
        handles.append(Patch(facecolor=COMM_COLOUR, label=f"p2p send ({fmt_seconds(p2p)})"))
    if any(t > 0 for t in tails):
        handles.append(Patch(facecolor=TAIL_COLOUR, label="grad sync + optimizer"))
    if bubbles.xs:
        handles.append(Patch(facecolor=BUBBLE_COLOUR, hatch="///" if one_by_one else None,
                             label="idle (bubble)"))
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=len(handles),
              frameon=False, fontsize=8, borderaxespad=0.2)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    paths = _save(fig, Path(stem))
    return TimelineDrawing(paths, sum(len(b.xs) for b in boxes.values()), len(bubbles.xs), comm_boxes)


def plot_memory(plan: Plan, stem: str | Path) -> tuple[Path, ...]:
    """Stacked bars of each pipeline rank's peak memory by part, against the device capacity."""
    from matplotlib.figure import Figure

    if plan.prediction is None:
        raise ValueError("plan has no prediction to plot; evaluate it first")
    stages = plan.prediction.stage_memory
    capacity = plan.cluster.device.memory_bytes / GiB
    fig = Figure(figsize=(max(6.0, 2.8 + 0.7 * len(stages)), 4.2))
    _margins(fig, left=0.8, right=1.4, top=0.4, bottom=0.6)
    ax = fig.add_subplot()
    xs = list(range(len(stages)))
    bottom = [0.0] * len(stages)
    for part in MEMORY_PARTS:
        values = [getattr(m, part) / GiB for m in stages]
        ax.bar(xs, values, bottom=bottom, color=MEMORY_COLOURS[part], label=part, width=0.65)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(capacity, color="black", linestyle="--", linewidth=1)
    ax.set_xlim(-0.6, len(stages) - 0.4)
    ax.text(-0.55, capacity, f"device {capacity:.0f} GiB", va="bottom", ha="left", fontsize=8)
    for x, total in zip(xs, bottom):
        ax.text(x, total, f"{total:.1f}", ha="center", va="bottom", fontsize=7,
                color="red" if total > capacity else "black")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("pipeline rank")
    ax.set_ylabel("peak memory per GPU (GiB)")
    ax.set_ylim(0, max(capacity, max(bottom)) * 1.15)
    ax.set_title(f"{plan.model.name} / {plan.name}: peak memory per GPU", loc="left", fontsize=10)
    handles, labels = ax.get_legend_handles_labels()  # top of the stack first, as drawn
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False,
              fontsize=8)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return _save(fig, Path(stem))


def timeline_title(plan: Plan, result: Any, tails: Sequence[float] = ()) -> str:
    p = plan.pipeline
    v = f", {p.virtual_stages} chunks/rank" if p.virtual_stages > 1 else ""
    step = result.step_time + max(tails, default=0.0)
    pipe = (f"{p.schedule.value}, {p.degree} stages{v}" if p.degree > 1 else "no pipeline")
    return (f"{plan.model.name} / {plan.name}: {pipe}, {plan.num_micro_batches} micro-batches - "
            f"step {fmt_seconds(step)}, pipeline bubble {result.bubble_fraction:.0%}")



def plot_plan(plan: Plan, out_dir: str | Path, stem: str = "plan") -> dict[str, tuple[Path, ...]]:
    """Both pictures of a plan into `out_dir`: `<stem>.timeline.{png,svg}`, `<stem>.memory.{png,svg}`.

    The timeline is the cost model's own simulation of the plan (`tessera.cost.evaluate`), with
    each rank's once-per-step tail (exposed gradient sync and optimizer update) after it."""
    from ..cost.evaluate import plan_context, simulate_plan
    from ..cost.layer import pipeline_p2p_time

    out = Path(out_dir)
    result, tails = simulate_plan(plan)
    hidden = max(layer.hidden for layer in plan.model.layers)
    p2p = pipeline_p2p_time(hidden, plan_context(plan)) if plan.pipeline.degree > 1 else 0.0
    drawing = plot_timeline(result.events, plan.pipeline.degree, out / f"{stem}.timeline",
                            title=timeline_title(plan, result, tails), p2p=p2p, tails=tails)
    return {"timeline": drawing.paths, "memory": plot_memory(plan, out / f"{stem}.memory")}
