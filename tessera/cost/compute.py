"""Compute time of a layer, per operation: GEMMs by shape, attention by its kernel, memory-bound
work by bytes over bandwidth (vectorised over candidate strategies).

GEMM of (m x k) @ (k x n), `batch` of them, on a device with a GEMM description (`sm_count`):

    t = max(2 m n k batch / (P e w(m, n) r(k)),  b (m k + k n + m n) batch / BW) + t_launch

P = peak FLOP/s of the dtype, e = `ClusterSpec.compute_efficiency` (the best large GEMM measured
on the device, see spec/presets/clusters.py), BW = achievable HBM bandwidth, b = bytes an element.
Two shape terms, from how cuBLAS/CUTLASS kernels run (NVIDIA, "Matrix Multiplication Background
User's Guide", tile and wave quantisation):
    w(m, n) = tiles / (ceil(tiles / SMs) SMs),  tiles = ceil(m / 128) ceil(n / 256) batch
              (wave quantisation: the last wave of output tiles leaves SMs idle);
    r(k)    = [k / (k + 128)] / [4096 / (4096 + 128)], at most 1
              (each tile's prologue and epilogue cost about two 64-deep k-steps of its main
              loop, amortised over k; normalised to the k = 4096-5120 of the measured best shapes).
So small micro-batches (small m) and narrow TP shards lose efficiency, and skinny GEMMs become
memory-bound: this is what makes the micro-batch size a real decision.

A layer's forward per micro-batch, t tokens on the device (after Ulysses), b = t / s sequences:
    linear     sum over `LayerSpec.matmuls` of GEMM(t, n', k') with n' = n / tp (column-parallel)
               or k' = k / tp (row-parallel); expert GEMMs see t top_k cap ep / E tokens each and
               run E / ep times; backward per GEMM: GEMM(t, k', n') (input gradient) +
               GEMM(k', n', t) (weight gradient, the zero-bubble W)
    attention  flash: F / (P a_f w_a), F = t s coeff / tp (causal FLOPs of the spec), backward
               2.5 F / (P a_b w_a) (FlashAttention's backward does 5 of the 2 forward matmuls'
               work); a_f, a_b = `DeviceSpec.attention_efficiency`, w_a = wave quantisation of its
               b x heads x ceil(s / 128) thread blocks; context parallel (ring attention over cp
               ranks, load-balanced): F / cp per rank in cp kernels (one per ring step) of
               b x heads x ceil(s / (cp 128)) thread blocks, cp - 1 more launches each way;
               unfused: batched GEMM(s, s, d) + GEMM(s, d, s) over b heads/(tp u) forward,
               GEMM(s, s, d) + 3 GEMM(s, d, s) backward, plus s^2 (score_bytes) / BW
    memory     t (elementwise_bytes_tp / tp + elementwise_bytes_replicated / tp_sp) / BW forward,
               twice that backward (a backward reads the input and the output gradient and
               writes the input gradient, and norms reduce their weight gradients)
    launches   kernels x t_launch forward, twice backward
Recompute adds the forward (full) or the attention core's forward (selective) to the backward.

A layer a model profile measured (`LayerSpec.compute_measured`), and any layer on a device
without a GEMM description (a CPU), is priced as before by its FLOPs:
    forward = tokens * (flops_per_token * linear_time_scale + attn_flops_coeff * s * attn_time_scale)
              / (tp * sp) / (P * compute_efficiency),   backward = 2 * forward
the measured scales standing for everything the layer does.
"""
from __future__ import annotations

import numpy as np

from ..spec.cluster import ClusterSpec
from ..spec.model import LayerSpec

BACKWARD_FACTOR = 2.0
ATTENTION_BACKWARD_FLOPS = 2.5
BACKWARD_BYTES_FACTOR = 2.0
TILE_K_OVERHEAD = 128
REFERENCE_K = 4096
ATTENTION_BLOCK = 128  # query rows per flash-attention thread block


def achieved_flops(cluster: ClusterSpec, dtype: str) -> float:
    """The best FLOP/s any GEMM reaches (an upper bound of every per-operation rate)."""
    return cluster.peak(dtype) * cluster.compute_efficiency


def per_operation(layer: LayerSpec, cluster: ClusterSpec) -> bool:
    """Whether `layer` is priced per operation (unmeasured, on a device with a GEMM description)."""
    return cluster.device.sm_count > 0 and not layer.compute_measured


def layer_forward_flops(layer: LayerSpec, seq_len: int, tokens: float) -> tuple[float, float]:
    """(linear FLOPs, attention-score FLOPs) of a forward over `tokens` tokens of length-`seq_len` sequences."""
    return tokens * layer.flops_per_token, tokens * layer.attn_flops_coeff * seq_len


def _waves(work_items, sms: int):
    items = np.maximum(np.asarray(work_items, dtype=float), 1.0)
    return items / (np.ceil(items / sms) * sms)


