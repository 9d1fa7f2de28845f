"""NetMoE placement evaluated on routing traces, for benchmarks/moe.py (no torch).

For one trace and one geometry, the inter-node rows of a micro-batch's forward through the MoE
layers (dispatch and combine of every layer, and any moves; the backward mirrors them, so the cut
is the step's) under four policies, `simulate_layers` from tessera.adapt.moe_placement:
  none          samples in loader order, never moved;
  step          placed once per micro-batch from the routing predicted per token id
                (`RoutingTable` of every layer's routing, trained on earlier steps of the trace),
                then never moved;
  layer         placed for the first MoE layer from its routing predicted per token id (a
                `RoutingTable` of that layer's routing), then re-placed in every MoE layer from the
                layer's routing and the next layer's predicted (`LayerTransition`, from earlier
                steps): what `moe_placement="layer"` runs;
  layer oracle  as layer with the next layer's routing known (a bound on the predictor).
The residual rides the combine (runtime/moe_placement.py), so moves cost no rows (dropless).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera.adapt.moe_placement import LayerGeometry, place_samples, simulate_layers
from tessera.adapt.moe_routing import LayerTransition, RoutingTable
from tessera.plan import LayerStrategy

POLICIES = ("none", "step", "layer", "layer oracle")


@dataclass
class Pool:
    """Samples to draw micro-batches from: per-layer counts (n, L, E) and token ids (n, S)."""

    counts: np.ndarray
    tokens: np.ndarray | None
    table: RoutingTable | None
    predict: object  # (layer, counts (N, E)) -> next layer's (N, E)
    first_table: RoutingTable | None = None  # the first MoE layer's routing only (per-layer placement)


def layer_counts(chosen: np.ndarray, experts: int) -> np.ndarray:
    """(steps, L, N, E) token-slots per sample and expert in every layer of chosen (steps, L, N, S, k)."""
    steps, layers, n = chosen.shape[:3]
    flat = chosen.reshape(steps, layers, n, -1).astype(np.int64)
    index = flat + experts * np.arange(steps * layers * n).reshape(steps, layers, n, 1)
    return np.bincount(index.ravel(), minlength=steps * layers * n * experts).reshape(steps, layers, n, experts)


def trace_pool(trace: dict, experts: int, top_k: int, vocab: int, warm_fraction: float = 0.5,
               buckets: int | None = None) -> Pool:
    """The later steps of a recorded trace; the predictors learn from the earlier ones only."""
    chosen, tokens = trace["chosen"], trace["tokens"]
    steps, layers = chosen.shape[:2]
    warm = int(steps * warm_fraction)
    table = RoutingTable(vocab, experts, buckets=buckets)
    first = RoutingTable(vocab, experts, buckets=buckets)
    transition = LayerTransition(layers, experts, top_k)
    for s in range(warm):
        table.update(tokens[s], chosen[s])
        first.update(tokens[s], chosen[s][:1])
        transition.update(*LayerTransition.observed(chosen[s], experts))
    counts = layer_counts(chosen[warm:], experts).transpose(0, 2, 1, 3).reshape(-1, layers, experts)
    return Pool(counts=counts.astype(float), tokens=tokens[warm:].reshape(-1, tokens.shape[-1]), table=table,
                predict=transition.predict, first_table=first)


def synthetic_pool(samples: int, layers: int, experts: int, top_k: int, tokens: int, seed: int) -> Pool:
    """Skewed synthetic routing with layer-to-layer structure: sample i's preference over experts
    in layer 0 is half a Zipf popularity shared by all and half its own Dirichlet(0.2) draw; in
    layer l+1 it is p_l T_l, T_l a fixed sparse transition (each expert leads to one expert with
    0.8 and another with 0.2, as tokens of the recorded traces follow a few paths), mixed 50/50
    with a fresh Dirichlet(0.2) draw. Counts are multinomial. The predictors know T_l (what
    LayerTransition learns from token-level routing) but not a sample's own draws; the step
    placement predicts each sample from the popularity only (no token ids)."""
    rng = np.random.default_rng(seed)
    popularity = rng.permutation(1.0 / np.arange(1, experts + 1))
    popularity /= popularity.sum()
    moves = []
    for _ in range(layers - 1):
        t = np.zeros((experts, experts))
        t[np.arange(experts), rng.permutation(experts)] += 0.8
        t[np.arange(experts), rng.permutation(experts)] += 0.2
        moves.append(t)
    own = rng.dirichlet(np.full(experts, 0.2), size=samples)
    counts = np.zeros((samples, layers, experts))
    for layer in range(layers):
        p = 0.5 * popularity + 0.5 * own
        counts[:, layer] = np.stack([rng.multinomial(tokens * top_k, row) for row in p])
        if layer < layers - 1:
            own = 0.5 * own @ moves[layer] + 0.5 * rng.dirichlet(np.full(experts, 0.2), size=samples)

    def predict(layer, c):
        return 0.5 * c @ moves[layer] + 0.5 * c.sum(1, keepdims=True) * popularity

    return Pool(counts=counts, tokens=None, table=None, predict=predict)


def evaluate(pool: Pool, strategy: LayerStrategy, experts: int, gpus_per_node: int, per_rank: int, batches: int,
             seed: int = 0) -> dict:
    """Mean inter-node rows per micro-batch forward under each policy, and the solve times."""
    import scipy.optimize  # noqa: F401  (the solver's import, once per process: not a solve's time)

    geometry = LayerGeometry.of(strategy, experts, gpus_per_node)
    d = strategy.dp
    n = d * per_rank
    rng = np.random.default_rng(seed)
    rows = {p: 0.0 for p in POLICIES}
    bound = 0.0
    times = {"step": [], "layer": []}
    cpu = {"step": [], "layer": []}
    for _ in range(batches):
        idx = rng.choice(len(pool.counts), n, replace=n > len(pool.counts))
        c = pool.counts[idx].transpose(1, 0, 2)  # (L, N, E)
        loader = np.arange(n) // per_rank
        rest = np.zeros(n)  # dropless: the residual rides the combine
        predicted = pool.table.predict(pool.tokens[idx]) if pool.table is not None else \
            np.tile(c.sum(0).mean(0), (n, 1))
        placed = place_samples(predicted, geometry.dispatch)
        start = placed.dest()
        times["step"].append(placed.seconds)
        cpu["step"].append(placed.cpu_seconds)
        if pool.first_table is not None:  # per layer: the step's placement serves the first MoE layer
            first = place_samples(pool.first_table.predict(pool.tokens[idx]), geometry.dispatch)
            first_start = first.dest()
            times["step"].append(first.seconds)
            cpu["step"].append(first.cpu_seconds)
        else:
            first_start = start
        for policy in POLICIES:
            if policy == "none":
                r = simulate_layers(geometry, c, loader, rest, per_layer=False)
            elif policy == "step":
                r = simulate_layers(geometry, c, start, rest, per_layer=False)
            elif policy == "layer":
                r = simulate_layers(geometry, c, first_start, rest, predict=pool.predict)
                times["layer"] += r["seconds"]
                cpu["layer"] += r["cpu_seconds"]
            else:
                r = simulate_layers(geometry, c, first_start, rest, predict=lambda layer, _, c=c: c[layer + 1])
            rows[policy] += (r["dispatch"] + r["combine"] + r["move"]) / batches
        bound += placement_bound(geometry, c, per_rank) / batches
    return {"rows": rows, "bound": bound, "times": times, "cpu": cpu, "samples": n, "classes": _classes(geometry)}


def placement_bound(geometry: LayerGeometry, counts: np.ndarray, per_rank: int, iterations: int = 200) -> float:
    """A lower bound on the inter-node rows of one micro-batch's forward under ANY placement that
    keeps every rank at `per_rank` samples in every layer, even knowing every layer's routing
    (counts (L, N, E)) in advance: the bound on the cut that no predictor can beat.

    Relaxation: a sample may take any data rank d at every position t = 0..L (before layer t's
    dispatch; after layer t-1's combine), at cost X[d] . c_t (dispatch of layer t from d) +
    Cmin[d] . c_{t-1} (layer t-1's combine into d from whichever expert group crosses least,
    Cmin[d, e] = min_g C[g, e, d]); moves are free; ranks with equal rows are a class k, which
    holds cap_k = per_rank x its ranks at every position. Dropping the capacities into the cost
    with multipliers lambda (t, k) leaves a shortest path per sample; by weak duality
        rows >= sum_i min_path_i(lambda) - sum_{t,k} lambda_tk cap_k   for every lambda,
    maximised by subgradient steps (any iterate is a valid bound)."""
    e = geometry.dispatch.shape[1]
    rows = np.concatenate([geometry.dispatch, geometry.combine.min(0).T], 1)  # (D, 2E): X[d], Cmin[d]
    classes, rank_class = np.unique(np.round(rows, 12), axis=0, return_inverse=True)
    cap = np.bincount(rank_class.ravel(), minlength=len(classes)) * per_rank
    c = np.asarray(counts, dtype=float)
    layers, n = c.shape[:2]
    pos = np.zeros((n, layers + 1, len(classes)))
    pos[:, :layers] += np.einsum("lne,ke->nlk", c, classes[:, :e])
    pos[:, 1:] += np.einsum("lne,ke->nlk", c, classes[:, e:])
    lam = np.zeros((layers + 1, len(classes)))
    best, scale = 0.0, pos.mean()
    for it in range(iterations):
        cost = pos + lam[None]
        f = cost[:, 0]
        for t in range(1, layers + 1):
            f = f.min(1, keepdims=True) + cost[:, t]
        best = max(best, float(f.min(1).sum() - (lam * cap[None]).sum()))
        # Occupancy of the relaxed optimum (forward pass of the argmin path, back-tracked).
        occupancy = np.zeros_like(lam)
        g = [cost[:, 0]]
        for t in range(1, layers + 1):
            g.append(g[-1].min(1, keepdims=True) + cost[:, t])
        k = g[-1].argmin(1)
        occupancy[layers] = np.bincount(k, minlength=len(classes))
        for t in range(layers - 1, -1, -1):
            k = g[t].argmin(1)  # moves are free: the best prefix at t whatever comes next
            occupancy[t] = np.bincount(k, minlength=len(classes))
        lam += scale / np.sqrt(1 + it) * (occupancy - cap[None]) / n
    return best


def _classes(geometry: LayerGeometry) -> int:
    return len(np.unique(np.round(geometry.dispatch, 12), axis=0))


def specialisation(pool: Pool) -> float:
    """Mean over layers and experts of the standard deviation, across samples, of a sample's share
    of its slots on that expert (0 when every sample routes alike)."""
    share = pool.counts / np.maximum(pool.counts.sum(-1, keepdims=True), 1)
    return float(share.std(0).mean())
