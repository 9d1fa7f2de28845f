"""A plan as rich tables: header, stages and layer strategies, prediction, memory, comparison.

Each function takes a `Plan` (already evaluated: `plan.prediction` set) and returns a rich
renderable; `render_plan` prints them all. `layer_groups` is the plain-data part, tested alone:
consecutive layers of one pipeline chunk with the same strategy form one group, so a 32-block
model reads "layers 1-32: dp8 tp8+sp zero1 rc:selective" instead of 32 rows.
"""
from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console, Group
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from ..plan import LayerStrategy, MemoryBreakdown, Plan
from ..spec.model import LayerKind

GiB = 2**30
MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "buffers", "fragmentation")


# --- numbers for people -------------------------------------------------------------------------
def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def fmt_seconds(s: float) -> str:
    if s >= 1.0:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


def fmt_count(n: float) -> str:
    """6.74B, 131M, 12.3k: three significant figures with an SI-style suffix."""
    for factor, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= factor:
            return f"{n / factor:.3g}{suffix}"
    return f"{n:.3g}"


# --- layer groups -------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerGroup:
    """Layers `first..last` (inclusive, model indices) of pipeline chunk `chunk`, one strategy."""

    chunk: int
    first: int
    last: int
    strategy: LayerStrategy

    @property
    def count(self) -> int:
        return self.last - self.first + 1


def layer_groups(plan: Plan) -> list[LayerGroup]:
    groups: list[LayerGroup] = []
    for chunk, (start, end) in enumerate(plan.pipeline.stages):
        for i in range(start, end):
            s = plan.layers[i]
            if groups and groups[-1].chunk == chunk and groups[-1].strategy == s:
                groups[-1] = LayerGroup(chunk, groups[-1].first, i, s)
            else:
                groups.append(LayerGroup(chunk, i, i, s))
    return groups


def layer_kinds(plan: Plan, first: int, last: int) -> str:
    """'1 embedding, 16 decoder': how many layers of each kind in model layers first..last."""
    kinds: dict[str, int] = {}
    for layer in plan.model.layers[first:last + 1]:
        kinds[layer.kind.value] = kinds.get(layer.kind.value, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in kinds.items())


def describe_layers(plan: Plan, first: int, last: int) -> str:
    """'layers 1-32 (32 decoder)', 'layer 0 (embedding)': model indices and what kind of layers."""
    if first == last:
        return f"layer {first} ({plan.model.layers[first].kind.value})"
    return f"layers {first}-{last} ({layer_kinds(plan, first, last)})"


def describe_group(plan: Plan, group: LayerGroup) -> str:
    return f"{describe_layers(plan, group.first, group.last)}: {group.strategy.describe()}"


# --- tables -------------------------------------------------------------------------------------
def header_table(plan: Plan) -> Table:
    m, c, w = plan.model, plan.cluster, plan.workload
    blocks = m.num_blocks
    moe = sum(1 for layer in m.layers if layer.kind == LayerKind.MOE_DECODER)
    model_text = f"{m.name}: {fmt_count(m.num_params)} parameters, {blocks} blocks"
    if moe:
        model_text += f" ({moe} MoE)"
    auto_name = f"{c.num_nodes}x{c.gpus_per_node} {c.device.name}"  # what make_cluster calls it
    cluster_text = (("" if c.name == auto_name else f"{c.name}: ")
                    + f"{c.num_nodes} node{'s' if c.num_nodes > 1 else ''} x {c.gpus_per_node} "
                    f"{c.device.name} = {c.num_gpus} GPUs, {fmt_bytes(c.device.memory_bytes)} each")
    workload_text = (f"global batch {w.global_batch} x {w.seq_len} tokens = "
                     f"{fmt_count(w.tokens_per_step)} tokens/step, {w.dtype}, {w.optimizer}")
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("plan", f"{plan.name}")
    grid.add_row("model", model_text)
    grid.add_row("cluster", cluster_text)
    grid.add_row("workload", workload_text)
    grid.add_row("batching", f"{plan.num_micro_batches} micro-batches of {plan.micro_batch_size} "
                             f"sequence{'s' if plan.micro_batch_size > 1 else ''} per replica, "
                             f"{plan.dp_of_batch} replica{'s' if plan.dp_of_batch > 1 else ''}")
    return grid


