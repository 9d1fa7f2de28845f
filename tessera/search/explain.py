"""The planner's explanation of its choice (plain lines; the CLI formats them)."""
from __future__ import annotations

import numpy as np

from ..plan import Plan

GiB = 2**30
BUBBLE_WARNING_FRACTION = 0.5  # warn when the pipeline bubble is more than this share of the step


def bubble_warning(plan: Plan) -> str | None:
    """A warning line when the plan's predicted pipeline bubble exceeds half of its step, else None."""
    p = plan.prediction
    if p is None or p.step_time_s <= 0 or p.bubble_s <= BUBBLE_WARNING_FRACTION * p.step_time_s:
        return None
    pipe = plan.pipeline
    return (f"warning: the pipeline bubble is {p.bubble_s / p.step_time_s:.0%} of the step ({p.bubble_s:.3g} of "
            f"{p.step_time_s:.3g} s: {pipe.degree} stages, {plan.num_micro_batches} micro-batches); more "
            f"micro-batches (a larger global batch), fewer stages, or context parallelism for long "
            f"sequences would cut it")


def structure(plan: Plan) -> str:
    blocks = [s for s, layer in zip(plan.layers, plan.model.layers) if layer.num_heads]
    common = max(set(blocks), key=blocks.count) if blocks else plan.layers[0]
    sched = plan.pipeline.schedule.value + (f" v={plan.pipeline.virtual_stages}" if plan.pipeline.virtual_stages > 1 else "")
    return (f"pp={plan.pipeline.degree} {sched}, {plan.num_micro_batches}x{plan.micro_batch_size} micro-batches, "
            f"blocks {common.describe()}")


def explain(best: Plan, scored: list[tuple[float, Plan]], stats: dict, unconstrained: tuple[int, float],
            notes: list[str] = ()) -> list[str]:
    """Lines saying why `best` (scored[0]) won: its figures, what was searched, the runner-up with
    another structure and by how much (or the bound every other choice has), and which constraint
    binds: memory when the fastest strategy of every layer (`unconstrained`: rank, bytes) would not
    fit, else the largest share of the step; then `notes` (what the space left out, and why)."""
    p = best.prediction
    lines = [
        f"chosen: {structure(best)}; "
        f"predicted {p.step_time_s:.3f} s/step, {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%}",
        f"why: fastest of {stats['plans']} plans scored by the simulator, from {stats['contexts']} "
        f"(pp, schedule, micro-batching) contexts ({stats['skipped']} contexts or splits skipped by their "
        f"lower bounds), "
        f"{stats['candidates']} layer strategies ({stats['pruned']} dominated), {stats['states']} DP states",
        f"step breakdown: compute {p.compute_s:.3f} s, exposed communication {p.exposed_comm_s:.3f} s, "
        f"pipeline bubble {p.bubble_s:.3f} s",
    ]
    mixed = {s.describe() for s, layer in zip(best.layers, best.model.layers) if layer.num_heads}
    if len(mixed) > 1:
        lines.append(f"layer-wise: blocks use {len(mixed)} strategies: {'; '.join(sorted(mixed))}")
    mine = structure(best)
    other = next(((t, p) for t, p in scored[1:] if structure(p) != mine), None)
    if other is not None:
        lines.append(f"runner-up: {structure(other[1])} at {other[0]:.3f} s/step "
                     f"(+{(other[0] / scored[0][0] - 1):.1%})")
    elif "next_bound" in stats:
        nb = stats["next_bound"]
        lines.append(f"runner-up: no other structure came close; every remaining choice is bounded at "
                     f">= {nb:.3f} s/step (+{(nb / scored[0][0] - 1):.1%})")
    if "lower_bound" in stats:
        lb = stats["lower_bound"]
        within = scored[0][0] / lb - 1 if lb > 0 else float("inf")
        lines.append("optimality: proved optimal in the search space" if within <= 1e-9 else
                     f"optimality: within {within:.2%} of the best plan of the search space, proved: no plan "
                     f"of it is faster than {lb:.4g} s/step")
    peak = p.peak_memory
    rank = int(np.argmax([m.total for m in p.stage_memory]))
    dev = best.cluster.device.memory_bytes
    if unconstrained[1] > dev:
        lines.append(f"binding constraint: memory: the fastest strategy of every layer would need "
                     f"{unconstrained[1] / GiB:.1f} GiB on pipeline rank {unconstrained[0]}; the plan uses "
                     f"{peak / GiB:.1f} of {dev / GiB:.1f} GiB (rank {rank})")
    else:
        share = max((p.compute_s, "compute"), (p.exposed_comm_s, "communication"), (p.bubble_s, "the pipeline bubble"))
        lines.append(f"binding constraint: none on memory ({peak / GiB:.1f} of {dev / GiB:.1f} GiB); "
                     f"the step is dominated by {share[1]}")
    warning = bubble_warning(best)
    return lines + ([warning] if warning else []) + list(notes)
