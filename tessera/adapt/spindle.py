"""Spindle-style wave scheduling of a multi-task multimodal step (Spindle, ASPLOS'25).

Operator graph: each task contributes an operator per model part it runs (its vision encoder +
projector, then its LLM), the LLM operator depending on the encoder operator of the same task.
Operators of different tasks are independent; operators of the same part share parameters.

Waves: the step's forward runs waves W_1..W_K one after another; each wave runs a set of ready
operators side by side, operator o on its own group of g_o devices (sum g_o <= N); the backward
runs the waves in reverse order on the same groups (parameters stay where they are). The waves
form rounds: once the operators finished so far include every operator that depends on them, the
round's backward runs and its activations go (`round_ends`; the sum below is the same, the
memory is not: a round holds only its own operators' activations). So

    step = sum_k [ max_{o in W_k} f_o(g_o) + max_{o in W_k} b_o(g_o) ] + combine + tails

with f_o(g), b_o(g) the forward / backward seconds of operator o's best plan on g devices
(`search.multimodal.PartPricer`, the image embeddings' hand-off into the LLM group added to the
LLM's forward and the gradients' to the encoder's backward); `combine` the all-reduce of a
shared part's gradient shards across the groups that ran it (2 P / g bytes over k groups); tails
the once-per-step optimizer work, per part the largest over its groups.

`pack_waves` finds the order and the allocation minimising the sum exactly over its space:
a dynamic program over the set of finished operators (at most 2^n states), each transition a
non-empty set of ready operators; the best allocation of one wave is found by enumerating the
forward threshold t_f and backward threshold t_b over the operators' values: each operator then
takes its smallest group with f <= t_f and b <= t_b, feasible when the groups sum to <= N; the
cheapest feasible t_f + t_b is the wave's optimum (any allocation's maxima are such a pair, and the
smallest groups meeting them use no more devices). `tests/test_spindle_optimus.py` checks it
against enumerating every wave sequence and allocation.

Memory. Each operator's plan fits its group on its own, but a device holds more across the step:
the states of every part whose group includes it (one copy per group of a part, whatever the
waves and tasks that use the group; groups of the same part elsewhere hold their own), and, per
round, the activations of every operator of the round it ran, all micro-batches, from the
forward wave to the backward wave. `device_memory` adds this up per device (the groups of a wave
side by side from device 0); a schedule whose fullest device exceeds the memory budget is
refused. When the fastest schedule does not fit, each operator may also take its leanest plan
(full recompute, ZeRO-3) and the schedule is searched again:
    `_pack_waves_exact_memory`  A* over partial schedules (the unconstrained program's remaining
        time as the estimate; a partial schedule that overflows a device dropped, memory only
        grows), each wave's allocations its Pareto-optimal (time, largest per-device bytes) ones:
        the fastest schedule of that space that fits as `device_memory` counts;
    `_pack_waves_in_memory`     if the A* does not settle within its node limit: each wave charged
        the largest per-device bytes (states + activations) of its operators and the waves' sum
        kept within the budget less the largest buffer; every device's true sum is at most that
        (one operator per device per wave), so the schedule fits; the fastest under that bound (a
        forward dynamic program keeping the Pareto-optimal (time, memory) labels per set of
        finished operators). Brute force checks both.

The baseline it is compared with (`sequential_baseline`): the tasks one after another on all N
devices, each with its best separate plan (`plan_vlm_task`), the tails paid once (gradients of
the tasks accumulate into one optimizer step). No torch import.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..cost.comm import collective_times
from ..cost.evaluate import shared_layer_costs, usable_memory
from ..cost.memory import memory_budget, required_memory
from ..errors import TesseraError
from ..search.multimodal import LEAN_OPTIONS, PartCost, PartPricer, group_handoff_s, node_sizes, plan_vlm_task
from ..spec.tasks import MultiTaskWorkload
from .wave_packing import (_pack_waves_exact_memory, _pack_waves_in_memory, _wave_options,  # noqa: F401 (re-exported)
                           pack_waves)


@dataclass(frozen=True)
class Operator:
    name: str  # "<task>/<part>"
    task: str
    part: str
    after: tuple[int, ...] = ()  # indices of operators that must finish first


@dataclass(frozen=True)
class Placed:
    op: int
    gpus: int
    first_gpu: int
    fwd_s: float
    bwd_s: float
    variant: str = "fastest"  # the operator's plan: its fastest, or "lean" (full recompute, ZeRO-3) for memory


@dataclass(frozen=True)
class Wave:
    ops: tuple[Placed, ...]

    @property
    def fwd_s(self) -> float:
        return max(p.fwd_s for p in self.ops)

    @property
    def bwd_s(self) -> float:
        return max(p.bwd_s for p in self.ops)

    @property
    def time_s(self) -> float:
        return self.fwd_s + self.bwd_s


@dataclass(frozen=True)
class SpindlePlan:
    ops: tuple[Operator, ...]
    waves: tuple[Wave, ...]
    combine_s: float
    tail_s: float
    gpus: int
    searches: int = 0
    peak_bytes: float = 0.0  # the fullest device's memory (`device_memory`, fragmentation and reserve included)
    usable_bytes: float = 0.0  # what a device may use (memory less the planner's margin)
    memory_bound: bool = False  # the fastest schedule overflowed a device: packed under the memory bound
    round_ends: tuple[int, ...] = ()  # waves after which a round's backward runs (`round_ends`); () = one round

    @property
    def waves_s(self) -> float:
        return sum(w.time_s for w in self.waves)

    @property
    def step_s(self) -> float:
        return self.waves_s + self.combine_s + self.tail_s

    def timeline(self) -> list[tuple[str, str, int, int, float, float]]:
        """(operator, 'F'/'B', first device, devices, start, end) of every operator run: per round,
        its forward waves in order, then their backward in reverse (the simulator of the step)."""
        out, t, start = [], 0.0, 0
        ends = sorted(set(self.round_ends) | {len(self.waves) - 1})
        for end in ends:
            for w in self.waves[start:end + 1]:
                for p in w.ops:
                    out.append((self.ops[p.op].name, "F", p.first_gpu, p.gpus, t, t + p.fwd_s))
                t += w.fwd_s
            for w in reversed(self.waves[start:end + 1]):
                for p in w.ops:
                    out.append((self.ops[p.op].name, "B", p.first_gpu, p.gpus, t, t + p.bwd_s))
                t += w.bwd_s
            start = end + 1
        return out

    def describe(self) -> list[str]:
        lines = []
        for k, w in enumerate(self.waves):
            parts = ", ".join(f"{self.ops[p.op].name} on {p.gpus} GPUs"
                              + (f" {p.variant}" if p.variant != "fastest" else "")
                              + f" ({(p.fwd_s + p.bwd_s) * 1e3:.0f} ms)" for p in w.ops)
            lines.append(f"wave {k + 1}: {parts}; {w.time_s * 1e3:.0f} ms (fwd {w.fwd_s * 1e3:.0f} + bwd "
                         f"{w.bwd_s * 1e3:.0f})" + ("; round ends (backward of its waves, activations freed)"
                                                  if k in self.round_ends and k < len(self.waves) - 1 else ""))
        lines.append(f"gradient combine of shared parts {self.combine_s * 1e3:.1f} ms, tails {self.tail_s * 1e3:.1f} ms")
        if self.usable_bytes:
            lines.append(f"fullest device {self.peak_bytes / 2**30:.1f} of {self.usable_bytes / 2**30:.1f} GiB (every "
                         f"part's states it holds across waves + its fullest round's activations)"
                         + ("; the fastest schedule did not fit: the fastest that fits" if self.memory_bound
                            else ""))
        return lines


def operator_graph(workload: MultiTaskWorkload) -> list[Operator]:
    ops: list[Operator] = []
    for t in workload.tasks:
        after: tuple[int, ...] = ()
        if t.has_images:
            ops.append(Operator(f"{t.name}/vision_encoder", t.name, "vision_encoder"))
            after = (len(ops) - 1,)
        ops.append(Operator(f"{t.name}/llm", t.name, "llm", after))
    return ops


def plan_spindle(pricer: PartPricer, workload: MultiTaskWorkload, gpus: int) -> SpindlePlan:
    """Waves of the workload's operators on `gpus` devices (see the module docstring)."""
    with shared_layer_costs():
        return _plan_spindle(pricer, workload, gpus)


