"""NetMoE sample placement (Liu et al., ICLR 2025): put each sample on the data-parallel rank where
its tokens' experts are, so that fewer all-to-all token copies cross nodes.

Geometry. A step's N samples are split over D data ranks, N / D each (the plan's data layout).
In a MoE layer, the stage ranks holding data rank d's rows (their tp / sp / finer-dp sub-blocks)
send each token-slot routed to expert e to the rank of their expert-parallel group that holds e
(runtime/expert_parallel.py). `crossing_matrix` gives X[d, e] in [0, 1], the fraction of d's
slots for expert e that leave their node (1 GPU node = `gpus_per_node` consecutive ranks).

Once per step (`place_samples`). Given routing counts c[i, e] (token-slots of sample i for expert
e, summed over the MoE layers), choose the data rank d(i) of every sample to
    minimise   sum_i c[i, :] . X[d(i), :]       (inter-node token-slots of the step's dispatch;
                                                 combine and both backward all-to-alls mirror it)
    subject to every rank holding exactly N / D samples.
The balance keeps every rank's loss the mean over the same number of tokens, so the step's loss
and gradients equal those without placement: only which rank runs a sample changes.

Per layer (`place_layer`; NetMoE places samples layer by layer). Attention is data parallel, so
a sample may run layer l+1 on another rank than layer l: the combine all-to-all of MoE layer l
delivers each token's expert outputs straight to the rank its sample runs next, and the rest of
the block's output (the residual stream, and a shared expert's output) moves there with one
more exchange. When the combine runs, layer l's routing c_l is known exactly; layer l+1's is
predicted (`LayerTransition`: from the experts each token chose in layer l). With p(i) the rank
sample i ran layer l on and g(p) its expert-parallel group (`LayerGeometry`), the next rank
d(i) minimises, per layer,
    sum_i  c_l[i] . C[g(p(i)), :, d(i)]   (combine: from the experts that served it, known)
         + ĉ_{l+1}[i] . X[d(i), :]        (the next layer's dispatch, predicted)
         + r_i Y[p(i), d(i)]              (moving the rest of its r_i rows)
under the same balance, so every layer's micro-batch is the same set of samples and the loss and
gradients stay those without placement. All terms count rows (one token's hidden vector) that
cross nodes; the backward mirrors every exchange.

Method. Both problems are transportation problems: data ranks whose cost columns are equal are
interchangeable (the "classes": e.g. for an expert-parallel group spanning G nodes, the G node
positions), x[i, k] in {0, 1}, sum_k x[i, k] = 1, sum_i x[i, k] = cap_k (N / D x ranks in class
k). The constraint matrix is totally unimodular, so an optimal assignment is an optimal
placement: K = 1 needs nothing, K = 2 is a sort by the cost difference (exact), K > 2 an N x N
assignment (class k repeated cap_k times) solved by scipy's Jonker-Volgenant
`linear_sum_assignment`; above `exact_up_to` samples (128), chunks of samples are assigned exactly
with their share of every capacity and `Placement.bound` (every sample in its best class) says
how far from optimal that can be. Samples of a class are dealt to its ranks keeping a sample on
its current rank where that rank is in its class (no move within a node that gains nothing).
Per layer, above `exact_up_to` samples each block of whole expert-parallel groups re-places its
own samples among its own ranks (then `bound` is the blocks' bound, not the whole problem's).

Routing is predicted (adapt/moe_routing.py): the runtime cannot know a new batch's routing before
its forward, so the step placement uses, per token id, the experts that token went to in
previous steps (`RoutingTable`), and the per-layer placement the experts its tokens chose in the
layer before (`LayerTransition`); NetMoE likewise decides from routing already observed. No torch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..plan import LayerStrategy
from .moe_routing import LayerTransition, RoutingTable, RoutingUpdate  # noqa: F401 (re-exported)

# Samples solved in one exact assignment: an N x N Jonker-Volgenant solve on few distinct columns
# takes up to hundreds of ms at N = 512 (many ties), chunks of 128 a few ms, within 2-3% of the cut.
EXACT_UP_TO = 128


def crossing_matrix(strategy: LayerStrategy, data_ranks: int, num_experts: int, gpus_per_node: int,
                    stage_offset: int = 0) -> np.ndarray:
    """X (data_ranks, E): the fraction of data rank d's token-slots for expert e that cross nodes in
    a MoE layer with `strategy` on a stage starting at global rank `stage_offset`."""
    s = strategy
    stage = s.dp * s.sp_degree * s.tp
    if s.dp % data_ranks:
        raise ValueError(f"the MoE layer's dp={s.dp} is not a multiple of the {data_ranks} data ranks")
    per = num_experts // s.ep
    x = np.zeros((data_ranks, num_experts))
    node = lambda r: (stage_offset + r) // gpus_per_node  # noqa: E731
    for r in range(stage):
        q, t = divmod(r, s.tp)
        d_layer = q // s.sp_degree
        d = d_layer // (s.dp // data_ranks)
        group = q // s.ep
        for e in range(num_experts):
            dest = (group * s.ep + e // per) * s.tp + t
            x[d, e] += node(dest) != node(r)
    return x / (stage // data_ranks)


@dataclass
class Placement:
    """`ranks[d]`: the sample indices data rank d runs, in order; the cost in rows that cross nodes,
    with and without placement (without: samples in loader order, N / D consecutive per rank, for
    `place_samples`; every sample staying where it is, for `place_layer`)."""

    ranks: list[list[int]]
    cost: float
    baseline: float
    bound: float
    seconds: float  # wall time of the solve
    method: str
    cpu_seconds: float = 0.0  # this process's CPU time of the solve (a loaded machine's wall time waits)

    @property
    def cut(self) -> float:
        """Fraction of the baseline's inter-node rows removed."""
        return 1.0 - self.cost / self.baseline if self.baseline > 0 else 0.0

    def order(self) -> list[int]:
        """The samples in rank order: row j of the placed batch is sample order()[j]."""
        return [i for rows in self.ranks for i in rows]

    def dest(self) -> np.ndarray:
        """(N,): the data rank of every sample."""
        out = np.empty(sum(len(r) for r in self.ranks), dtype=np.int64)
        for d, rows in enumerate(self.ranks):
            out[rows] = d
        return out


