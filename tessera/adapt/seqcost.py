"""Cost of a step's variable-length sequences on per-step sequence-parallel groups, priced by
`tessera.cost` (the planner's one cost model: `cost.layer.layer_costs`, `cost.memory`).

The run's layout is fixed (`Layout`): N ranks in units of `tp` consecutive ranks (a tensor-parallel
group, the plan's TP, fixed); the model states are sharded by FSDP2 over groups of `shard`
consecutive units and replicated across the N / (tp shard) groups (HSDP; shard 1 = replicated,
shard N / tp = ZeRO-3 over all). A step's sequences run on sequence-parallel groups of d units
(Ulysses over d, TP inside each unit), d a power of two dividing the heads per TP rank, chosen per
micro-batch (`seqpar`). A `Strategy` is a ZeRO working mode with an activation recompute; a
length group (phase) of a step runs one working mode, each of its groups one recompute (HotSPa,
`switching`); `SeqCostModel` prices one strategy.

Per group of degree d running sequences of lengths L_s in one micro-batch (seconds):

    time_d(group) = alpha_d + sum_s (lin_d L_s + attn_d L_s**2)

fitted, layer by layer, to `layer_costs` (forward + backward per micro-batch: GEMMs by shape, flash
attention, memory-bound work, the measured per-call, Ulysses and TP overheads and slowdowns, the
Ulysses all-to-alls and TP collectives on the critical path, recompute) of the strategy
(dp = N / (tp d), tp, Ulysses d, no ZeRO) at three (sequence length, tokens) points; alpha_d
holds the fixed costs (kernel launches, collective latencies, per-call overheads; with ZeRO-3 its
measured per-gather overhead), lin_d and attn_d the linear and quadratic terms.

Memory of a device (bytes), `cost.memory` as the planner charges it: the model states of the
strategy (params, grads, optimizer; working mode 1/2 keep the gathered parameters, 1 the
unsharded gradients) + the activations of its group's tokens (`act` per token, one micro-batch in
flight) + the largest layer buffer (the backward's transient, recompute's replay, ZeRO-3's two
gathered layers) <= `memory_budget` (device memory less the margin and the reserve, over one plus
the fragmentation). So a group of degree d holds at most `cap_d` tokens.

Data-parallel traffic, per layer l, from `layer_costs` of the storage layout (its `zero_gather`,
`zero_reduce`, `replica_reduce`): ag_l, rs_l, rep_l, overlapped with the layer's compute as there,
overlapped(c, x) = c + (slowdown - 1) min(c, x) + max(0, x - c). A micro-batch whose slowest group
computes T seconds, a share f_l of it in layer l's forward and b_l in its backward, takes

    mb(T) = T + sum_l [extra(f_l T, x^f_l) + extra(b_l T, x^b_l)]

with, by working mode z (the runtime's FSDP2 flags, `runtime/varlen.py`):
    z = 3   x^f = ag, x^b = ag + rs  (gathered and reduce-scattered every micro-batch)
    z = 2   x^b = rs; the parameters are gathered once when the group starts, under its first
            forward (not when the previous group kept them gathered)
    z = 1   nothing per micro-batch; gathered once as z = 2, the accumulated unsharded gradients
            reduce-scattered once when the group ends (under its last backward; not when the next
            group accumulates unsharded too)
and once per step, under the step's last backward after its own traffic, the replica all-reduce
rep; plus, per micro-batch after the step's first, the gradient accumulation (3 x the gradient
bytes over the memory bandwidth, as `layer_costs` charges it) and once the optimizer update.
Switching between strategies costs exactly those gathers and reduce-scatters (`phase_time`).

No torch import.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from ..cost.layer import StepContext, StrategyTable, cost_key, layer_costs, overlap_extra
from ..cost.memory import RC_FULL, RC_NONE, RC_SELECTIVE, memory_budget
from ..errors import TesseraError
from ..spec.cluster import ClusterSpec
from ..spec.model import LayerKind, ModelSpec
from ..spec.workload import Workload

BLOCK_KINDS = (LayerKind.DECODER, LayerKind.MOE_DECODER, LayerKind.ENCODER)
RECOMPUTE = ("none", "selective", "full")
_RC_CODE = {"none": RC_NONE, "selective": RC_SELECTIVE, "full": RC_FULL}
# Fit points (sequence length, sequences per unit of the group): the linear term from two token
# counts at one length, the quadratic one from a longer length.
_FIT_POINTS = ((512, 4), (512, 24), (16384, 1))


@dataclass(frozen=True)
class Layout:
    """What stays fixed for a run: ranks, the tensor-parallel degree and the ZeRO shard group."""

    num_ranks: int
    tp: int = 1
    shard: int = 0  # units per ZeRO shard group; 0 = all N / tp units; 1 = replicated
    megatron: bool = False  # Megatron sequence parallelism inside the TP group
    dtype: str = "bf16"
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        if self.tp < 1 or self.num_ranks % self.tp:
            raise TesseraError(f"tensor-parallel degree {self.tp} does not divide {self.num_ranks} ranks")
        if self.shard and self.units % self.shard:
            raise TesseraError(f"ZeRO shard group of {self.shard} does not divide the {self.units} "
                               f"data-parallel ranks")

    @property
    def units(self) -> int:
        """Ranks / tp: what sequence-parallel groups are counted in."""
        return self.num_ranks // self.tp

    @property
    def shard_units(self) -> int:
        return self.shard or self.units


@dataclass(frozen=True)
class Strategy:
    """How one length group of a step runs: ZeRO working mode (3, 2, 1) and recompute."""

    zero: int = 3
    recompute: str = "selective"

    def __post_init__(self) -> None:
        if self.zero not in (1, 2, 3) or self.recompute not in RECOMPUTE:
            raise TesseraError(f"unknown strategy zero{self.zero} rc:{self.recompute}")

    def describe(self) -> str:
        return f"zero{self.zero} rc:{self.recompute}"


def ulysses_degrees(model: ModelSpec, units: int, tp: int = 1) -> np.ndarray:
    """Power-of-two degrees <= units that split every attention layer's heads per TP rank
    (Ulysses gives each rank whole heads)."""
    degrees = 2 ** np.arange(int(math.log2(units)) + 1)
    heads = [layer.num_heads // tp for layer in model.layers if layer.kind in BLOCK_KINDS and layer.num_heads]
    return np.array([d for d in degrees if all(h % d == 0 for h in heads)], dtype=np.int64)


@dataclass(frozen=True)
class SeqCostModel:
    """Per-group time and memory at each sequence-parallel degree, for one strategy (module docstring).

    Degrees and `num_devices` count units of `tp` ranks. Per layer kind (arrays of length K,
    `layer_count` layers each): the share of a group's time in its forward and backward and the
    data-parallel collectives of the storage layout."""

    num_devices: int
    degrees: np.ndarray  # (D,)
    alpha_s: np.ndarray  # (D,) seconds per group per micro-batch
    lin_s: np.ndarray  # (D,) seconds per token
    attn_s: np.ndarray  # (D,) seconds per token**2
    cap_tokens: np.ndarray  # (D,) most tokens a group holds in one micro-batch
    layer_count: np.ndarray = field(default_factory=lambda: np.ones(1))
    fwd_share: np.ndarray = field(default_factory=lambda: np.array([1 / 3]))
    bwd_share: np.ndarray = field(default_factory=lambda: np.array([2 / 3]))
    gather_s: np.ndarray = field(default_factory=lambda: np.zeros(1))
    reduce_s: np.ndarray = field(default_factory=lambda: np.zeros(1))
    replica_s: np.ndarray = field(default_factory=lambda: np.zeros(1))
    zero: int = 3
    overlap_slowdown: float = 1.0
    accumulate_s: float = 0.0  # per micro-batch after the step's first
    optimizer_s: float = 0.0  # once per step
    strategy: Strategy = Strategy()
    tp: int = 1
    state_bytes: float = 0.0  # model states per device under this strategy (for reports)

    # --- per sequence and group -------------------------------------------------------------------
    @property
    def a2a_alpha_s(self) -> np.ndarray:  # the solver's name for the fixed cost of a group
        return self.alpha_s

    def degree_index(self, degree: int) -> int:
        i = int(np.searchsorted(self.degrees, degree))
        if i >= len(self.degrees) or self.degrees[i] != degree:
            raise ValueError(f"degree {degree} is not one of {self.degrees.tolist()}")
        return i

    def seq_time(self, lens) -> np.ndarray:
        """(n, D): lin_d L + attn_d L**2 for each sequence and degree."""
        lens = np.asarray(lens, dtype=np.float64)[:, None]
        return self.lin_s[None, :] * lens + self.attn_s[None, :] * lens * lens

    def compute_time(self, lens) -> np.ndarray:
        """Seconds of each sequence alone on one unit (degree 1, without the fixed cost)."""
        return self.seq_time(lens)[:, 0]

    def group_time(self, lens, degree: int) -> float:
        lens = np.asarray(lens, dtype=np.float64)
        if lens.size == 0:
            return 0.0
        i = self.degree_index(degree)
        return float(self.alpha_s[i] + self.seq_time(lens)[:, i].sum())

    def token_capacity(self, degree) -> np.ndarray | float:
        """Most tokens a group of `degree` units holds in one micro-batch."""
        idx = np.searchsorted(self.degrees, np.asarray(degree))
        return self.cap_tokens[idx]

    def min_degree(self, lens) -> np.ndarray:
        """Smallest degree that holds each sequence alone; 0 where none does."""
        lens = np.asarray(lens, dtype=np.float64)
        fits = lens[:, None] <= self.cap_tokens[None, :]
        return np.where(fits.any(axis=1), self.degrees[np.argmax(fits, axis=1)], 0)

    @property
    def longest_fitting(self) -> int:
        return int(self.cap_tokens.max()) if len(self.cap_tokens) else 0

    def check_fits(self, lens) -> None:
        lens = np.asarray(lens)
        bad = self.min_degree(lens) == 0
        if bad.any():
            raise TesseraError(
                f"a document of {int(lens[bad].max())} tokens does not fit in memory even on one "
                f"group of all {int(self.degrees[-1]) * self.tp} ranks (at most {self.longest_fitting} "
                f"tokens); skip or truncate such documents, or use more devices or recompute")

    # --- micro-batches and steps ------------------------------------------------------------------
    def _traffic(self) -> tuple[np.ndarray, np.ndarray]:
        z = self.zero
        xf = self.gather_s if z == 3 else np.zeros_like(self.gather_s)
        xb = self.gather_s + self.reduce_s if z == 3 else (self.reduce_s if z == 2 else np.zeros_like(self.reduce_s))
        return xf, xb

    def _extra(self, share: np.ndarray, t: float, x: np.ndarray) -> float:
        return float(np.dot(self.layer_count, overlap_extra(share * t, x, self.overlap_slowdown)))

    def micro_batch_time(self, slowest_s: float) -> float:
        """A micro-batch whose slowest group computes `slowest_s`, with its per-micro-batch ZeRO traffic."""
        xf, xb = self._traffic()
        return slowest_s + self._extra(self.fwd_share, slowest_s, xf) + self._extra(self.bwd_share, slowest_s, xb)

    @property
    def busy_floor_s(self) -> float:
        """Slowest-group time below which a micro-batch waits on its per-micro-batch traffic."""
        xf, xb = self._traffic()
        c = self.layer_count
        f, b = float(np.dot(c, self.fwd_share)), float(np.dot(c, self.bwd_share))
        return max(float(np.dot(c, xf)) / f if f > 0 else 0.0, float(np.dot(c, xb)) / b if b > 0 else 0.0)

    def phase_time(self, slowest_s, gather_first: bool, reduce_last: bool, step_end: bool) -> float:
        """Micro-batches of one length group run in this order (slowest group times), with the
        switching traffic: `gather_first` (working mode 1/2 gathers the parameters under the first
        forward), `reduce_last` (mode 1 reduce-scatters its accumulated gradients under the last
        backward) and, at `step_end`, the replica all-reduce after the last backward's traffic."""
        if len(slowest_s) == 0:
            return 0.0
        total = sum(self.micro_batch_time(t) for t in slowest_s)
        if gather_first and self.zero <= 2:
            total += self._extra(self.fwd_share, slowest_s[0], self.gather_s)
        _, xb = self._traffic()
        last = slowest_s[-1]
        tail = xb + (self.reduce_s if reduce_last and self.zero == 1 else 0.0)
        if step_end:
            tail = tail + self.replica_s
        return total + self._extra(self.bwd_share, last, tail) - self._extra(self.bwd_share, last, xb)

    def step_time(self, slowest_s) -> float:
        """A whole step under this one strategy: its micro-batches in this order."""
        if len(slowest_s) == 0:
            return 0.0
        return (self.phase_time(slowest_s, True, True, True) + self.optimizer_s
                + self.accumulate_s * (len(slowest_s) - 1))