def stages_table(plan: Plan) -> Table:
    p = plan.pipeline
    title = (f"pipeline: {p.degree} stages, schedule {p.schedule.value}" if p.degree > 1
             else "pipeline: 1 stage (no pipeline parallelism)")
    if p.virtual_stages > 1:
        title += f", {p.virtual_stages} virtual stages per rank"
    table = Table(title=title, title_justify="left")
    table.add_column("stage", justify="right")
    table.add_column("pp rank", justify="right")
    table.add_column("layers")
    table.add_column("strategy")
    for chunks, groups in stage_runs(plan):
        first, last = chunks[0], chunks[-1]
        ranks = [p.rank_of_chunk(c) for c in chunks]
        for i, g in enumerate(groups):
            if len(chunks) == 1:
                layers = describe_layers(plan, g.first, g.last)
            else:  # the same layers in every stage of the run: say what each stage holds
                start = groups[0].first
                per_stage = layer_kinds(plan, g.first, g.last)
                span = plan.pipeline.stages[last][1] - 1
                layers = (f"layers {start}-{span} ({per_stage} per stage)" if len(groups) == 1
                          else f"{per_stage} per stage")
            table.add_row(_span(first, last) if i == 0 else "",
                          _ranks(ranks) if i == 0 else "", layers, g.strategy.describe())
    return table


def _span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


def _ranks(ranks: list[int]) -> str:
    """'1-7,0-6': runs of consecutive ranks (interleaved chunks wrap around the ranks)."""
    runs = [[ranks[0], ranks[0]]]
    for r in ranks[1:]:
        if r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(_span(a, b) for a, b in runs)


def stage_runs(plan: Plan) -> list[tuple[list[int], list[LayerGroup]]]:
    """Consecutive pipeline chunks that look alike (same layer kinds and counts, same strategies),
    joined so that a 128-stage pipeline of identical blocks is one row: (chunks, first chunk's groups)."""
    by_chunk: dict[int, list[LayerGroup]] = {}
    for g in layer_groups(plan):
        by_chunk.setdefault(g.chunk, []).append(g)

    def signature(groups: list[LayerGroup]) -> tuple:
        return tuple((tuple(layer.kind for layer in plan.model.layers[g.first:g.last + 1]), g.strategy)
                     for g in groups)

    runs: list[tuple[list[int], list[LayerGroup]]] = []
    for chunk in sorted(by_chunk):
        groups = by_chunk[chunk]
        if runs and signature(runs[-1][1]) == signature(groups):
            runs[-1][0].append(chunk)
        else:
            runs.append(([chunk], groups))
    return runs


def prediction_table(plan: Plan) -> Table:
    pred = plan.prediction
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    if pred is None:
        table.add_row("prediction", "none (plan not evaluated)")
        return table
    table.add_row("step time", fmt_seconds(pred.step_time_s))
    table.add_row("throughput", f"{fmt_count(pred.tokens_per_s)} tokens/s "
                                f"({fmt_count(pred.tokens_per_s / plan.world_size)} per GPU)")
    table.add_row("MFU", f"{pred.mfu:.1%}")
    parts = [(name, t) for name, t in (("compute", pred.compute_s), ("exposed comm", pred.exposed_comm_s),
                                       ("bubble", pred.bubble_s)) if t > 0]
    if parts:
        table.add_row("step breakdown", ", ".join(f"{name} {fmt_seconds(t)}" for name, t in parts))
    return table


def plan_fits(plan: Plan) -> bool | None:
    """Whether the predicted peak fits the device (None: not evaluated)."""
    pred = plan.prediction
    if pred is None:
        return None
    return pred.fits


def memory_table(plan: Plan) -> Table:
    capacity = plan.cluster.device.memory_bytes
    table = Table(title=f"peak memory per GPU (device: {fmt_bytes(capacity)})", title_justify="left")
    table.add_column("pp rank", justify="right")
    for part in MEMORY_PARTS:
        table.add_column(part, justify="right")
    table.add_column("total", justify="right", style="bold")
    table.add_column("of device", justify="right")
    if plan.prediction is None:
        return table
    # Ranks whose rows read the same are one row ("1-126"): deep pipelines stay short.
    rows: list[tuple[int, int, tuple[str, ...], float]] = []
    for rank, mem in enumerate(plan.prediction.stage_memory):
        cells = (*(fmt_bytes(getattr(mem, part)) for part in MEMORY_PARTS), fmt_bytes(mem.total))
        if rows and rows[-1][2] == cells:
            rows[-1] = (rows[-1][0], rank, cells, max(rows[-1][3], mem.total))
        else:
            rows.append((rank, rank, cells, mem.total))
    for first, last, cells, total in rows:
        share = total / capacity
        style = "red" if share > 1 else ("yellow" if share > 0.9 else "green")
        table.add_row(_span(first, last), *cells, Text(f"{share:.0%}", style=style))
    return table


