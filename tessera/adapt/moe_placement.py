"""NetMoE sample placement (Liu et al., ICLR 2025): put each sample on the data-parallel rank where
its tokens' experts are, so that fewer all-to-all token copies cross nodes.

Geometry. A step's N samples are split over D data ranks, N / D each (the plan's data layout).
In a MoE layer, the stage ranks holding data rank d's rows (their tp / sp / finer-dp sub-blocks)
send each token-slot routed to expert e to the rank of their expert-parallel group that holds e
(runtime/expert_parallel.py). `crossing_matrix` gives X[d, e] in [0, 1], the fraction of d's
slots for expert e that leave their node (1 GPU node = `gpus_per_node` consecutive ranks).

Problem. Given routing counts c[i, e] (token-slots of sample i for expert e, summed over the MoE
layers), choose the data rank d(i) of every sample to
    minimise   sum_i c[i, :] . X[d(i), :]       (inter-node token-slots of the step's dispatch;
                                                 combine and both backward all-to-alls mirror it)
    subject to every rank holding exactly N / D samples.
The balance keeps every rank's loss the mean over the same number of tokens, so the step's loss
and gradients equal those without placement: only which rank runs a sample changes.

Method. Data ranks with equal rows of X are interchangeable (the "classes": for an expert-parallel
group spanning G nodes, the G node positions), so the problem is a transportation problem over
K classes with capacities N / D x (ranks in the class): x[i, k] in {0, 1}, sum_k x[i, k] = 1,
sum_i x[i, k] = cap_k. Its constraint matrix is totally unimodular, so a vertex of the LP
relaxation is an optimal placement: K = 1 needs nothing, K = 2 is a sort by c.X_0 - c.X_1 (exact),
and K > 2 is solved by HiGHS's dual simplex (scipy.optimize.linprog), whose objective is also the
bound; if the solver is unavailable or too slow a greedy by regret gives a placement, and the
bound tells how far from optimal it can be. Samples of a class are dealt to its ranks in order.

Routing is predicted (`RoutingTable`): the runtime cannot know a new batch's routing before its
forward, so it uses, per token id, the experts that token went to in previous steps (an
exponential average); NetMoE likewise decides from routing already observed. No torch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..plan import LayerStrategy


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
    """`ranks[d]`: the sample indices data rank d runs, in order; the cost in token-slots that cross
    nodes, with and without placement (samples in loader order, N / D consecutive per rank)."""

    ranks: list[list[int]]
    cost: float
    baseline: float
    bound: float
    seconds: float
    method: str

    @property
    def cut(self) -> float:
        """Fraction of the baseline's inter-node slots removed."""
        return 1.0 - self.cost / self.baseline if self.baseline > 0 else 0.0

    def order(self) -> list[int]:
        """The samples in rank order: row j of the placed batch is sample order()[j]."""
        return [i for rows in self.ranks for i in rows]