# --- construction from the layer cost model ---------------------------------------------------------


def _ctx(cluster: ClusterSpec, layout: Layout, seqs: int, seq_len: int) -> StepContext:
    wl = Workload(global_batch=seqs, seq_len=seq_len, dtype=layout.dtype, optimizer=layout.optimizer)
    return StepContext(cluster=cluster, workload=wl, stage_size=layout.num_ranks, micro_batch_seqs=seqs)


def _layer_kinds(model: ModelSpec):
    """Distinct layers (by cost) and how many of each, in model order."""
    kinds, counts = {}, {}
    for layer in model.layers:
        key = cost_key(layer)
        kinds.setdefault(key, layer)
        counts[key] = counts.get(key, 0) + 1
    return list(kinds.values()), np.array([counts[k] for k in kinds], dtype=np.float64)


def _storage_table(layout: Layout, zero: int) -> StrategyTable:
    """The strategy whose data-parallel traffic and states are the storage layout's: dp over all
    units (stride tp), sharded over `shard` units."""
    u, s = layout.units, layout.shard_units
    return StrategyTable.from_rows([(u, layout.tp, 1, layout.megatron, zero, s if s < u else 0, 0, 0, 1)])


def _working_table(layout: Layout, degrees: np.ndarray, recompute: str) -> StrategyTable:
    """One row per degree: dp = units / d, Ulysses d, the layout's TP, ZeRO-1 (FSDP2 units, as the
    adaptive runtime runs them, with nothing per micro-batch: the ZeRO traffic is the storage
    layout's, composed per micro-batch here; ZeRO-0 would be priced as DDP's bucket accumulation)."""
    rc = _RC_CODE[recompute]
    return StrategyTable.from_rows([(layout.units // int(d), layout.tp, int(d), layout.megatron, 1, 0, rc, 0, 1)
                                    for d in degrees])


def build_cost_model(model: ModelSpec, cluster: ClusterSpec, layout: Layout, strategy: Strategy,
                     degrees: np.ndarray | None = None) -> SeqCostModel:
    """`SeqCostModel` of one strategy on a layout (see the module docstring)."""
    if layout.num_ranks != cluster.num_gpus:
        raise TesseraError(f"the layout has {layout.num_ranks} ranks, the cluster {cluster.num_gpus} devices")
    degrees = ulysses_degrees(model, layout.units, layout.tp) if degrees is None else np.asarray(degrees)
    layers, counts = _layer_kinds(model)
    units = layout.units
    # Time: per layer kind and degree, fwd + bwd at the fit points; solve a + b T + c Q.
    pts = []
    for seq_len, per_unit in _FIT_POINTS:
        rows = []
        for layer in layers:
            rc = strategy.recompute if layer.kind in BLOCK_KINDS else "none"
            table = _working_table(layout, degrees, rc)
            c = layer_costs(layer, table, _ctx(cluster, layout, units * per_unit, seq_len))
            rows.append((c.fwd, c.bwd, c.act, c.buf))
        pts.append(rows)
    tokens = np.array([[per_unit * seq_len * d for d in degrees] for seq_len, per_unit in _FIT_POINTS])  # (3, D)
    squares = tokens * np.array([p[0] for p in _FIT_POINTS])[:, None]
    K, D = len(layers), len(degrees)
    coef = np.zeros((K, D, 3))  # (alpha, lin, attn) of fwd + bwd
    for k in range(K):
        y = np.array([pts[p][k][0] + pts[p][k][1] for p in range(3)])  # (3, D)
        for j in range(D):
            A = np.stack([np.ones(3), tokens[:, j], squares[:, j]], axis=1)
            coef[k, j] = np.linalg.solve(A, y[:, j])
    alpha = np.maximum((counts[:, None] * coef[:, :, 0]).sum(axis=0), 0.0)
    lin = (counts[:, None] * coef[:, :, 1]).sum(axis=0)
    attn = np.maximum((counts[:, None] * coef[:, :, 2]).sum(axis=0), 0.0)
    # Shares of a group's time per layer, forward and backward (at the middle fit point, degree 1).
    f = np.array([float(pts[1][k][0][0]) for k in range(K)])
    b = np.array([float(pts[1][k][1][0]) for k in range(K)])
    total = float(np.dot(counts, f + b))
    fwd_share, bwd_share = f / total, b / total

    # Storage: states, gathered buffers and data-parallel traffic (tokens do not matter for them).
    ctx = _ctx(cluster, layout, units, 1024)
    st = [layer_costs(layer, _storage_table(layout, strategy.zero), ctx) for layer in layers]
    st0 = [layer_costs(layer, _storage_table(layout, 3), ctx) for layer in layers]
    plain = [layer_costs(layer, _storage_table(layout, 1), ctx) for layer in layers]
    first = lambda x: float(np.asarray(x)[0])  # noqa: E731
    states = sum(n * first(c.params + c.grads + c.optimizer) for n, c in zip(counts, st))
    gathered = np.array([first(c.buf) - first(p.buf) for c, p in zip(st, plain)])  # ZeRO-3's two layers
    gather = np.array([first(c.zero_gather) for c in st0])
    reduce = np.array([first(c.zero_reduce) for c in st0])
    replica = np.array([first(c.replica_reduce) for c in st0])
    grads = np.array([first(c.grads) for c in st])
    optimizer_s = sum(n * first(c.optimizer_time) for n, c in zip(counts, st))
    if strategy.zero == 3:  # the measured fixed cost of ZeRO-3's gathers, per group and micro-batch
        alpha = alpha + sum(n * (first(c.compute_fwd + c.compute_bwd) - first(p.compute_fwd + p.compute_bwd))
                            for n, c, p in zip(counts, st0, plain))
    accumulate = float(np.dot(counts, 3.0 * grads)) / cluster.device.streaming_bandwidth

    # Memory: states + sum of activations + the largest layer buffer <= budget, per device token.
    t1 = tokens[0] / degrees  # per-device tokens of the first two points (same length)
    t2 = tokens[1] / degrees
    act = sum(counts[k] * pts[1][k][2] for k in range(K)) / t2  # (D,) bytes per device token
    buf1 = np.array([pts[0][k][3] for k in range(K)])  # (K, D)
    buf2 = np.array([pts[1][k][3] for k in range(K)])
    slope = (buf2 - buf1) / (t2 - t1)[None, :]
    base = buf1 - slope * t1[None, :] + (gathered[:, None] if strategy.zero == 3 else 0.0)
    room = memory_budget(cluster) - states
    per_device = np.min((room - base) / (act[None, :] + slope), axis=0)
    cap = np.maximum(per_device, 0.0) * degrees
    return SeqCostModel(num_devices=units, degrees=degrees.astype(np.int64), alpha_s=alpha, lin_s=lin, attn_s=attn,
                        cap_tokens=np.floor(cap), layer_count=counts, fwd_share=fwd_share, bwd_share=bwd_share,
                        gather_s=gather, reduce_s=reduce, replica_s=replica, zero=strategy.zero,
                        overlap_slowdown=cluster.overlap_slowdown, accumulate_s=accumulate,
                        optimizer_s=optimizer_s, strategy=strategy, tp=layout.tp, state_bytes=states)


@dataclass(frozen=True)
class StrategySet:
    """The cost models of the strategies a run may switch between (the first is the default)."""

    layout: Layout
    models: tuple[SeqCostModel, ...]

    @property
    def default(self) -> SeqCostModel:
        return self.models[0]

    def __iter__(self):
        return iter(self.models)

    def __len__(self) -> int:
        return len(self.models)


def strategy_set(model: ModelSpec, cluster: ClusterSpec, layout: Layout, default: Strategy,
                 switching: bool = True, zeros=(3, 2, 1), recomputes=RECOMPUTE) -> StrategySet:
    """The default strategy and, with switching, every other (zero, recompute) whose states fit
    with room for a group's activations; a replicated layout (shard 1) has nothing to gather, so
    only its recompute switches."""
    candidates = [default]
    if switching:
        zs = (default.zero,) if layout.shard_units == 1 else zeros
        candidates += [Strategy(z, rc) for z in zs for rc in recomputes if Strategy(z, rc) != default]
    models = [build_cost_model(model, cluster, layout, s) for s in candidates]
    kept = [m for i, m in enumerate(models) if i == 0 or m.cap_tokens.max() >= 1]
    return StrategySet(layout=layout, models=tuple(kept))


# --- from a static plan -----------------------------------------------------------------------------


def layout_of_plan(plan) -> Layout:
    """The adaptive run's layout of a static plan: its TP (without Megatron sequence parallelism),
    and ZeRO sharded over its `dp_shard` ranks (all data-parallel ranks when not hybrid; replicated
    without ZeRO)."""
    if plan.pipeline.degree != 1:
        raise TesseraError(f"adaptive sequence parallelism needs a plan without pipeline parallelism "
                           f"(pipeline.degree is {plan.pipeline.degree})")
    first = plan.layers[0]
    for i, s in enumerate(plan.layers):
        if (s.tp, s.zero, s.dp_shard, s.sp.value == "megatron") != (first.tp, first.zero, first.dp_shard,
                                                                   first.sp.value == "megatron"):
            raise TesseraError(f"adaptive sequence parallelism needs one tp/zero/dp_shard for every layer; "
                               f"layer {i} has {s.describe()}, layer 0 {first.describe()}")
        if s.ep != 1 or s.offload_optimizer or s.cp != 1:
            raise TesseraError(f"adaptive sequence parallelism does not run expert parallelism, context "
                               f"parallelism or offload; "
                               f"layer {i} has {s.describe()}")
    n = plan.world_size
    units = n // first.tp
    shard = 1 if first.zero == 0 else (first.dp_shard or units)
    if units % shard:
        shard = units
    # Megatron sequence parallelism is not carried over: its activation re-sharding at the
    # embedding and head assumes every rank holds a sequence of one length; Ulysses shards the
    # sequence here, and TP runs plain (and is priced plain).
    return Layout(num_ranks=n, tp=first.tp, shard=shard, megatron=False,
                  dtype=plan.workload.dtype, optimizer=plan.workload.optimizer)


def default_strategy(plan) -> Strategy:
    """The plan's own ZeRO stage (3 when it does not shard) and the blocks' recompute."""
    blocks = [s for s, layer in zip(plan.layers, plan.model.layers) if layer.kind in BLOCK_KINDS]
    rc = blocks[0].recompute.value if blocks else "none"
    zero = plan.layers[0].zero
    return Strategy(zero=zero if zero in (1, 2, 3) else 3, recompute=rc)


def cost_model_from_plan(plan, switching: bool = False) -> StrategySet:
    """The strategies of an adaptive run under a static plan (pipeline degree 1)."""
    return strategy_set(plan.model, plan.cluster, layout_of_plan(plan), default_strategy(plan), switching)


def cost_model_from_budget(model: ModelSpec, cluster: ClusterSpec, recompute: str = "selective",
                           dtype: str = "bf16", zero: int = 3, shard: int | None = None, tp: int = 1,
                           switching: bool = False) -> StrategySet:
    """Strategies on a layout given by hand: ZeRO over `shard` ranks (all by default) of `tp`-rank units."""
    units = cluster.num_gpus // tp
    layout = Layout(num_ranks=cluster.num_gpus, tp=tp, shard=(shard // tp if shard else units) if zero else 1,
                    dtype=dtype)
    return strategy_set(model, cluster, layout, Strategy(zero if zero else 3, recompute), switching)


def plan_sequence_cost(plan) -> tuple[float, float]:
    """(lin, attn): seconds per token and per token**2 that a document adds to one data-parallel
    replica's forward + backward under a static plan's own strategies (`layer_costs` of every
    layer at three (length, sequences) points, summed; the fixed part per micro-batch dropped): what
    the data loader balances ranks by (`runtime/balanced_data.py`)."""
    from ..cost.evaluate import plan_context

    base = plan_context(plan)
    rows = []
    for seq_len, per_replica in _FIT_POINTS:
        seqs = per_replica * plan.dp_of_batch
        wl = plan.workload.model_copy(update={"seq_len": seq_len, "global_batch": seqs, "seq_lens": ()})
        ctx = replace(base, workload=wl, micro_batch_seqs=seqs)
        total = 0.0
        for layer, s in zip(plan.model.layers, plan.layers):
            c = layer_costs(layer, StrategyTable.build([s]), ctx)
            total += float(c.fwd[0] + c.bwd[0])
        rows.append((per_replica * seq_len, per_replica * seq_len * seq_len, total))
    a = np.array([[1.0, t, q] for t, q, _ in rows])
    _, lin, attn = np.linalg.solve(a, np.array([r[2] for r in rows]))
    return max(float(lin), 0.0), max(float(attn), 0.0)
