"""Memory per device: model states, activations and buffers of a layer under a strategy.

All functions take numpy arrays of strategy fields (one entry per candidate strategy), so the
search costs a whole candidate set at once and `evaluate` uses the very same formulas.

Model states (bytes), with P_d = dense params / tp and P_e = expert params / (tp * ep):
    params    = pb * (P_d / S3 + P_e / S3e)          pb = 2 (bf16) or 4 (fp32 workload)
    grads     = pb * (P_d / S2 + P_e / S2e)          (gradients kept in the working dtype)
    optimizer = ob * (P_d / S1 + P_e / S1e)          ob = 12 for AdamW in mixed precision
                                                     (fp32 master + m + v); 0 if offloaded
where S_k is the ZeRO shard degree S (dp, or dp_shard under HSDP) when zero >= k, else 1
(ZeRO-1 shards the optimizer, ZeRO-2 also gradients, ZeRO-3 also parameters), and for the
expert part S_ke = gcd(S, dp * sp / ep): experts are replicated only over dp * sp / ep ranks.

Activations per in-flight micro-batch (Korthikanti et al. 2022), t tokens on the device
(t = micro-batch sequences per replica * seq_len / ulysses degree):
    none       t * (act_tp / tp + act_replicated / tp_sp)     tp_sp = tp with Megatron SP, else 1
    selective  t * ((act_tp - act_selective) / tp + act_replicated / tp_sp)
    full       t * act_input / tp_sp                           (only the block input is kept)
For a GPT block this is s b h (34 - 2) without TP (no dropout masks), s b h (8 + 24 / tp) with TP
and s b h 32 / tp with TP + SP: the paper's formulas without the dropout masks and with flash
attention (no s^2 term).

Transient buffer of a layer (the peak while its backward runs):
    buf = 2 * pb * (P_d + P_e)  if zero == 3  (its own and the prefetched next layer's weights)
        + t * act_none          if full recompute (its activations replayed for its backward)
A stage's buffer is the largest `buf` of its layers plus the device's `reserved_bytes`.
"""
from __future__ import annotations

import numpy as np

from ..spec.model import LayerSpec
from ..spec.workload import Workload
from .schedule import in_flight

RC_NONE, RC_SELECTIVE, RC_FULL = 0, 1, 2

__all__ = ["RC_NONE", "RC_SELECTIVE", "RC_FULL", "in_flight", "model_state_bytes",
           "activation_bytes", "buffer_bytes", "expert_shard"]


def expert_shard(shard, dp, sp, ep):
    """ZeRO shard degree of expert states: gcd(S, dp * sp / ep)."""
    return np.gcd(np.asarray(shard, dtype=np.int64), (np.asarray(dp) * np.asarray(sp)) // np.asarray(ep))


def model_state_bytes(layer: LayerSpec, workload: Workload, tp, ep, zero, shard, expert_shard_deg, offload):
    """(params, grads, optimizer) bytes on one device, arrays over strategies."""
    tp, ep, zero = np.asarray(tp), np.asarray(ep), np.asarray(zero)
    pd = layer.dense_params / tp
    pe = layer.expert_params / (tp * ep)
    pb, ob = workload.param_bytes, workload.optimizer_bytes

    def sharded(k):
        s = np.where(zero >= k, shard, 1)
        se = np.where(zero >= k, expert_shard_deg, 1)
        return pd / s + pe / se

    params = pb * sharded(3)
    grads = pb * sharded(2)
    optimizer = np.where(np.asarray(offload, dtype=bool), 0.0, ob * sharded(1))
    return params, grads, optimizer


def activation_bytes(layer: LayerSpec, tokens, tp, megatron_sp, recompute):
    """Bytes one in-flight micro-batch keeps on one device (tokens: per device, after Ulysses)."""
    tp = np.asarray(tp, dtype=float)
    tp_sp = np.where(np.asarray(megatron_sp, dtype=bool), tp, 1.0)
    rc = np.asarray(recompute)
    none = layer.act_bytes_tp / tp + layer.act_bytes_replicated / tp_sp
    selective = (layer.act_bytes_tp - layer.act_bytes_selective) / tp + layer.act_bytes_replicated / tp_sp
    full = layer.act_bytes_input / tp_sp
    per_token = np.where(rc == RC_FULL, full, np.where(rc == RC_SELECTIVE, selective, none))
    return tokens * per_token


def buffer_bytes(layer: LayerSpec, workload: Workload, tokens, tp, ep, megatron_sp, zero, recompute):
    """Transient bytes while this layer's backward runs (see the module docstring)."""
    tp, ep = np.asarray(tp), np.asarray(ep)
    gathered = workload.param_bytes * (layer.dense_params / tp + layer.expert_params / (tp * ep))
    replay = activation_bytes(layer, tokens, tp, megatron_sp, RC_NONE)
    return (np.where(np.asarray(zero) == 3, 2.0 * gathered, 0.0)
            + np.where(np.asarray(recompute) == RC_FULL, replay, 0.0))