def explanation(plan: Plan) -> Group | None:
    info = plan.search
    # Padding indents the wrapped part of a long line too.
    lines = [Padding(Text(line, style="bold yellow" if line.startswith("warning:") else ""), (0, 0, 0, 2))
             for line in info.explanation]
    if info.search_time_s or info.candidates:
        lines.append(Padding(Text(f"searched {info.candidates:,} candidates in {info.search_time_s:.2f} s",
                                  style="dim"), (0, 0, 0, 2)))
    if not lines:
        return None
    return Group(Text("why this plan", style="bold"), *lines)


def strategy_summary(plan: Plan) -> str:
    """One line for a comparison row: 'pp4 1f1b | dp8 tp2 zero1' (the blocks' most common strategy,
    with how many other strategies blocks use; embedding and head are left out)."""
    counts: dict[str, int] = {}
    edges = (LayerKind.EMBEDDING, LayerKind.LM_HEAD)
    for layer, s in zip(plan.model.layers, plan.layers):
        if layer.kind not in edges or len(plan.layers) <= 2:
            key = s.describe()
            counts[key] = counts.get(key, 0) + 1
    main = max(counts, key=counts.get)
    pp = plan.pipeline
    head = f"pp{pp.degree} {pp.schedule.value}" + (f" v{pp.virtual_stages}" if pp.virtual_stages > 1 else "")
    more = f" (+{len(counts) - 1} more)" if len(counts) > 1 else ""
    return f"{head} | {main}{more}" if pp.degree > 1 else f"{main}{more}"


def comparison_table(reference: Plan, others: list[Plan]) -> Table:
    """The plan beside other plans (baselines), all predicted by the same cost model.

    speedup = other step time / reference step time: how much faster the reference is."""
    table = Table(title="compared with baselines (same cost model)", title_justify="left")
    for name, justify in (("plan", "left"), ("strategy", "left"), ("step time", "right"),
                          ("tokens/s", "right"), ("MFU", "right"), ("peak mem", "right"),
                          ("fits", "center"), (f"{reference.name.capitalize()} speedup", "right")):
        table.add_column(name, justify=justify)
    ref_time = reference.prediction.step_time_s if reference.prediction else None
    for i, plan in enumerate([reference, *others]):
        pred = plan.prediction
        if pred is None:
            table.add_row(plan.name, strategy_summary(plan), *["-"] * 6)
            continue
        fits = plan_fits(plan)
        speedup = f"{pred.step_time_s / ref_time:.2f}x" if ref_time else "-"
        table.add_row(plan.name, strategy_summary(plan), fmt_seconds(pred.step_time_s),
                      fmt_count(pred.tokens_per_s), f"{pred.mfu:.1%}", fmt_bytes(pred.peak_memory),
                      Text("yes", style="green") if fits else Text("no", style="red"), speedup,
                      style="bold" if i == 0 else None)
    return table


def make_console(stderr: bool = False) -> Console:
    """A console for reports: 120 columns when the output is not a terminal (files, pipes, tests)
    unless COLUMNS says otherwise, so that tables are not squeezed to rich's default of 80."""
    import os

    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = 120
    return console


def render_plan(plan: Plan, console: Console) -> None:
    console.print(header_table(plan))
    console.print()
    console.print(stages_table(plan))
    console.print(prediction_table(plan))
    console.print()
    console.print(memory_table(plan))
    fits = plan_fits(plan)
    if fits is False:
        mem = plan.prediction.peak_memory
        console.print(Text(f"does not fit: needs {fmt_bytes(mem)} per GPU, the device has "
                           f"{fmt_bytes(plan.cluster.device.memory_bytes)}", style="bold red"))
    why = explanation(plan)
    if why is not None:
        console.print()
        console.print(why)


def memory_parts(mem: MemoryBreakdown) -> dict[str, float]:
    return {part: float(getattr(mem, part)) for part in MEMORY_PARTS}