def place_samples(counts: np.ndarray, crossing: np.ndarray, exact_up_to: int = 512) -> Placement:
    """The placement of the module docstring for counts (N, E) and crossing (D, E)."""
    start = time.perf_counter()
    counts = np.asarray(counts, dtype=float)
    n, d = counts.shape[0], crossing.shape[0]
    if n % d:
        raise ValueError(f"{n} samples do not split evenly over {d} data ranks")
    per_rank = n // d
    baseline = inter_node_slots(counts, crossing)
    classes, rank_class = np.unique(np.round(crossing, 12), axis=0, return_inverse=True)
    rank_class = rank_class.ravel()
    k = len(classes)
    cost = counts @ classes.T  # (N, K)
    cap = np.bincount(rank_class, minlength=k) * per_rank
    relaxed = float(cost.min(1).sum())  # every sample in its best class, capacities ignored
    if k == 1:
        choice, method = np.zeros(n, dtype=int), "trivial"
    elif k == 2:
        choice, method = _two_classes(cost, cap), "sort"
    elif n <= exact_up_to:
        choice, method = _assignment(cost, cap), "assignment"
    else:
        choice, method = _chunked(cost, cap, exact_up_to), "chunked assignment"
    total = float(cost[np.arange(n), choice].sum())
    exact = method != "chunked assignment"
    ranks: list[list[int]] = [[] for _ in range(d)]
    members = [list(np.flatnonzero(rank_class == c)) for c in range(k)]
    for c in range(k):
        for j, i in enumerate(np.flatnonzero(choice == c)):
            ranks[members[c][j // per_rank]].append(int(i))
    return Placement(ranks=ranks, cost=total, baseline=baseline, bound=total if exact else relaxed,
                     seconds=time.perf_counter() - start, method=method)


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
        choice[a:b] = _assignment(cost[a:b], share)
        left = left - share
    return choice


def _split(cap: np.ndarray, take: int, total: int) -> np.ndarray:
    """`take` units of capacity, proportional to `cap` (which sums to `total`), in whole units."""
    want = cap * take / total
    share = np.floor(want).astype(int)
    for i in np.argsort(-(want - share), kind="stable")[:take - share.sum()]:
        share[i] += 1
    return share


class RoutingTable:
    """Per token id, the expected token-slots per expert over the MoE layers (an exponential
    average of what the previous steps routed): predicts a new sample's counts c[i, e]."""

    def __init__(self, vocab_size: int, num_experts: int, decay: float = 0.5):
        self.slots = np.zeros((vocab_size, num_experts))
        self.seen = np.zeros(vocab_size)
        self.decay = decay

    def update(self, tokens: np.ndarray, chosen: np.ndarray) -> None:
        """tokens (N, S) ids; chosen (L, N, S, k) expert ids the step's MoE layers routed them to."""
        self.apply(*self.observed(tokens, chosen, *self.slots.shape))

    @staticmethod
    def observed(tokens: np.ndarray, chosen: np.ndarray, vocab_size: int, num_experts: int):
        """(slots per token id and expert, occurrences per token id) of one process's routing."""
        tokens, chosen = np.asarray(tokens).ravel(), np.asarray(chosen)
        delta = np.zeros((vocab_size, num_experts))
        for layer in chosen.reshape(chosen.shape[0], -1, chosen.shape[-1]):
            np.add.at(delta, (np.repeat(tokens, layer.shape[-1]), layer.ravel()), 1.0)
        return delta, np.bincount(tokens, minlength=vocab_size).astype(float)

    def apply(self, delta: np.ndarray, seen: np.ndarray) -> None:
        """Merge the update of another process (`delta`: slots summed per token id, `seen`: occurrences)."""
        hit = seen > 0
        mean = np.zeros_like(delta)
        mean[hit] = delta[hit] / seen[hit, None]
        keep = np.where(self.seen > 0, self.decay, 0.0)[:, None]
        self.slots[hit] = keep[hit] * self.slots[hit] + (1 - keep[hit]) * mean[hit]
        self.seen += seen

    def predict(self, tokens: np.ndarray) -> np.ndarray:
        """c (N, E): the predicted token-slots per expert of each sample (unseen tokens: the mean)."""
        tokens = np.asarray(tokens)
        known = self.seen > 0
        prior = self.slots[known].mean(0) if known.any() else np.zeros(self.slots.shape[1])
        table = np.where(known[:, None], self.slots, prior)
        return table[tokens].sum(axis=1)


def inter_node_slots(counts: np.ndarray, crossing: np.ndarray, order: list[int] | None = None) -> float:
    """Inter-node token-slots of one dispatch when row j of the batch is sample order[j] (loader
    order when None), N / D consecutive rows per data rank."""
    counts = np.asarray(counts, dtype=float)
    n, d = counts.shape[0], crossing.shape[0]
    rows = counts if order is None else counts[np.asarray(order)]
    return float((rows * crossing[np.arange(n) // (n // d)]).sum())
