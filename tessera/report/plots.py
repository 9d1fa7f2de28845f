"""A plan as pictures: the pipeline schedule timeline and the memory of each pipeline rank.

`plot_timeline` draws the events of the schedule simulator (`tessera.cost.schedule.simulate`):
one row per pipeline rank, one box per forward (F), backward (B, or input-gradient under
zero-bubble) and weight-gradient (W) event, thin bars for the point-to-point sends between
stages, and grey boxes for the idle time (the bubble). Every event box carries an SVG id
(`event-F-s0-m3-c0`), so the picture can be checked against the simulation it came from.

`plot_memory` stacks parameters, gradients, optimizer state, activations and buffers per
pipeline rank against the device capacity.

matplotlib is imported inside the functions, so planning never pays for it.
"""
from __future__ import annotations

from dataclasses import dataclass
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
BUBBLE_COLOUR = "#d9d9d9"
MEMORY_COLOURS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868",
                  "activations": "#c44e52", "buffers": "#937860"}
FORMATS = ("png", "svg")


@dataclass(frozen=True)
class TimelineDrawing:
    """What `plot_timeline` drew: the files and how many boxes of each sort."""

    paths: tuple[Path, ...]
    event_boxes: int
    bubble_boxes: int
    comm_boxes: int


def _save(fig: Any, stem: Path) -> tuple[Path, ...]:
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in FORMATS:
        path = stem.with_name(f"{stem.name}.{fmt}")
        tmp = path.with_name(path.name + ".tmp")
        fig.savefig(tmp, format=fmt, dpi=150, bbox_inches="tight")
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


def plot_timeline(events: Sequence[Any], num_stages: int, stem: str | Path, *, title: str = "",
                  p2p: float = 0.0, step_time: float | None = None) -> TimelineDrawing:
    """Draw schedule events (stage, kind, micro_batch, chunk, start, end) to `stem`.png and .svg."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    end = step_time if step_time is not None else max((e.end for e in events), default=0.0)
    scale, unit = (1e3, "ms") if end < 10 else (1.0, "s")
    max_chunk = {s: max((e.chunk for e in events if e.stage == s), default=0) for s in range(num_stages)}
    fig = Figure(figsize=(12, 1.2 + 0.55 * num_stages))
    ax = fig.add_subplot()
    height = 0.8
    min_label_width = end / 60  # label a box with its micro-batch only where the number fits

    def row(stage: int) -> float:
        return num_stages - 1 - stage - height / 2  # stage 0 on top

    event_boxes = 0
    for e in events:
        colour, _ = EVENT_STYLE[e.kind]
        # Later model chunks (interleaved schedules) drawn lighter to tell them apart.
        alpha = 1.0 - 0.35 * (e.chunk / max(1, max_chunk[e.stage]))
        ax.add_patch(Rectangle((e.start * scale, row(e.stage)), (e.end - e.start) * scale, height,
                               facecolor=colour, edgecolor="white", linewidth=0.5, alpha=alpha,
                               gid=f"event-{e.kind}-s{e.stage}-m{e.micro_batch}-c{e.chunk}"))
        event_boxes += 1
        if e.end - e.start >= min_label_width:
            ax.text((e.start + e.end) / 2 * scale, row(e.stage) + height / 2, str(e.micro_batch),
                    ha="center", va="center", fontsize=7, color="white")
    comm_boxes = 0
    if p2p > 0:
        last_stage = num_stages - 1
        for e in events:
            # A forward sends to the next stage, a backward to the previous one, except at the ends.
            sends = ((e.kind == "F" and not (e.stage == last_stage and e.chunk == max_chunk[e.stage]))
                     or (e.kind == "B" and not (e.stage == 0 and e.chunk == 0)))
            if sends and num_stages > 1:
                ax.add_patch(Rectangle((e.end * scale, row(e.stage)), p2p * scale, height * 0.2,
                                       facecolor=COMM_COLOUR, edgecolor="none",
                                       gid=f"comm-{e.kind}-s{e.stage}-m{e.micro_batch}-c{e.chunk}"))
                comm_boxes += 1
    gaps = idle_intervals(events, num_stages, end)
    for i, (stage, start, stop) in enumerate(gaps):
        ax.add_patch(Rectangle((start * scale, row(stage)), (stop - start) * scale, height,
                               facecolor=BUBBLE_COLOUR, edgecolor="none", hatch="///",
                               gid=f"bubble-{i}", zorder=0))
    ax.set_xlim(0, end * scale * 1.01 if end else 1)
    ax.set_ylim(-0.6, num_stages - 0.4)
    ax.set_yticks([num_stages - 1 - s for s in range(num_stages)],
                  [f"stage {s}" for s in range(num_stages)])
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title, loc="left", fontsize=10, pad=24)
    kinds = [k for k in EVENT_STYLE if any(e.kind == k for e in events)]
    handles = [Patch(facecolor=EVENT_STYLE[k][0], label=EVENT_STYLE[k][1]) for k in kinds]
    if comm_boxes:
        handles.append(Patch(facecolor=COMM_COLOUR, label=f"p2p send ({fmt_seconds(p2p)})"))
    handles.append(Patch(facecolor=BUBBLE_COLOUR, hatch="///", label="idle (bubble)"))
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=len(handles),
              frameon=False, fontsize=8, borderaxespad=0.2)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    paths = _save(fig, Path(stem))
    return TimelineDrawing(paths, event_boxes, len(gaps), comm_boxes)


def plot_memory(plan: Plan, stem: str | Path) -> tuple[Path, ...]:
    """Stacked bars of each pipeline rank's peak memory by part, against the device capacity."""
    from matplotlib.figure import Figure

    if plan.prediction is None:
        raise ValueError("plan has no prediction to plot; evaluate it first")
    stages = plan.prediction.stage_memory
    capacity = plan.cluster.device.memory_bytes / GiB
    fig = Figure(figsize=(max(5.0, 1.2 + 0.7 * len(stages)), 4.2))
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
    ax.set_title(f"{plan.name}: memory per GPU", loc="left", fontsize=10)
    handles, labels = ax.get_legend_handles_labels()  # top of the stack first, as drawn
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False,
              fontsize=8)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return _save(fig, Path(stem))