def place_samples(counts: np.ndarray, crossing: np.ndarray, exact_up_to: int = EXACT_UP_TO) -> Placement:
    """The once-per-step placement of the module docstring for counts (N, E) and crossing (D, E)."""
    start = time.perf_counter(), time.process_time()
    counts = np.asarray(counts, dtype=float)
    n, d = counts.shape[0], crossing.shape[0]
    if n % d:
        raise ValueError(f"{n} samples do not split evenly over {d} data ranks")
    baseline = inter_node_slots(counts, crossing)
    cost = counts @ crossing.T  # (N, D)
    return _place(cost, baseline, None, exact_up_to, start)


def _place(cost: np.ndarray, baseline: float, current: np.ndarray | None, exact_up_to: int,
           start: tuple[float, float] | None) -> Placement:
    """Assign N samples to D ranks (N / D each) minimising the sum of cost[i, d(i)] (timed from
    `start`, wall and CPU clocks, unless None)."""
    n, d = cost.shape
    per_rank = n // d
    classes, rank_class = np.unique(np.round(cost.T, 6), axis=0, return_inverse=True)  # equal columns: a class
    rank_class = rank_class.ravel()
    k = len(classes)
    class_cost = classes.T  # (N, K)
    cap = np.bincount(rank_class, minlength=k) * per_rank
    relaxed = float(class_cost.min(1).sum())  # every sample in its best class, capacities ignored
    if k == 1:
        choice, method = np.zeros(n, dtype=int), "trivial"
    elif k == 2:
        choice, method = _two_classes(class_cost, cap), "sort"
    elif n <= exact_up_to:
        choice, method = _assignment(class_cost, cap), "assignment"
    else:
        choice, method = _chunked(class_cost, cap, exact_up_to), "chunked assignment"
    total = float(class_cost[np.arange(n), choice].sum())
    exact = method != "chunked assignment"
    ranks = _deal(choice, rank_class, per_rank, current)
    wall, cpu = (time.perf_counter() - start[0], time.process_time() - start[1]) if start else (0.0, 0.0)
    return Placement(ranks=ranks, cost=total, baseline=baseline, bound=total if exact else relaxed,
                     seconds=wall, method=method, cpu_seconds=cpu)


def _deal(choice: np.ndarray, rank_class: np.ndarray, per_rank: int, current: np.ndarray | None) -> list[list[int]]:
    """Each class's samples to its ranks, per_rank each: a sample first to its current rank when
    that rank is in its class and has room, the others in sample order; rows in sample order."""
    ranks: list[list[int]] = [[] for _ in range(len(rank_class))]
    for c in range(int(rank_class.max()) + 1 if len(rank_class) else 0):
        members = np.flatnonzero(rank_class == c)
        chosen = np.flatnonzero(choice == c)
        left = []
        if current is not None:
            for i in chosen:
                home = int(current[i])
                if rank_class[home] == c and len(ranks[home]) < per_rank:
                    ranks[home].append(int(i))
                else:
                    left.append(int(i))
        else:
            left = [int(i) for i in chosen]
        free = (int(r) for r in members for _ in range(per_rank - len(ranks[r])))
        for i, r in zip(left, free):
            ranks[r].append(i)
    return [sorted(r) for r in ranks]