def _plan_spindle(pricer: PartPricer, workload: MultiTaskWorkload, gpus: int) -> SpindlePlan:
    vlm, cluster = pricer.vlm, pricer.cluster
    workload.check_model(vlm)
    ops = operator_graph(workload)
    tasks = {t.name: t for t in workload.tasks}
    sizes = node_sizes(gpus, cluster.gpus_per_node)
    columns = [(g, "fastest") for g in sizes]
    costs: dict[tuple[int, int, str], PartCost] = {}
    fwd, bwd = _columns(pricer, ops, tasks, columns, costs)
    cost, packed = pack_waves(ops, sizes, fwd, bwd, gpus)
    if not packed:
        raise TesseraError(f"no wave schedule of the {len(ops)} operators fits on {gpus} GPUs")
    waves = _place(packed_columns(packed, sizes), columns, fwd, bwd)
    budget = memory_budget(cluster)
    peak = fastest_peak = float(device_memory(ops, waves, costs, gpus).max())
    bounded = peak > budget
    if bounded:
        # The fastest schedule overflows a device: the fastest one whose waves' largest per-device
        # bytes add up to the budget (an upper bound of every device's, so it fits), each operator
        # on any group size with its fastest or its leanest plan.
        columns += [(g, "lean") for g in sizes]
        fwd, bwd = _columns(pricer, ops, tasks, columns, costs)
        mem = np.full_like(fwd, np.inf)
        for o in range(len(ops)):
            for i, (g, variant) in enumerate(columns):
                c = costs[o, g, variant]
                if c.feasible:
                    mem[o, i] = c.states_bytes + c.act_bytes
        col_sizes = [g for g, _ in columns]
        per = {f: np.zeros_like(fwd) for f in ("states_bytes", "act_bytes", "buf_bytes")}
        for o in range(len(ops)):
            for i, (g, variant) in enumerate(columns):
                c = costs[o, g, variant]
                for f, a in per.items():
                    a[o, i] = getattr(c, f) if c.feasible else 0.0
        found = _pack_waves_exact_memory(ops, col_sizes, fwd, bwd, per["states_bytes"], per["act_bytes"],
                                         per["buf_bytes"], gpus, budget)
        if found is not None:
            cost, packed = found
        else:  # the exact search did not settle: the bound (every device within it)
            buf = max(c.buf_bytes for c in costs.values() if c.feasible)
            cost, packed = _pack_waves_in_memory(ops, col_sizes, fwd, bwd, mem, gpus, budget - buf)
        if not packed:
            raise TesseraError(f"no wave schedule of the {len(ops)} operators fits in device memory on {gpus} GPUs: "
                               f"the fastest needs {required_memory(fastest_peak, cluster) / 2**30:.2f} GiB on a "
                               f"device of {usable_memory(cluster) / 2**30:.2f} GiB usable, and no schedule fits, "
                               f"even with every operator's leanest plan")
        waves = _place(packed, columns, fwd, bwd)
        peak = float(device_memory(ops, waves, costs, gpus).max())
    combine, tails = 0.0, 0.0
    for part in ("vision_encoder", "llm"):
        runs = [(p.op, p.gpus, p.variant) for w in waves for p in w.ops if ops[p.op].part == part]
        if not runs:
            continue
        tails += max(costs[run].tail_s for run in runs)
        if len(runs) > 1:
            g_min = min(g for _, g, _ in runs)
            shard = 2.0 * pricer.model(part).num_params / g_min
            combine += float(collective_times(cluster, "all_reduce", shard, len(runs), g_min))
    return SpindlePlan(tuple(ops), tuple(waves), combine, tails, gpus, pricer.searches,
                       peak_bytes=required_memory(peak, cluster), usable_bytes=usable_memory(cluster),
                       memory_bound=bounded, round_ends=round_ends(ops, waves))


