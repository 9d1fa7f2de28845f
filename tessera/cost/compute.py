"""Compute time of a layer from its FLOPs.

    forward  = tokens * (flops_per_token + attn_flops_coeff * seq_len) / (tp * sp) / F
    backward = 2 * forward
where F = peak FLOP/s of the dtype * achievable efficiency (`ClusterSpec.compute_efficiency`,
measured by `tessera profile`). Recompute adds one forward (full) or the attention core
(selective) to the backward. A measured model profile scales the linear and attention terms separately
(`LayerSpec.linear_time_scale`, `attn_time_scale`: measured / predicted, fitted by `tessera.profile`).
"""
from __future__ import annotations

from ..spec.cluster import ClusterSpec
from ..spec.model import LayerSpec

BACKWARD_FACTOR = 2.0


def achieved_flops(cluster: ClusterSpec, dtype: str) -> float:
    return cluster.peak(dtype) * cluster.compute_efficiency


def layer_forward_flops(layer: LayerSpec, seq_len: int, tokens: float) -> tuple[float, float]:
    """(linear FLOPs, attention-score FLOPs) of a forward over `tokens` tokens of length-`seq_len` sequences."""
    return tokens * layer.flops_per_token, tokens * layer.attn_flops_coeff * seq_len


def layer_compute_time(layer: LayerSpec, seq_len: int, tokens: float, shards: int,
                       cluster: ClusterSpec, dtype: str, recompute: str = "none") -> tuple[float, float]:
    """(forward seconds, backward seconds incl. recompute) on one device holding 1/`shards` of the work."""
    linear_scale, attn_scale = layer.linear_time_scale, layer.attn_time_scale
    lin, att = layer_forward_flops(layer, seq_len, tokens)
    rate = achieved_flops(cluster, dtype) * shards
    fwd = (lin * linear_scale + att * attn_scale) / rate
    bwd = BACKWARD_FACTOR * fwd
    if recompute == "full":
        bwd += fwd
    elif recompute == "selective":
        bwd += (att * attn_scale * layer.selective_attn_fraction
                + tokens * layer.selective_flops_per_token * linear_scale) / rate
    return fwd, bwd