def _two_classes(cost: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Exact for K = 2: the cap[0] samples that gain most from class 0 go there."""
    gain = cost[:, 1] - cost[:, 0]
    choice = np.ones(len(cost), dtype=int)
    choice[np.argsort(-gain, kind="stable")[:cap[0]]] = 0
    return choice


def _assignment(cost: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Exact: the transportation problem as an N x N assignment (class k repeated cap_k times),
    solved by scipy's Jonker-Volgenant `linear_sum_assignment`."""
    from scipy.optimize import linear_sum_assignment

    columns = np.repeat(np.arange(len(cap)), cap)
    rows, cols = linear_sum_assignment(cost[:, columns])
    choice = np.empty(len(cost), dtype=int)
    choice[rows] = columns[cols]
    return choice


def _chunked(cost: np.ndarray, cap: np.ndarray, size: int) -> np.ndarray:
    """Large N: exact assignments on consecutive chunks of samples, each with its share of every
    class's capacity (the shares add up to cap); not optimal, `Placement.bound` says how close."""
    n = len(cost)
    chunks = -(-n // size)
    bounds = np.linspace(0, n, chunks + 1).round().astype(int)
    left = cap.copy()
    choice = np.empty(n, dtype=int)
    for c, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        share = left if c == chunks - 1 else _split(left, b - a, n - a)
        choice[a:b] = _assignment(cost[a:b], share) if len(share) > 2 else _two_classes(cost[a:b], share)
        left = left - share
    return choice


def _split(cap: np.ndarray, take: int, total: int) -> np.ndarray:
    """`take` units of capacity, proportional to `cap` (which sums to `total`), in whole units."""
    want = cap * take / total
    share = np.floor(want).astype(int)
    for i in np.argsort(-(want - share), kind="stable")[:take - share.sum()]:
        share[i] += 1
    return share


# --- per layer ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerGeometry:
    """Node crossings of one MoE layer (dp data ranks d, sp 1, tp ranks t; stage rank d * tp + t,
    expert-parallel group g(d) = d div ep holding expert e on its member e div (E / ep)), each a
    fraction over the tp ranks (each tp rank exchanges its own copy):
        dispatch[d, e]    a slot of d for e leaves d's node (X);
        combine[g, e, d]  the output of e in group g goes to another node than d (C);
        move[p, d]        a row moving from data rank p to d changes node (Y)."""

    dispatch: np.ndarray
    combine: np.ndarray
    move: np.ndarray
    group: np.ndarray  # (D,) the expert-parallel group of each data rank

    @classmethod
    def of(cls, strategy: LayerStrategy, num_experts: int, gpus_per_node: int,
           stage_offset: int = 0) -> "LayerGeometry":
        s = strategy
        if s.sp_degree != 1:
            raise ValueError(f"per-layer placement needs sp_degree=1 in MoE layers, not {s.sp_degree}")
        if num_experts % s.ep:
            raise ValueError(f"ep={s.ep} does not divide the layer's {num_experts} experts")
        per = num_experts // s.ep
        d = np.arange(s.dp)
        t = np.arange(s.tp)
        e = np.arange(num_experts)
        node = lambda r: (stage_offset + r) // gpus_per_node  # noqa: E731
        home = node(d[:, None] * s.tp + t[None, :])  # (D, T)
        groups = s.dp // s.ep
        g = np.arange(groups)
        expert_rank = (g[:, None, None] * s.ep + (e // per)[None, :, None]) * s.tp + t[None, None, :]  # (G, E, T)
        there = node(expert_rank)
        group = d // s.ep
        dispatch = (there[group] != home[:, None, :]).mean(-1)  # (D, E)
        combine = (there[:, :, None, :] != home[None, None, :, :]).mean(-1)  # (G, E, D)
        move = (home[:, None, :] != home[None, :, :]).mean(-1)  # (D, D)
        return cls(dispatch=dispatch, combine=combine, move=move, group=group)

    def costs(self, counts: np.ndarray, next_counts: np.ndarray | None, current: np.ndarray,
              rest_rows: np.ndarray, columns: np.ndarray | None = None) -> np.ndarray:
        """(N, D): the inter-node rows of sample i if it runs the next layer on data rank d (module
        docstring: combine + next dispatch + move); only the data ranks `columns` when given."""
        counts = np.asarray(counts, dtype=float)
        current = np.asarray(current)
        cols = np.arange(len(self.group)) if columns is None else np.asarray(columns)
        out = np.empty((len(counts), len(cols)))
        groups = self.group[current]
        for g in np.unique(groups):
            rows = groups == g
            out[rows] = counts[rows] @ self.combine[g][:, cols]
        if next_counts is not None:
            out += np.asarray(next_counts, dtype=float) @ self.dispatch[cols].T
        out += np.asarray(rest_rows, dtype=float)[:, None] * self.move[np.ix_(current, cols)]
        return out

    def dispatch_rows(self, counts: np.ndarray, where: np.ndarray) -> float:
        """Inter-node rows of one dispatch of samples placed on data ranks `where`."""
        return float((np.asarray(counts, dtype=float) * self.dispatch[np.asarray(where)]).sum())


def place_layer(geometry: LayerGeometry, counts: np.ndarray, next_counts: np.ndarray | None,
                current: np.ndarray, rest_rows: np.ndarray, exact_up_to: int = EXACT_UP_TO) -> Placement:
    """Where each sample runs the layer after this one (module docstring: per layer). counts (N, E)
    the slots of this layer (known), next_counts (N, E) the next MoE layer's predicted (None after
    the last), current (N,) the data rank each sample ran this layer on, rest_rows (N,) the rows a
    move carries. The baseline keeps every sample where it is."""
    start = time.perf_counter(), time.process_time()
    current = np.asarray(current, dtype=np.int64)
    n, d = len(current), len(geometry.group)
    if n % d or np.bincount(current, minlength=d).max() != n // d:
        raise ValueError(f"the current placement does not hold {n} samples evenly on {d} data ranks")
    if n <= exact_up_to:
        cost = geometry.costs(counts, next_counts, current, rest_rows)
        return _place(cost, float(cost[np.arange(n), current].sum()), current, exact_up_to, start)
    # Many samples: each block of whole expert-parallel groups (or one group) re-places the samples
    # it holds among its own ranks (a move to another group sends every combined row off its node).
    counts, rest_rows = np.asarray(counts, dtype=float), np.asarray(rest_rows, dtype=float)
    group_size = int(np.bincount(geometry.group).max())
    span = group_size * max(1, exact_up_to // (group_size * (n // d)))
    placed: list[list[int]] = [[] for _ in range(d)]
    cost = baseline = bound = 0.0
    method = ""
    for cols in np.split(np.arange(d), range(span, d, span)):
        rows = np.flatnonzero((current >= cols[0]) & (current <= cols[-1]))
        home = current[rows] - cols[0]
        sub = geometry.costs(counts[rows], None if next_counts is None else np.asarray(next_counts)[rows],
                             current[rows], rest_rows[rows], cols)
        part = _place(sub, float(sub[np.arange(len(rows)), home].sum()), home, exact_up_to, None)
        for j, members in enumerate(part.ranks):
            placed[cols[0] + j] = [int(rows[i]) for i in members]
        cost, baseline, bound, method = cost + part.cost, baseline + part.baseline, bound + part.bound, part.method
    return Placement(ranks=placed, cost=cost, baseline=baseline, bound=bound, seconds=time.perf_counter() - start[0],
                     method=f"{method} per block of {span} ranks", cpu_seconds=time.process_time() - start[1])


def simulate_layers(geometry: LayerGeometry, counts: np.ndarray, start: np.ndarray, rest_rows: np.ndarray,
                    predict=None, per_layer: bool = True, exact_up_to: int = EXACT_UP_TO) -> dict:
    """Inter-node rows of one micro-batch's forward through L MoE layers (counts (L, N, E) known
    routing; samples on data ranks `start` for the first layer): per layer its dispatch, its
    combine to where each sample runs next (re-placed by `place_layer` when `per_layer`, with
    the next layer's counts from `predict(l, counts[l])`, else staying) and the moves. Returns
    {"dispatch", "combine", "move": rows, "seconds": solve times}."""
    where = np.asarray(start, dtype=np.int64)
    out = {"dispatch": 0.0, "combine": 0.0, "move": 0.0, "seconds": [], "cpu_seconds": []}
    rest = np.asarray(rest_rows, dtype=float)
    for layer, c in enumerate(np.asarray(counts, dtype=float)):
        out["dispatch"] += geometry.dispatch_rows(c, where)
        new = where
        if per_layer:
            last = layer == len(counts) - 1
            nxt = None if last or predict is None else predict(layer, c)
            placed = place_layer(geometry, c, nxt, where, rest, exact_up_to)
            out["seconds"].append(placed.seconds)
            out["cpu_seconds"].append(placed.cpu_seconds)
            new = placed.dest()
        g = geometry.group[where]
        out["combine"] += float(np.einsum("ne,ne->", c, geometry.combine[g, :, new]))
        out["move"] += float((rest * geometry.move[where, new]).sum())
        where = new
    return out


def inter_node_slots(counts: np.ndarray, crossing: np.ndarray, order: list[int] | None = None) -> float:
    """Inter-node token-slots of one dispatch when row j of the batch is sample order[j] (loader
    order when None), N / D consecutive rows per data rank."""
    counts = np.asarray(counts, dtype=float)
    n, d = counts.shape[0], crossing.shape[0]
    rows = counts if order is None else counts[np.asarray(order)]
    return float((rows * crossing[np.arange(n) // (n // d)]).sum())
