"""Spindle-style wave scheduling of a multi-task multimodal step (Spindle, ASPLOS'25).

Operator graph: each task contributes an operator per model part it runs (its vision encoder +
projector, then its LLM), the LLM operator depending on the encoder operator of the same task.
Operators of different tasks are independent; operators of the same part share parameters.

Waves: the step's forward runs waves W_1..W_K one after another; each wave runs a set of ready
operators side by side, operator o on its own group of g_o devices (sum g_o <= N); the backward
runs the waves in reverse order on the same groups (parameters stay where they are). So

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
smallest groups meeting them use no more devices). `tests/test_spindle.py` checks it against
enumerating every wave sequence and allocation.

The baseline it is compared with (`sequential_baseline`): the tasks one after another on all N
devices, each with its best separate plan (`plan_vlm_task`), the tails paid once (gradients of
the tasks accumulate into one optimizer step). No torch import.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

import numpy as np

from ..cost.comm import collective_times
from ..errors import TesseraError
from ..search.multimodal import INF, PartPricer, group_handoff_s, node_sizes, plan_vlm_task
from ..spec.tasks import MultiTaskWorkload


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


def _wave_allocation(members: tuple[int, ...], sizes: np.ndarray, f: np.ndarray, b: np.ndarray, total: int):
    """(cost, groups) of the best allocation of one wave (see the module docstring) or (inf, None)."""
    tf = np.unique(f[list(members)])
    tb = np.unique(b[list(members)])
    tf, tb = tf[np.isfinite(tf)], tb[np.isfinite(tb)]
    if not len(tf) or not len(tb):
        return INF, None
    need = np.zeros((len(tf), len(tb)))
    pick = []
    for o in members:
        ok = (f[o][None, None, :] <= tf[:, None, None]) & (b[o][None, None, :] <= tb[None, :, None])
        g = np.where(ok, sizes[None, None, :], np.inf).min(axis=-1)
        need += g
        pick.append(g)
    cost = np.where(need <= total, tf[:, None] + tb[None, :], np.inf)
    i, j = np.unravel_index(int(np.argmin(cost)), cost.shape)
    if not np.isfinite(cost[i, j]):
        return INF, None
    return float(cost[i, j]), tuple(int(g[i, j]) for g in pick)


def pack_waves(ops: list[Operator], sizes: list[int], fwd: np.ndarray, bwd: np.ndarray,
               total: int) -> tuple[float, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """The wave sequence minimising sum(max f + max b): (cost, [(operators, groups), ...]).

    fwd[o, i], bwd[o, i]: seconds of operator o on sizes[i] devices (inf: it does not fit)."""
    n = len(ops)
    size_arr = np.asarray(sizes, dtype=float)
    full = (1 << n) - 1
    wave_cache: dict[tuple[int, ...], tuple[float, tuple | None]] = {}
    best: dict[int, tuple[float, tuple | None, int]] = {full: (0.0, None, full)}
    need_mask = [sum(1 << a for a in op.after) for op in ops]

    def solve(done: int) -> float:
        if done in best:
            return best[done][0]
        ready = [o for o in range(n) if not done >> o & 1 and need_mask[o] & done == need_mask[o]]
        choice = (INF, None, done)
        for k in range(1, len(ready) + 1):
            for members in combinations(ready, k):
                if members not in wave_cache:
                    wave_cache[members] = _wave_allocation(members, size_arr, fwd, bwd, total)
                cost, groups = wave_cache[members]
                if not math.isfinite(cost):
                    continue
                nxt = done | sum(1 << o for o in members)
                value = cost + solve(nxt)
                if value < choice[0]:
                    choice = (value, (members, groups), nxt)
        best[done] = choice
        return choice[0]

    cost = solve(0)
    if not math.isfinite(cost):
        return INF, []
    waves, state = [], 0
    while state != full:
        _, wave, state = best[state]
        waves.append(wave)
    return cost, waves


@dataclass(frozen=True)
class SpindlePlan:
    ops: tuple[Operator, ...]
    waves: tuple[Wave, ...]
    combine_s: float
    tail_s: float
    gpus: int
    searches: int = 0

    @property
    def waves_s(self) -> float:
        return sum(w.time_s for w in self.waves)

    @property
    def step_s(self) -> float:
        return self.waves_s + self.combine_s + self.tail_s

    def timeline(self) -> list[tuple[str, str, int, int, float, float]]:
        """(operator, 'F'/'B', first device, devices, start, end) of every operator run: forward
        waves in order, then the backward in reverse (the simulator of the step's waves)."""
        out, t = [], 0.0
        for w in self.waves:
            for p in w.ops:
                out.append((self.ops[p.op].name, "F", p.first_gpu, p.gpus, t, t + p.fwd_s))
            t += w.fwd_s
        for w in reversed(self.waves):
            for p in w.ops:
                out.append((self.ops[p.op].name, "B", p.first_gpu, p.gpus, t, t + p.bwd_s))
            t += w.bwd_s
        return out

    def describe(self) -> list[str]:
        lines = []
        for k, w in enumerate(self.waves):
            parts = ", ".join(f"{self.ops[p.op].name} on {p.gpus} GPUs ({(p.fwd_s + p.bwd_s) * 1e3:.0f} ms)"
                              for p in w.ops)
            lines.append(f"wave {k + 1}: {parts}; {w.time_s * 1e3:.0f} ms (fwd {w.fwd_s * 1e3:.0f} + bwd "
                         f"{w.bwd_s * 1e3:.0f})")
        lines.append(f"gradient combine of shared parts {self.combine_s * 1e3:.1f} ms, tails {self.tail_s * 1e3:.1f} ms")
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
    vlm, cluster = pricer.vlm, pricer.cluster
    workload.check_model(vlm)
    ops = operator_graph(workload)
    tasks = {t.name: t for t in workload.tasks}
    sizes = node_sizes(gpus, cluster.gpus_per_node)
    fwd = np.full((len(ops), len(sizes)), np.inf)
    bwd = np.full_like(fwd, np.inf)
    costs = {}
    for o, op in enumerate(ops):
        t = tasks[op.task]
        for i, g in enumerate(sizes):
            c = pricer.encoder(t, g) if op.part == "vision_encoder" else pricer.llm(t, g)
            costs[o, g] = c
            if not c.feasible:
                continue
            hop = group_handoff_s(cluster, vlm, t.images(), g) if t.has_images else 0.0
            fwd[o, i] = c.fwd_s + (hop if op.part == "llm" else 0.0)
            bwd[o, i] = c.bwd_s + (hop if op.part == "vision_encoder" else 0.0)
    cost, packed = pack_waves(ops, sizes, fwd, bwd, gpus)
    if not packed:
        raise TesseraError(f"no wave schedule of the {len(ops)} operators fits on {gpus} GPUs")
    waves = []
    for members, groups in packed:
        first, placed = 0, []
        for o, g in zip(members, groups):
            i = sizes.index(g)
            placed.append(Placed(o, g, first, float(fwd[o, i]), float(bwd[o, i])))
            first += g
        waves.append(Wave(tuple(placed)))
    combine, tails = 0.0, 0.0
    for part in ("vision_encoder", "llm"):
        runs = [(p.op, p.gpus) for w in waves for p in w.ops if ops[p.op].part == part]
        if not runs:
            continue
        tails += max(costs[o, g].tail_s for o, g in runs)
        if len(runs) > 1:
            g_min = min(g for _, g in runs)
            shard = 2.0 * pricer.model(part).num_params / g_min
            combine += float(collective_times(cluster, "all_reduce", shard, len(runs), g_min))
    return SpindlePlan(tuple(ops), tuple(waves), combine, tails, gpus, pricer.searches)


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