def _columns(pricer: PartPricer, ops, tasks, columns, costs) -> tuple[np.ndarray, np.ndarray]:
    """fwd[o, i], bwd[o, i]: operator o's seconds with column i's (group size, plan), the image
    embeddings' hand-off added (module docstring); `costs[(o, size, plan)]` filled in."""
    vlm, cluster = pricer.vlm, pricer.cluster
    fwd = np.full((len(ops), len(columns)), np.inf)
    bwd = np.full_like(fwd, np.inf)
    for o, op in enumerate(ops):
        t = tasks[op.task]
        for i, (g, variant) in enumerate(columns):
            if (o, g, variant) not in costs:
                options = LEAN_OPTIONS if variant == "lean" else None
                costs[o, g, variant] = (pricer.encoder(t, g, options) if op.part == "vision_encoder"
                                        else pricer.llm(t, g, options))
            c = costs[o, g, variant]
            if not c.feasible:
                continue
            hop = group_handoff_s(cluster, vlm, t.images(), g) if t.has_images else 0.0
            fwd[o, i] = c.fwd_s + (hop if op.part == "llm" else 0.0)
            bwd[o, i] = c.bwd_s + (hop if op.part == "vision_encoder" else 0.0)
    return fwd, bwd


def packed_columns(packed, sizes: list[int]):
    """`pack_waves`' (operators, group sizes) waves as (operators, columns) of unique sizes."""
    return [(members, tuple(sizes.index(g) for g in groups)) for members, groups in packed]