def gemm_seconds(cluster: ClusterSpec, dtype: str, elt: float, m, n, k, batch=1.0):
    """Seconds of `batch` GEMMs (m x k) @ (k x n) (see the module docstring); arrays broadcast."""
    dev = cluster.device
    m, n, k, batch = (np.maximum(np.asarray(x, dtype=float), 1.0) for x in (m, n, k, batch))
    flops = 2.0 * m * n * k * batch
    peak = cluster.peak(dtype) * cluster.compute_efficiency
    if dev.sm_count <= 0:
        return flops / peak
    tm, tn = dev.gemm_tile
    tiles = np.ceil(m / tm) * np.ceil(n / tn) * batch
    k_ramp = np.minimum(1.0, (k / (k + TILE_K_OVERHEAD)) / (REFERENCE_K / (REFERENCE_K + TILE_K_OVERHEAD)))
    compute = flops / (peak * _waves(tiles, dev.sm_count) * k_ramp)
    memory = elt * (m * k + k * n + m * n) * batch / dev.streaming_bandwidth
    return np.maximum(compute, memory) + dev.kernel_launch_s


def _shard(mm, tp):
    n = mm.n / tp if mm.shard == "col" else np.full(np.shape(tp), float(mm.n))
    k = mm.k / tp if mm.shard == "row" else np.full(np.shape(tp), float(mm.k))
    return n, k


def linear_seconds(layer: LayerSpec, cluster: ClusterSpec, dtype: str, elt: float, tokens, tp, ep):
    """(forward, input-gradient, weight-gradient) seconds of the layer's GEMMs, per strategy."""
    tokens, tp, ep = (np.asarray(x, dtype=float) for x in np.broadcast_arrays(tokens, tp, ep))
    fwd = dgrad = wgrad = np.zeros(tokens.shape)
    for mm in layer.matmuls:
        n, k = _shard(mm, tp)
        m, count = tokens, 1.0
        if mm.expert:
            count = layer.num_experts / ep
            m = tokens * layer.top_k * layer.capacity_factor * ep / layer.num_experts
        fwd = fwd + count * gemm_seconds(cluster, dtype, elt, m, n, k)
        dgrad = dgrad + count * gemm_seconds(cluster, dtype, elt, m, k, n)
        wgrad = wgrad + count * gemm_seconds(cluster, dtype, elt, k, n, m)
    return fwd, dgrad, wgrad


def attention_seconds(layer: LayerSpec, cluster: ClusterSpec, dtype: str, elt: float, seqs, seq_len: int,
                      tp, sp, cp=1):
    """(forward, backward) seconds of the attention core over `seqs` sequences of `seq_len` per
    replica, heads split over tp * sp ranks (Ulysses gives each rank whole sequences), the causal
    work split evenly over cp ranks (ring attention, one kernel per ring step)."""
    seqs, tp, sp, cp = (np.asarray(x, dtype=float) for x in np.broadcast_arrays(seqs, tp, sp, cp))
    if not (layer.num_heads and layer.attn_flops_coeff):
        return np.zeros(seqs.shape), np.zeros(seqs.shape)
    dev = cluster.device
    heads = layer.num_heads / (tp * sp)
    if layer.attn_kernel == "unfused":
        s, d = float(seq_len), float(layer.head_dim or layer.attn_flops_coeff / (2 * layer.num_heads))
        batch = seqs * heads
        scores = batch * s * s * (elt / 2.0)
        fwd = (gemm_seconds(cluster, dtype, elt, s, s, d, batch) + gemm_seconds(cluster, dtype, elt, s, d, s, batch)
               + scores * layer.score_bytes_fwd / dev.streaming_bandwidth)
        bwd = (gemm_seconds(cluster, dtype, elt, s, s, d, batch) + 3 * gemm_seconds(cluster, dtype, elt, s, d, s, batch)
               + scores * layer.score_bytes_bwd / dev.streaming_bandwidth)
        return fwd / cp, bwd / cp  # (context parallelism is searched with flash attention only)
    flops = seqs * seq_len * layer.attn_flops_coeff * seq_len / (tp * sp * cp)
    eff_f, eff_b = dev.attention_efficiency
    eff_f, eff_b = eff_f or cluster.compute_efficiency, eff_b or cluster.compute_efficiency
    waves = _waves(seqs * heads * np.ceil(seq_len / (cp * ATTENTION_BLOCK)), dev.sm_count)
    peak = cluster.peak(dtype)
    launches = cp * dev.kernel_launch_s
    return (flops / (peak * eff_f * waves) + launches,
            ATTENTION_BACKWARD_FLOPS * flops / (peak * eff_b * waves) + launches)


def memory_bound_seconds(layer: LayerSpec, cluster: ClusterSpec, elt: float, tokens, tp, tp_sp):
    """(forward, backward) seconds of the layer's element-wise work and kernel launches."""
    dev = cluster.device
    moved = tokens * (layer.elementwise_bytes_tp / tp + layer.elementwise_bytes_replicated / tp_sp) * (elt / 2.0)
    fwd = moved / dev.streaming_bandwidth + layer.kernels * dev.kernel_launch_s
    return fwd, BACKWARD_BYTES_FACTOR * fwd


def layer_compute_time(layer: LayerSpec, seq_len: int, tokens: float, shards: int,
                       cluster: ClusterSpec, dtype: str, recompute: str = "none") -> tuple[float, float]:
    """(forward seconds, backward seconds incl. recompute) by the FLOPs formula (the one a measured
    layer uses, see the module docstring) on one device holding 1/`shards` of the work: linear in
    tokens and in tokens x seq_len, as the per-step sequence planner (`tessera.adapt`) needs."""
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
