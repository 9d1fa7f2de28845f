"""Communication time: an alpha-beta model per collective that knows when a group spans nodes.

For a group of p ranks, message n bytes (the full, gathered size; for all-to-all, what each rank
sends in total), link bandwidth B (bytes/s per device, one direction) and per-hop latency a:

    all_reduce      2 (p-1)/p * n / B + 2 (p-1) a        (ring: reduce-scatter + all-gather)
    all_gather      (p-1)/p * n / B + (p-1) a
    reduce_scatter  (p-1)/p * n / B + (p-1) a
    all_to_all      (p-1)/p * n / B + (p-1) a            (n: bytes each rank sends)
    p2p             n / B + a

A group that spans nodes runs at the inter-node bandwidth for ring collectives (the slowest hop
of the ring bounds it). For all-to-all, the traffic to peers in other nodes crosses the network:
time = max(intra share / B_intra, inter share / B_inter).

A measured curve in `ClusterSpec.collectives` (from `tessera profile hardware`) for the same
collective, span and group size replaces the formula (log-log interpolation in message size;
beyond the measured range, the bandwidth of the nearest end point).

Rank layout: a mesh axis of `size` ranks with `stride` (product of the sizes of the axes inside
it) has min(size, max(1, gpus_per_node // stride)) members per node.
"""
from __future__ import annotations

import math
from bisect import bisect_left

from ..spec.cluster import ClusterSpec, CollectiveCurve

_RING_FACTOR = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}


def members_per_node(size: int, stride: int, gpus_per_node: int) -> int:
    """How many members of a group of `size` ranks spaced `stride` apart share a node."""
    return max(1, min(size, gpus_per_node // stride)) if stride <= gpus_per_node else 1


def spans_nodes(size: int, stride: int, gpus_per_node: int) -> bool:
    return members_per_node(size, stride, gpus_per_node) < size


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


def collective_time(cluster: ClusterSpec, collective: str, nbytes: float, size: int,
                    stride: int = 1) -> float:
    """Seconds for one collective of `nbytes` over a group of `size` ranks spaced `stride` apart."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    local = members_per_node(size, stride, cluster.gpus_per_node)
    inter = local < size
    curve = find_curve(cluster, collective, size, inter)
    if curve is not None:
        t = _curve_time(curve, nbytes)
        if curve.group_size != size and collective != "p2p":
            # Rescale a neighbouring group size by the ring factor (p-1)/p.
            t *= ((size - 1) / size) / ((curve.group_size - 1) / curve.group_size)
        return t
    if collective == "p2p":
        link = cluster.inter_node if inter else cluster.intra_node
        return nbytes / link.bandwidth + link.latency
    p = size
    if collective == "all_to_all" and inter:
        remote = (p - local) / p * nbytes
        near = (local - 1) / p * nbytes
        return (max(remote / cluster.inter_node.bandwidth, near / cluster.intra_node.bandwidth)
                + (p - 1) * cluster.inter_node.latency)
    link = cluster.inter_node if inter else cluster.intra_node
    factor = _RING_FACTOR[collective]
    return factor * (p - 1) / p * nbytes / link.bandwidth + factor * (p - 1) * link.latency


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
    import numpy as np

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
        n = nbytes[sel]
        local = members_per_node(p, st, cluster.gpus_per_node)
        inter = local < p
        curve = find_curve(cluster, collective, p, inter)
        if curve is not None:
            t = np.array([_curve_time(curve, float(x)) for x in n])
            if curve.group_size != p and collective != "p2p":
                t *= ((p - 1) / p) / ((curve.group_size - 1) / curve.group_size)
        elif collective == "p2p":
            link = cluster.inter_node if inter else cluster.intra_node
            t = n / link.bandwidth + link.latency
        elif collective == "all_to_all" and inter:
            t = (np.maximum((p - local) / p * n / cluster.inter_node.bandwidth,
                            (local - 1) / p * n / cluster.intra_node.bandwidth)
                 + (p - 1) * cluster.inter_node.latency)
        else:
            link = cluster.inter_node if inter else cluster.intra_node
            f = _RING_FACTOR[collective]
            t = f * (p - 1) / p * n / link.bandwidth + f * (p - 1) * link.latency
        out[sel] = t
    return out
