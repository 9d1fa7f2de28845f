"""What expert parallelism costs: the all-to-alls of a MoE layer, routing skew, node crossing.

What the runtime does (runtime/expert_parallel.py), per MoE layer and micro-batch, on every rank of
an expert-parallel group of p = ep ranks (stride tp in the rank layout):
    forward   counts exchange: an all-to-all of E integers (8 bytes each);
              dispatch: an all-to-all of n bytes;  combine: an all-to-all of n bytes back;
              [router load-balancing loss on] an all-reduce of E integers over the dp * sp ranks;
    backward  the two token all-to-alls again (gradients, splits swapped);
              full or selective recompute replays the forward's three all-to-alls first.
n = t * k * h * b: the token-slots of the rank's t tokens (t = its (batch, sequence) piece; under
tensor parallelism every tp rank of the group routes the same tokens), k experts per token, h the
hidden size, b bytes per activation element. Dropless routing sends k slots per token on average;
a capacity factor c caps what an expert serves.

Routing skew s (`LayerSpec.routing_skew`, >= 1): the busiest rank of the group receives s times
the mean slots (and sends s times the mean back), so it bounds each token all-to-all and computes
s times the mean expert FLOPs; with a capacity factor c the load is at most c (min(s, c)). Without
expert parallelism every rank runs every expert on its own tokens: no skew.

Node crossing: a group spanning nodes sends (p - m) / p of n across the network under uniform
routing (m = members per node, comm.py); `LayerSpec.a2a_internode_scale` (< 1 with NetMoE sample
placement, adapt/moe_placement.py) scales that share:
    time = max(scale (p - m)/p * n s / B_inter, (m - 1)/p * n s / B_intra) + (p - 1) a_inter.
A measured all-to-all curve (a profile) replaces the formula, times s.

`routing_skew` measures s from a routing trace; `ep_collectives` lists the collectives of one MoE
layer and micro-batch, with their bytes, for a count of what the runtime issues. No torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..spec.cluster import ClusterSpec
from ..spec.model import LayerSpec, ModelSpec
from .comm import collective_times, find_curve, members_per_node

COUNT_BYTES = 8  # int64 routing counts


def slot_bytes(layer: LayerSpec, tokens, act_elt: int):
    """n: bytes of one token all-to-all on one rank (mean routing)."""
    return np.asarray(tokens, dtype=float) * layer.top_k * layer.hidden * act_elt


def load_factor(layer: LayerSpec) -> float:
    """The busiest rank's slots over the mean: min(skew, capacity factor)."""
    return layer.routing_skew if layer.dropless else min(layer.routing_skew, layer.capacity_factor)


def all_to_all_times(cluster: ClusterSpec, nbytes, size, stride, internode_scale: float = 1.0):
    """Seconds of one all-to-all (n bytes per rank) over `size` ranks spaced `stride` apart, with
    the inter-node share scaled by `internode_scale` (module docstring); arrays broadcast."""
    base = collective_times(cluster, "all_to_all", nbytes, size, stride)
    if internode_scale == 1.0:
        return base
    n, p, st = np.broadcast_arrays(np.asarray(nbytes, dtype=float), np.asarray(size), np.asarray(stride))
    out = np.array(base, dtype=float, copy=True).reshape(n.shape)
    for size_, stride_ in set(zip(p.ravel().tolist(), st.ravel().tolist())):
        local = members_per_node(size_, stride_, cluster.gpus_per_node)
        if size_ <= 1 or local >= size_ or find_curve(cluster, "all_to_all", size_, True) is not None:
            continue
        sel = (p == size_) & (st == stride_) & (n > 0)
        remote = internode_scale * (size_ - local) / size_ * n[sel] / cluster.inter_node.bandwidth
        near = (local - 1) / size_ * n[sel] / cluster.intra_node.bandwidth
        out[sel] = np.maximum(remote, near) + (size_ - 1) * cluster.inter_node.latency
    return out


