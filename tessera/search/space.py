"""The search space: options, candidate layer strategies, and dominance pruning.

Candidates for one layer on a stage of n devices, given B sequences per micro-batch:
    tp  divides n, <= GPUs per node (and `max_tp`), divides the attention and KV heads. Groups are
        consecutive ranks, so a degree that does not divide the GPUs of a node (6 on 8-GPU nodes)
        has groups across two nodes (ranks 6-11): in the space, costed as spanning nodes
        (cost/comm.py group_layout), or left out with `TP_ACROSS_NODES_COSTED` off;
        tp > 1 always with Megatron sequence parallelism (TP without SP has the same time and
        more memory: the norms' activations are replicated instead of sharded).
    sp  Ulysses degree u (attention layers): divides n / tp, tp * u divides the heads and fits in a
        node (its four all-to-alls per layer and direction would otherwise cross the network), and
        divides the GPUs of a node under the same switch as tp. Beyond the KV heads of a TP rank
        the runtime repeats KV heads (runtime/attention.py kv_repeats), which cost/layer.py prices;
        with `KV_REPEAT_COSTED` off, u must divide them.
    cp  context-parallel (ring attention) degree: divides n / (tp * u); the sequence splits into
        2 cp chunks of at least `CP_MIN_CHUNK` tokens (one flash-attention tile of queries: a
        smaller ring step is launch overhead); groups of stride tp * u, inside a node or across
        nodes (the ring's point-to-point blocks hide behind each step's attention, cost/layer.py
        prices what they do not hide); every layer (the embedding and the head shard the sequence
        alike, or the activation would be re-sharded at 2 cp-fold cost), flash attention only,
        not in mixture-of-experts models (the planner turns it off there). With `allow_cp` off,
        cp = 1.
    dp  = n / (tp * u * cp), must divide B (whole sequences per replica).
    zero 0..3 (dp cp > 1; ZeRO shards over dp x cp), with HSDP sharding inside a node
        (dp_shard = GPUs per node / (tp u cp)) when that is a proper divisor of dp; offload of the
        optimizer state with zero >= 1.
    recompute none / selective / full (attention layers).
    ep  MoE layers: divides the experts and dp * u.

`layout_refusal` states these rules once: the candidate tables and hand-made plans
(`baselines.manual_plan`) both use it, so a hand plan the space would refuse is refused with the
rule's reason. Interleaved 1F1B tries every depth v whose pp * v chunks split the blocks (or the
blocks with the embedding and head) evenly (`virtual_stage_options`).

Dominance (`prune_dominated`): within strategies of the same layout (dp, tp, sp, SP kind), which
therefore pay identical re-sharding costs to any neighbour, strategy A is dropped when another
strategy B is no worse in every cost component the planner and the simulator use —
forward, backward-input, weight-gradient and once-per-step time, model-state, activation and
buffer bytes. Proof: step time (a max-plus expression of chunk times, monotone in each) and
memory (sums, a max and non-negative in-flight factors) are non-decreasing in every component,
so replacing A by B in any plan, on any rank, never makes it slower or larger.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from math import gcd, isqrt

import numpy as np

from ..cost.layer import _RC_CODE as RC_CODES
from ..cost.layer import LayerCosts, StrategyTable
from ..plan import LayerStrategy
from ..spec.cluster import ClusterSpec
from ..spec.model import LayerSpec

ALL_SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble", "gpipe")

# Parts of the space that are searched only because the cost model prices them; turn a switch off
# to leave them out (the explanation says which way each goes).
# Tensor-parallel groups that straddle two nodes (a TP degree that does not divide the GPUs of a
# node): cost/comm.py `group_layout` finds the nodes every group of an axis touches.
TP_ACROSS_NODES_COSTED = True
# Ulysses degrees beyond the KV heads of a TP rank: the runtime repeats the KV heads
# (runtime/attention.py `kv_repeats`); cost/layer.py charges the larger all-to-alls and activations.
KV_REPEAT_COSTED = True
# The shortest chunk of the load-balanced context-parallel split (tokens): a flash tile of queries.
CP_MIN_CHUNK = 128


def has_attention(layer: LayerSpec) -> bool:
    return layer.num_heads > 0 and layer.attn_flops_coeff > 0


def layout_refusal(layer: LayerSpec, tp: int, ulysses: int, gpus_per_node: int) -> str | None:
    """Why (tp, Ulysses degree) is outside the search space for `layer`, or None (module docstring)."""
    attention = has_attention(layer)
    heads, kv = layer.num_heads, layer.num_kv_heads
    if attention and (heads % tp or kv % tp):
        return f"tp={tp} must divide the {heads} attention heads and the {kv} KV heads"
    if tp > gpus_per_node:
        return f"tp={tp} is larger than a node ({gpus_per_node} GPUs): tensor parallelism stays inside a node"
    if gpus_per_node % tp and not TP_ACROSS_NODES_COSTED:
        return (f"tp={tp} does not divide the {gpus_per_node} GPUs of a node, so some tensor-parallel groups "
                f"would straddle two nodes (left out of the space: TP_ACROSS_NODES_COSTED)")
    if ulysses == 1:
        return None
    width = tp * ulysses
    if not attention:
        return "Ulysses sequence parallelism splits attention layers only"
    if heads % width:
        return f"tp x ulysses = {width} must divide the {heads} attention heads"
    if width > gpus_per_node:
        return f"tp x ulysses = {width} must fit in a node ({gpus_per_node} GPUs)"
    if gpus_per_node % width and not TP_ACROSS_NODES_COSTED:
        return f"tp x ulysses = {width} must divide the {gpus_per_node} GPUs of a node"
    if (kv // tp) % ulysses and not KV_REPEAT_COSTED:
        return (f"ulysses={ulysses} must divide the {kv // tp} KV heads of a tensor-parallel rank "
                f"({kv} KV heads / tp {tp}; repeating them is left out of the space: KV_REPEAT_COSTED)")
    return None


def cp_refusal(layer: LayerSpec, cp: int, seq_len: int = 0) -> str | None:
    """Why a context-parallel degree is outside the search space for `layer`, or None."""
    if cp == 1:
        return None
    if layer.num_experts:
        return "context parallelism is not combined with expert parallelism (MoE layers run cp = 1)"
    if has_attention(layer) and layer.attn_kernel == "unfused":
        return "context parallelism runs flash-attention blocks (this layer's attention is unfused)"
    if seq_len and seq_len % (2 * cp):
        return f"cp={cp} needs the sequence of {seq_len} tokens to split into 2 x cp = {2 * cp} equal chunks"
    if seq_len and seq_len // (2 * cp) < CP_MIN_CHUNK:
        return (f"cp={cp} cuts the sequence of {seq_len} tokens into chunks of {seq_len // (2 * cp)}, "
                f"shorter than a flash-attention tile of {CP_MIN_CHUNK}")
    return None


def space_notes(layers: list[LayerSpec], stage_sizes: list[int], gpus_per_node: int,
                options: "SearchOptions") -> list[str]:
    """How this search treats the parts of the space behind the switches above, in words (for the
    plan's explanation); nothing when the model and cluster have none."""
    attention = [x for x in layers if has_attention(x)]
    probe = attention[0] if attention else layers[0]
    notes = []
    straddle = sorted({d for n in stage_sizes for d in divisors(n)
                       if 1 < d < gpus_per_node and gpus_per_node % d and d <= (options.max_tp or d)
                       and not (attention and (probe.num_heads % d or probe.num_kv_heads % d))})
    if straddle:
        degrees = ", ".join(map(str, straddle))
        notes.append(f"space: tp {degrees} searched, costed as groups that straddle {gpus_per_node}-GPU nodes"
                     if TP_ACROSS_NODES_COSTED else
                     f"space: tp {degrees} left out: such groups straddle {gpus_per_node}-GPU nodes")
    if attention and options.allow_ulysses:
        kv = probe.num_kv_heads
        beyond = sorted({u for n in stage_sizes for u in divisors(n)
                         if u > 1 and kv % u and probe.num_heads % u == 0 and u <= gpus_per_node
                         and (TP_ACROSS_NODES_COSTED or gpus_per_node % u == 0)
                         and u <= (options.max_sp or u)})
        if beyond:
            degrees = ", ".join(map(str, beyond))
            notes.append(f"space: Ulysses degrees beyond the {kv} KV heads ({degrees}) searched, costed with "
                         f"the runtime's KV-head repeats" if KV_REPEAT_COSTED else
                         f"space: Ulysses degrees beyond the {kv} KV heads ({degrees}) left out")
    return notes


def virtual_stage_options(pp: int, num_layers: int, num_blocks: int, options: "SearchOptions") -> list[int]:
    """Interleave depths v >= 2 tried at pipeline degree pp: `options.virtual_stages` if given, else
    every v whose pp * v chunks split the blocks evenly (Megatron's rule) or the blocks with the
    embedding and the LM head counted as one block each (Llama 3 405B: 126 blocks + 2 = 128
    layers on pp = 16 x v = 8)."""
    if options.virtual_stages is not None:
        return [v for v in options.virtual_stages if v > 1 and pp * v <= num_layers]
    return [v for v in range(2, num_layers // pp + 1)
            if num_blocks % (pp * v) == 0 or num_layers % (pp * v) == 0]


@dataclass(frozen=True)
class SearchOptions:
    """Restrictions of the search space (None = no restriction)."""

    max_tp: int | None = None
    max_sp: int | None = None  # Ulysses degree
    max_pp: int | None = None
    max_ep: int | None = None
    ep: int | None = None  # fixes every MoE layer's expert-parallel degree
    pp: int | None = None  # fixed degrees for a partially specified search
    tp: int | None = None  # fixes every layer's tensor-parallel degree
    dp: int | None = None  # fixes the data-parallel degree of the batch (dp_of_batch)
    schedules: tuple[str, ...] = ALL_SCHEDULES
    virtual_stages: tuple[int, ...] | None = None  # interleave depths; None: `virtual_stage_options`
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    allow_recompute: bool = True
    allow_offload: bool = True
    allow_hsdp: bool = True
    allow_ulysses: bool = True
    allow_cp: bool = True  # context parallelism (ring attention)
    max_cp: int | None = None
    # The search explores cp degrees whose chunks hold at least this many tokens (hand plans and an
    # explicit `max_cp` go down to CP_MIN_CHUNK). Shorter chunks quadruple the candidate table for
    # little: on benchmarks/search_speed.py's cases, llama2-70b at 4K tokens on 1,024 GPUs plans
    # 0.4% slower without cp2 (5.260 vs 5.238 s) in a sixth of the time (0.85 vs 4.97 CPU-s), and
    # llama3-405b at 8K keeps 99% of cp's gain (41.27 vs 40.87 s, 43.23 without cp) in 0.9 vs 4.2 CPU-s.
    cp_search_min_chunk: int = 2048
    cp: int | None = None  # fixes every layer's context-parallel degree
    micro_batch_sizes: tuple[int, ...] | None = None
    # Exhaustive stage boundaries when there are at most this many splits, else balanced.
    max_splits: int = 64
    shifted_splits_up_to: int = 16
    # Memory resolution of the dynamic program (bins of the per-rank budget): where its rounded-down
    # and rounded-up programs disagree, the bins grow 4x up to `max_memory_bins` (dp.py).
    memory_bins: int = 256
    max_memory_bins: int = 1024
    # Relative tolerance of the branch and bound: a choice is dropped once its lower bound shows it
    # cannot beat the best plan by more than this factor (0: prove the optimum).
    optimality_gap: float = 1e-3
    runner_ups: int = 3

    def recompute_levels(self) -> tuple[str, ...]:
        return self.recompute if self.allow_recompute else ("none",)


@lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
    small = [d for d in range(1, isqrt(n) + 1) if n % d == 0]
    return tuple(small + [n // d for d in reversed(small) if d * d != n])


def divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending (trial division up to sqrt(n): O(sqrt n), cached)."""
    return list(_divisors(n))


def cp_options(layer: LayerSpec, width: int, seq_len: int, options: SearchOptions) -> list[int]:
    """Context-parallel degrees searched for `layer` on `width` ranks (after tp and Ulysses)."""
    if options.cp is not None:
        return [options.cp] if width % options.cp == 0 and cp_refusal(layer, options.cp, seq_len) is None else []
    if not options.allow_cp:
        return [1]
    shortest = CP_MIN_CHUNK if options.max_cp else options.cp_search_min_chunk
    return [c for c in divisors(width) if c <= (options.max_cp or c) and cp_refusal(layer, c, seq_len) is None
            and (c == 1 or not seq_len or seq_len // (2 * c) >= shortest)]


def candidate_table(layer: LayerSpec, stage_size: int, micro_batch_seqs: int, cluster: ClusterSpec,
                    options: SearchOptions, seq_len: int = 0) -> StrategyTable:
    """All strategies of the space for `layer` (see the module docstring), as a table; `seq_len`
    (0: unchecked) bounds the context-parallel degrees."""
    attn = has_attention(layer)
    rows = []
    max_tp = min(cluster.gpus_per_node, options.max_tp or stage_size)
    rc_codes = [RC_CODES[r] for r in (options.recompute_levels() if attn else ("none",))]
    for tp in divisors(stage_size):
        if tp > max_tp or (options.tp is not None and tp != options.tp):
            continue
        for u in divisors(stage_size // tp):
            if u > 1 and not (options.allow_ulysses and u <= (options.max_sp or u)):
                continue
            if layout_refusal(layer, tp, u, cluster.gpus_per_node) is not None:
                continue
            for cp in cp_options(layer, stage_size // (tp * u), seq_len, options):
                rows += _degree_rows(layer, stage_size, micro_batch_seqs, cluster, options, tp, u, cp, rc_codes)
    return StrategyTable.from_rows(rows)


def _degree_rows(layer: LayerSpec, stage_size: int, micro_batch_seqs: int, cluster: ClusterSpec,
                 options: SearchOptions, tp: int, u: int, cp: int, rc_codes: list[int]) -> list[tuple]:
    """The candidate rows of one (tp, Ulysses, cp) layout: ZeRO, HSDP, offload, recompute, EP."""
    dp = stage_size // (tp * u * cp)
    if micro_batch_seqs % dp or (options.dp is not None and dp != options.dp):
        return []
    if options.micro_batch_sizes is not None and micro_batch_seqs // dp not in options.micro_batch_sizes:
        return []
    megatron = tp > 1 and u == 1
    eps = [1]
    if layer.num_experts:
        eps = [e for e in divisors(gcd(layer.num_experts, dp * u)) if e <= (options.max_ep or e)
               and e == (options.ep or e)]
    width = tp * u * cp
    hsdp = cluster.gpus_per_node // width if cluster.gpus_per_node >= width else 0
    zeros: list[tuple[int, int, bool]] = []
    for z in options.zero_stages:
        if z == 0:
            zeros.append((0, 0, False))
            continue
        if dp * cp == 1:
            continue
        shards = [0] + ([hsdp] if options.allow_hsdp and 1 < hsdp < dp and dp % hsdp == 0 else [])
        for d in shards:
            zeros.append((z, d, False))
            if options.allow_offload:
                zeros.append((z, d, True))
    if dp * cp == 1 and options.allow_offload:
        zeros.append((1, 0, True))  # offload needs the ZeRO optimizer even unsharded
    return [(dp, tp, u, megatron, z, d, rc, off, ep, cp) for ep in eps for z, d, off in zeros for rc in rc_codes]


def candidate_strategies(layer: LayerSpec, stage_size: int, micro_batch_seqs: int, cluster: ClusterSpec,
                         options: SearchOptions, seq_len: int = 0) -> list[LayerStrategy]:
    """`candidate_table` as LayerStrategy objects."""
    table = candidate_table(layer, stage_size, micro_batch_seqs, cluster, options, seq_len)
    return [table.get(i) for i in range(len(table))]


@dataclass
class Candidates:
    """A layer's surviving strategies and their costs in one context."""

    table: StrategyTable
    costs: LayerCosts
    layout: list[tuple[int, int, int, bool, int]] = field(default_factory=list)
    pruned: int = 0
    fastest: dict[str, float] = field(default_factory=dict)  # smallest value of each cost (`fastest_costs`)


def fastest_costs(costs: LayerCosts, m: int) -> dict[str, float]:
    """The smallest value of every cost term over the candidates (each alone, for lower bounds)."""
    return {"fwd": float(np.min(costs.fwd)), "bwd": float(np.min(costs.bwd)),
            "bonly": float(np.min(costs.bwd - costs.wgrad)), "wgrad": float(np.min(costs.wgrad)),
            "step": float(np.min(costs.step)), "buf": float(np.min(costs.buf)),
            "fb": float(np.min(costs.fwd + costs.bwd)), "work": float(np.min(m * (costs.fwd + costs.bwd) + costs.step))}


def prune_dominated(table: StrategyTable, costs: LayerCosts, by_shard: bool = False) -> np.ndarray:
    """Indices of the strategies no other strategy of the same layout dominates (docstring proof);
    among exact ties the first is kept. `by_shard`: the layout includes the ZeRO shard degree too
    (a tied embedding and LM head must take one parameter layout, `param_layouts`)."""
    comp = np.stack([costs.fwd, costs.bwd - costs.wgrad, costs.wgrad, costs.step, costs.states,
                     costs.act, costs.buf], axis=1)
    columns = [table.dp, table.tp, table.sp, table.megatron.astype(np.int64), table.cp]
    layout = np.stack(columns + ([table.shard] if by_shard else []), axis=1)
    _, group = np.unique(layout, axis=0, return_inverse=True)
    return undominated(group.ravel(), comp)


def param_layouts(table: StrategyTable) -> list[tuple[int, int, int, int, int]]:
    """Each candidate's parameter layout (dp, ulysses, tp, ZeRO shard degree, cp): the degrees that
    decide which ranks share the layer's parameters (the runtime's `LayerLayout`); a tied
    embedding and LM head of one rank share their weight only when theirs are equal."""
    return list(zip(table.dp.tolist(), table.sp.tolist(), table.tp.tolist(), table.shard.tolist(),
                    table.cp.tolist()))


def undominated(group: np.ndarray, comp: np.ndarray) -> np.ndarray:
    """Indices i such that no j of the same group is <= i in every column of `comp` and better in
    one (exact ties: the first index survives)."""
    keep = np.ones(len(group), dtype=bool)
    tol = 1e-12
    for g in np.unique(group):
        idx = np.flatnonzero(group == g)
        if len(idx) == 1:
            continue
        c = comp[idx]
        slack = np.abs(c[:, None, :]) * tol + tol
        le = np.all(c[None, :, :] <= c[:, None, :] + slack, axis=2)  # le[i, j]: j no worse than i
        eq = np.all(np.abs(c[None, :, :] - c[:, None, :]) <= slack, axis=2)
        order = np.arange(len(idx))
        dominated = np.any((le & ~eq) | (eq & (order[None, :] < order[:, None])), axis=1)
        keep[idx[dominated]] = False
    return np.flatnonzero(keep)


def dominated_on_rank(time: np.ndarray, mem: np.ndarray, buf: np.ndarray, layout: np.ndarray,
                      penalty: np.ndarray) -> np.ndarray:
    """Indices of the strategies to keep for one rank's dynamic program.

    There a strategy is just (time, memory, buffer, layout). A is dominated by B when
    mem_B <= mem_A, buf_B <= buf_A and time_B + pen <= time_A, with pen = 0 for the same layout and
    otherwise `penalty[layout_B]` = the largest re-sharding cost into plus out of B's layout.
    Proof: swapping A for B in any assignment changes the two adjacent transition terms by at
    most pen and the layer's time by time_B - time_A <= -pen, memory and buffer not upwards; so
    the swap never hurts and an optimum without A exists. Exact ties keep the first index."""
    first = undominated(layout, np.stack([time, mem, buf], axis=1))  # same-layout pass, cheaper
    if len(first) < len(time):
        rest = dominated_on_rank(time[first], mem[first], buf[first], layout[first], penalty)
        return first[rest]
    pen = np.where(layout[None, :] == layout[:, None], 0.0, penalty[layout][None, :])  # [A, B]
    tol = 1e-12
    t_ok = time[None, :] + pen <= time[:, None] * (1 + tol) + tol
    m_ok = mem[None, :] <= mem[:, None] * (1 + tol) + tol
    b_ok = buf[None, :] <= buf[:, None] * (1 + tol) + tol
    dom = t_ok & m_ok & b_ok
    same = ((np.abs(time[None, :] + pen - time[:, None]) <= np.abs(time[:, None]) * tol + tol)
            & (np.abs(mem[None, :] - mem[:, None]) <= np.abs(mem[:, None]) * tol + tol)
            & (np.abs(buf[None, :] - buf[:, None]) <= np.abs(buf[:, None]) * tol + tol))
    n = len(time)
    order = np.arange(n)
    dominated = np.any((dom & ~same) | (same & (order[None, :] < order[:, None])), axis=1)
    return np.flatnonzero(~dominated)


def lp_time_bound(kinds: list[tuple[int, list[tuple[float, float]]]], budget: float) -> float:
    """Lower bound on sum of layer times under sum of layer memory <= budget.

    `kinds`: (count, lower_hull(time, mem)) per distinct layer. The linear relaxation of this
    multiple-choice knapsack (each layer may mix strategies fractionally; re-sharding and buffers,
    both non-negative, dropped) is solved exactly by the greedy on the lower convex hulls of
    (memory, time): start every layer at its smallest memory, then buy the steepest time savings
    per byte until the budget is spent. Returns inf when even the smallest memory does not fit."""
    base_t = base_m = 0.0
    edges = []  # (slope, capacity bytes)
    for count, pts in kinds:
        base_m += count * pts[0][0]
        base_t += count * pts[0][1]
        for (m0, t0), (m1, t1) in zip(pts, pts[1:]):
            edges.append(((t1 - t0) / (m1 - m0), count * (m1 - m0)))
    if base_m > budget:
        return float("inf")
    room = budget - base_m
    for slope, cap in sorted(edges):
        take = min(cap, room)
        base_t += slope * take
        room -= take
        if room <= 0:
            break
    return base_t


def lower_hull(time: np.ndarray, mem: np.ndarray) -> list[tuple[float, float]]:
    """Lower convex hull of the (memory, time) points, memory ascending, time descending."""
    order = np.lexsort((time, mem))
    m_sorted, t_sorted = mem[order], time[order]
    pareto = t_sorted < np.minimum.accumulate(np.concatenate([[np.inf], t_sorted[:-1]]))
    pts: list[tuple[float, float]] = []
    for m, t in zip(m_sorted[pareto].tolist(), t_sorted[pareto].tolist()):
        while len(pts) >= 2 and ((pts[-1][1] - pts[-2][1]) * (m - pts[-1][0])
                                 >= (t - pts[-1][1]) * (pts[-1][0] - pts[-2][0])):
            pts.pop()
        pts.append((m, t))
    return pts
