"""Communication time: NCCL's own cost model for rings and trees, node-aware.

For a group of p ranks, message n bytes (the full, gathered size; for all-to-all, what each rank
sends in total), the group spread over `nodes` nodes with at least `local` members on each:

    ring   all_reduce      L_ring + 2 (p-1)/p * n / B        (reduce-scatter + all-gather)
           all_gather      L_ring +   (p-1)/p * n / B
           reduce_scatter  L_ring +   (p-1)/p * n / B
    tree   all_reduce      L_tree + 2 n / (c(n) * min(0.9 B, B_tree))     (more than 2 nodes)
    all_to_all             L + max(intra share / B_intra, inter share / B_inter)
    p2p                    n / B + a

all-reduce takes the faster of ring and tree, as NCCL does. The terms follow NCCL's tuning model
(NCCL src/graph/tuning.cc, `ncclTopoTuneModel` / `ncclTopoGetAlgoTime`):
- bus bandwidth B: inside a node the NVLink bandwidth; across nodes each member's own NIC
  carries one ring channel, so B = min(B_intra, local * B_inter) (a DP group with all 8 GPUs of
  each node uses all 8 NICs; a group of one GPU per node, e.g. data parallel beside tp = 8, uses
  one); `B_inter` is one NIC's achievable rate (`ClusterSpec.inter_node`);
- ring latency L_ring = base + (steps - inter steps) a_intra + (inter steps) a_inter, with steps =
  (p - 1) per pass (two passes for all-reduce) and inter steps = (nodes - 1) per pass; a
  multi-node all-reduce of a large message (n >= p / 16 * 64 KiB) pays 1.9 x L_ring (NCCL's
  "plateau effect of ring"). This is how rings lose bandwidth over many nodes: at fixed n, the
  per-step latency grows linearly with p while each step moves n / p bytes (a ZeRO-3 gather
  over 1,024 nodes pays ~10 ms of ring latency per collective);
- tree (double binary tree) latency L_tree = 2 ((p/nodes - 1) * 28 us + log2(nodes) * 50 us)
  (Tree / Simple `hwLat`: NVLink 28 us, network 50 us), bandwidth capped at `tree_bandwidth`
  (`maxTreeBw`, 80 GB/s), at half the bus bandwidth for an all-reduce (ratio .5) and times NCCL's
  `treeCorrectionFactor` c(n) for medium sizes (0.5 - 0.9 between 4 KiB and 128 MiB);
- base = `ClusterSpec.collective_latency` (NCCL `baseLat`, 8.4 us for Ring / Simple); a_intra,
  a_inter = the links' `latency`.
For all-to-all, the traffic to peers in other nodes crosses the network (each rank its own NIC).

A measured curve in `ClusterSpec.collectives` (from `tessera profile hardware`) for the same
collective, span and group size replaces the formula (log-log interpolation in message size;
beyond the measured range, the bandwidth of the nearest end point).

Rank layout: a mesh axis of `size` ranks with `stride` (product of the sizes of the axes inside
it) forms groups {base + j * stride}. `group_layout` enumerates the groups of one period of the
layout: the axis spans nodes when ANY of its groups does (all groups run at once, the step waits
for the slowest: tp = 6 on 8-GPU nodes puts ranks 6-11 on two nodes), `local` is the fewest
members any group has on one node it touches, `nodes` the most nodes a group touches.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from functools import lru_cache

import numpy as np

from ..spec.cluster import ClusterSpec, CollectiveCurve

_RING_FACTOR = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}
TREE_INTRA_LATENCY = 28e-6  # NCCL hwLat[NVLINK][Tree][Simple]
TREE_INTER_LATENCY = 50e-6  # NCCL hwLat[NET][Tree][Simple]
RING_PLATEAU = 1.9  # NCCL: multi-node ring all-reduce latency factor for large messages
# NCCL treeCorrectionFactor[Simple] for messages of 64 B x 2^i, i = 0..21 (1 from 128 MiB on).
_TREE_CORRECTION = (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .5, .5, .6, .6, .7, .8, .9)


@lru_cache(maxsize=4096)
def group_layout(size: int, stride: int, gpus_per_node: int) -> tuple[bool, int, int]:
    """(spans nodes, fewest members on one touched node, most nodes touched) over all the groups
    of an axis of `size` ranks spaced `stride` apart (see the module docstring)."""
    if size <= 1:
        return False, 1, 1
    block = size * stride
    period = block * gpus_per_node // math.gcd(block, gpus_per_node)
    spans, local, nodes = False, size, 1
    for start in range(0, period, block):
        for offset in range(stride):
            ranks = start + offset + stride * np.arange(size)
            _, counts = np.unique(ranks // gpus_per_node, return_counts=True)
            if len(counts) > 1:
                spans = True
            local, nodes = min(local, int(counts.min())), max(nodes, len(counts))
    return spans, local, nodes


def members_per_node(size: int, stride: int, gpus_per_node: int) -> int:
    """The fewest members a group of `size` ranks spaced `stride` apart has on one of its nodes."""
    return group_layout(size, stride, gpus_per_node)[1]


def spans_nodes(size: int, stride: int, gpus_per_node: int) -> bool:
    return group_layout(size, stride, gpus_per_node)[0]


def _curve_time(curve: CollectiveCurve, nbytes: float) -> float:
    xs, ys = curve.message_bytes, curve.seconds
    if nbytes <= xs[0]:
        return ys[0] if nbytes <= 0 else ys[0] * max(nbytes / xs[0], 1.0)
    if nbytes >= xs[-1]:
        return ys[-1] * nbytes / xs[-1]
    i = bisect_left(xs, nbytes)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    t = (math.log(nbytes) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))


def find_curve(cluster: ClusterSpec, collective: str, group_size: int, inter: bool) -> CollectiveCurve | None:
    span = "inter_node" if inter else "intra_node"
    best = None
    for c in cluster.collectives:
        if c.collective == collective and c.span == span:
            if c.group_size == group_size:
                return c
            if best is None or abs(c.group_size - group_size) < abs(best.group_size - group_size):
                best = c
    return best


def tree_correction(nbytes: np.ndarray) -> np.ndarray:
    """NCCL's treeCorrectionFactor (Simple protocol) for messages of `nbytes`."""
    index = np.clip(np.floor(np.log2(np.maximum(nbytes, 64.0) / 64.0)), 0, len(_TREE_CORRECTION)).astype(int)
    table = np.array(_TREE_CORRECTION + (1.0,))
    return table[index]