def moe_times(layer: LayerSpec, t, cluster: ClusterSpec, tokens, act_elt: int, compute_fwd):
    """(forward, backward) extra seconds per micro-batch of a MoE layer under the strategies of
    table `t` (cost/layer.py StrategyTable): its all-to-alls and the skewed expert compute.
    `tokens`: the rank's tokens per micro-batch; `compute_fwd`: the layer's forward compute
    seconds, of which the experts' FLOP share runs (skew - 1) times longer on the busiest rank."""
    ep, tp = np.asarray(t.ep), np.asarray(t.tp)
    skew = np.where(ep > 1, load_factor(layer), 1.0)
    one = all_to_all_times(cluster, slot_bytes(layer, tokens, act_elt) * skew, ep, tp, layer.a2a_internode_scale)
    counts = collective_times(cluster, "all_to_all", COUNT_BYTES * layer.num_experts, ep, tp)
    forward = 2 * one + counts
    replay = np.where(np.asarray(t.recompute) > 0, forward, 0.0)  # selective and full replay them
    extra = (skew - 1.0) * expert_share(layer) * np.asarray(compute_fwd, dtype=float)
    return forward + extra, 2 * one + replay + 2 * extra


def expert_share(layer: LayerSpec) -> float:
    """The experts' share of a MoE layer's forward FLOPs per token (sequence term left out)."""
    expert_flops = 2.0 * layer.top_k * layer.expert_params / max(1, layer.num_experts)
    return min(1.0, expert_flops / layer.flops_per_token) if layer.flops_per_token else 0.0


@dataclass(frozen=True)
class Collective:
    """One collective on one rank: `nbytes` it sends (all-to-all, its own share included) or reduces
    (all-reduce), over `group` ranks `stride` apart, in the forward or the backward."""

    op: str
    nbytes: float
    group: int
    stride: int
    phase: str
    what: str


def ep_collectives(layer: LayerSpec, strategy, tokens: float, act_elt: int, aux_loss: bool) -> list[Collective]:
    """The collectives one MoE layer issues per micro-batch on one rank (module docstring), mean
    routing: `tokens` the rank's tokens, `aux_loss` whether the load-balancing loss is on."""
    s = strategy
    out = []
    forward = []
    if aux_loss and s.dp * s.sp_degree > 1:
        forward.append(Collective("all_reduce", COUNT_BYTES * layer.num_experts, s.dp * s.sp_degree, s.tp,
                                  "forward", "routing counts (load-balancing loss)"))
    if s.ep > 1:
        n = float(slot_bytes(layer, tokens, act_elt))
        forward += [Collective("all_to_all", COUNT_BYTES * layer.num_experts, s.ep, s.tp, "forward", "counts"),
                    Collective("all_to_all", n, s.ep, s.tp, "forward", "dispatch"),
                    Collective("all_to_all", n, s.ep, s.tp, "forward", "combine")]
        out += [Collective("all_to_all", n, s.ep, s.tp, "backward", "combine gradient"),
                Collective("all_to_all", n, s.ep, s.tp, "backward", "dispatch gradient")]
    replay = [Collective(c.op, c.nbytes, c.group, c.stride, "backward", f"{c.what} (recompute)")
              for c in forward] if str(getattr(s.recompute, "value", s.recompute)) != "none" else []
    return forward + replay + out


def routing_skew(counts, ep: int) -> float:
    """Skew from a routing trace: counts[..., E] token-slots per expert (any leading axes: steps,
    layers); the mean over the leading entries of max over ep ranks / mean over ep ranks, with rank
    i holding experts [i E/ep, (i+1) E/ep)."""
    c = np.asarray(counts, dtype=float)
    per_rank = c.reshape(-1, ep, c.shape[-1] // ep).sum(-1)
    mean = per_rank.mean(-1)
    ok = mean > 0
    return float((per_rank.max(-1)[ok] / mean[ok]).mean()) if ok.any() else 1.0


def with_routing(model: ModelSpec, skew: float | None = None, internode_scale: float | None = None) -> ModelSpec:
    """`model` with every MoE layer's routing skew and / or inter-node all-to-all scale replaced."""
    update = {k: v for k, v in (("routing_skew", skew), ("a2a_internode_scale", internode_scale)) if v is not None}
    layers = tuple(layer.model_copy(update=update) if layer.num_experts else layer for layer in model.layers)
    return model.model_copy(update={"layers": layers})