def timeline_title(plan: Plan, result: Any) -> str:
    p = plan.pipeline
    v = f", {p.virtual_stages} chunks/rank" if p.virtual_stages > 1 else ""
    return (f"{plan.name}: {p.schedule.value}, {p.degree} stages{v}, {plan.num_micro_batches} micro-batches"
            f" - step {fmt_seconds(result.step_time)}, bubble {result.bubble_fraction:.0%}")


def chunk_times(plan: Plan) -> tuple[list[float], list[float], float]:
    """(forward seconds per model chunk, backward seconds per chunk, p2p seconds) of one micro-batch.

    Compute only, from the FLOPs model (`tessera.cost.compute`): each layer's micro-batch work is
    `micro_batch_size * dp_of_batch / dp` sequences on this rank, split `tp * sp_degree` ways. The
    p2p time is the block output of one micro-batch (2 bytes x tokens x hidden, sharded by TP)
    sent to the next stage, across nodes when a stage spans whole nodes."""
    from ..cost.compute import layer_compute_time
    from ..cost.comm import p2p_time

    w = plan.workload
    fwd, bwd = [], []
    for start, end in plan.pipeline.stages:
        f = b = 0.0
        for i in range(start, end):
            layer, s = plan.model.layers[i], plan.layers[i]
            tokens = plan.micro_batch_size * (plan.dp_of_batch // s.dp) * w.seq_len
            lf, lb = layer_compute_time(layer, w.seq_len, tokens, s.tp * s.sp_degree, plan.cluster,
                                        w.dtype, s.recompute.value)
            f, b = f + lf, b + lb
        fwd.append(f)
        bwd.append(b)
    last = plan.layers[plan.pipeline.stages[0][1] - 1]
    hidden = plan.model.layers[0].hidden
    nbytes = 2.0 * plan.micro_batch_size * (plan.dp_of_batch // last.dp) * w.seq_len * hidden / last.tp
    inter = plan.stage_size >= plan.cluster.gpus_per_node
    p2p = p2p_time(plan.cluster, nbytes, inter) if plan.pipeline.degree > 1 else 0.0
    return fwd, bwd, p2p


def simulate_plan(plan: Plan) -> Any:
    """The schedule simulator's run of this plan's pipeline (events, step time, bubble)."""
    from ..cost.schedule import simulate

    fwd, bwd, p2p = chunk_times(plan)
    p = plan.pipeline
    return simulate(p.schedule.value, fwd, bwd, plan.num_micro_batches, p.degree,
                    virtual_stages=p.virtual_stages, p2p=p2p)


def plot_plan(plan: Plan, out_dir: str | Path, stem: str = "plan") -> dict[str, tuple[Path, ...]]:
    """Both pictures of a plan into `out_dir`: `<stem>.timeline.{png,svg}`, `<stem>.memory.{png,svg}`."""
    out = Path(out_dir)
    result = simulate_plan(plan)
    drawing = plot_timeline(result.events, plan.pipeline.degree, out / f"{stem}.timeline",
                            title=timeline_title(plan, result), p2p=_p2p_of(plan),
                            step_time=result.step_time)
    return {"timeline": drawing.paths, "memory": plot_memory(plan, out / f"{stem}.memory")}


def _p2p_of(plan: Plan) -> float:
    return chunk_times(plan)[2]