def _formula(cluster: ClusterSpec, collective: str, n: np.ndarray, p: int, stride: int) -> np.ndarray:
    """Seconds for `collective` of n bytes (array) over the groups of a (p, stride) axis."""
    spans, local, nodes = group_layout(p, stride, cluster.gpus_per_node)
    intra, inter = cluster.intra_node, cluster.inter_node
    curve = find_curve(cluster, collective, p, spans)
    if curve is not None:
        t = np.array([_curve_time(curve, float(x)) for x in np.ravel(n)]).reshape(np.shape(n))
        if curve.group_size != p and collective != "p2p":
            # Rescale a neighbouring group size by the ring factor (p-1)/p.
            t = t * ((p - 1) / p) / ((curve.group_size - 1) / curve.group_size)
        return t
    if collective == "p2p":
        link = inter if spans else intra
        return n / link.bandwidth + link.latency
    base = cluster.collective_latency
    if collective == "all_to_all":
        if not spans:
            return base + (p - 1) / p * n / intra.bandwidth + (p - 1) * intra.latency
        remote = (p - local) / p * n
        near = (local - 1) / p * n
        return base + np.maximum(remote / inter.bandwidth, near / intra.bandwidth) + (p - 1) * inter.latency
    passes = 2 if collective == "all_reduce" else 1
    bus = min(intra.bandwidth, local * inter.bandwidth) if spans else intra.bandwidth
    inter_steps = passes * (nodes - 1) if spans else 0
    latency = base + (passes * (p - 1) - inter_steps) * intra.latency + inter_steps * inter.latency
    if collective == "all_reduce" and spans:
        latency = np.where(n >= p / 16 * 65536, RING_PLATEAU * latency, latency)
    ring = latency + passes * (p - 1) / p * n / bus
    if collective != "all_reduce" or nodes <= 2:
        return ring
    tree_bus = min(0.9 * bus, cluster.tree_bandwidth)
    tree_latency = 2 * ((p / nodes - 1) * TREE_INTRA_LATENCY + math.log2(nodes) * TREE_INTER_LATENCY)
    tree = tree_latency + n / (0.5 * tree_bus * tree_correction(n))
    return np.minimum(ring, tree)


def collective_time(cluster: ClusterSpec, collective: str, nbytes: float, size: int,
                    stride: int = 1) -> float:
    """Seconds for one collective of `nbytes` over a group of `size` ranks spaced `stride` apart."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    return float(_formula(cluster, collective, np.array([float(nbytes)]), int(size), int(stride))[0])


def p2p_time(cluster: ClusterSpec, nbytes: float, inter: bool) -> float:
    """Point-to-point transfer between two ranks (pipeline activations)."""
    if nbytes <= 0:
        return 0.0
    curve = find_curve(cluster, "p2p", 2, inter)
    if curve is not None:
        return _curve_time(curve, nbytes)
    link = cluster.inter_node if inter else cluster.intra_node
    return nbytes / link.bandwidth + link.latency


def collective_times(cluster: ClusterSpec, collective: str, nbytes, size, stride):
    """`collective_time` over numpy arrays (broadcast together): the same formulas, vectorised.

    Used by the search to cost hundreds of candidate strategies at once; `collective_time` stays
    the scalar reference (tests check that both agree)."""
    nbytes, size, stride = np.broadcast_arrays(np.asarray(nbytes, dtype=float),
                                               np.asarray(size, dtype=np.int64),
                                               np.asarray(stride, dtype=np.int64))
    out = np.zeros(nbytes.shape)
    live = (size > 1) & (nbytes > 0)
    if not live.any():
        return out
    # Few distinct (size, stride) pairs: handle each group with array arithmetic on the bytes.
    pairs = set(zip(size[live].tolist(), stride[live].tolist()))
    for p, st in pairs:
        sel = live & (size == p) & (stride == st) if len(pairs) > 1 else live
        out[sel] = _formula(cluster, collective, nbytes[sel], int(p), int(st))
    return out