def _place(packed, columns: list[tuple[int, str]], fwd: np.ndarray, bwd: np.ndarray) -> list[Wave]:
    """Each wave's groups side by side from device 0, in the order of its operators; `packed`:
    (operators, columns) per wave."""
    waves = []
    for members, chosen in packed:
        first, placed = 0, []
        for o, i in zip(members, chosen):
            g, variant = columns[i]
            placed.append(Placed(o, g, first, float(fwd[o, i]), float(bwd[o, i]), variant))
            first += g
        waves.append(Wave(tuple(placed)))
    return waves


def round_ends(ops, waves) -> tuple[int, ...]:
    """Indices of the waves after which a round ends: the operators finished so far include every
    operator that depends on one of them, so their backward waves can run now (in reverse) and
    their activations go. The time is the same (each wave's forward and backward are run once
    either way); only the memory falls. The last wave always ends one."""
    dependents = [[o for o, op in enumerate(ops) if a in op.after] for a in range(len(ops))]
    done: set[int] = set()
    ends = []
    for k, w in enumerate(waves):
        done.update(p.op for p in w.ops)
        if all(d in done for o in done for d in dependents[o]):
            ends.append(k)
    return tuple(ends)


def device_memory(ops: list[Operator] | tuple[Operator, ...], waves, costs: dict, gpus: int,
                  ends: tuple[int, ...] | None = None) -> np.ndarray:
    """Each device's peak bytes allocated over the step, before fragmentation and the framework's
    reserve:
        sum over the groups (part, first device, size) that hold device d of the largest model
            states of that part's operators on that group (a group keeps one copy of its part,
            across waves and tasks, for the whole step; another group of the same part holds its own)
        + the largest over rounds (`round_ends`; default: as early as the dependencies allow) of
            the activations of the round's operators on d, all micro-batches (alive from an
            operator's forward wave until its backward wave, the backward running in reverse)
        + the largest buffer of the operators on d.
    `costs[(op, group size, plan variant)]`: the operator's PartCost."""
    ends = round_ends(ops, waves) if ends is None else ends
    states: dict[tuple, float] = {}
    act, peak_act, buf = np.zeros(gpus), np.zeros(gpus), np.zeros(gpus)
    for k, w in enumerate(waves):
        for p in w.ops:
            c = costs[p.op, p.gpus, p.variant]
            key = (ops[p.op].part, p.first_gpu, p.gpus)
            states[key] = max(states.get(key, 0.0), c.states_bytes)
            where = slice(p.first_gpu, p.first_gpu + p.gpus)
            act[where] += c.act_bytes
            buf[where] = np.maximum(buf[where], c.buf_bytes)
        if k in ends or k == len(waves) - 1:
            np.maximum(peak_act, act, out=peak_act)
            act[:] = 0.0
    held = np.zeros(gpus)
    for (_, first, size), b in states.items():
        held[first:first + size] += b
    return held + peak_act + buf


@dataclass(frozen=True)
class SequentialBaseline:
    plans: tuple
    busy_s: float
    tail_s: float

    @property
    def step_s(self) -> float:
        return self.busy_s + self.tail_s


def sequential_baseline(pricer: PartPricer, workload: MultiTaskWorkload, gpus: int) -> SequentialBaseline:
    """The tasks one after another on all devices, each with its best plan; one optimizer step."""
    workload.check_model(pricer.vlm)
    plans = tuple(plan_vlm_task(pricer, t, gpus) for t in workload.tasks)
    return SequentialBaseline(plans, sum(p.busy_s for p in plans), max(p.tail_s for p in plans))
