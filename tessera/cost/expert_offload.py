"""APTMoE expert offload (Wei et al., SC'24): where each expert computes when the experts live in
host memory, for GPUs with little memory and a slow host link.

Per MoE layer and pass (forward, backward) of a micro-batch, expert e with n_e token-slots either
  - is brought (G): its weights W_e cross the host link to the GPU (prefetched while the layer's
    attention runs) and the GPU computes it; the backward brings them again and sends the weight
    gradient W_e back to the host (where the optimizer keeps the expert states); or
  - stays (C): its n_e token rows go to the host (n_e h b bytes), the host computes it, the output
    rows come back; the backward moves the output gradient down and the input gradient up.
Link directions, GPU and host compute run concurrently (double-buffered, as APTMoE pipelines them),
so a pass takes the busiest of the four resources, plus the first brought expert's transfer that
the attention cannot hide:
    forward   up   = sum_G W_e + sum_C n_e h b          (host -> GPU)
              down = sum_C n_e h b                       (GPU -> host)
              gpu  = attention + sum_G f n_e / F_gpu;  host = sum_C f n_e / F_host
    backward  up   = sum_G W_e + sum_C n_e h b;  down = sum_G W_e + sum_C n_e h b
              gpu  = 2 attention + 2 sum_G f n_e / F_gpu;  host = 2 sum_C f n_e / F_host
    T_pass = max(up / B, down / B, gpu, host) + max(0, min_G W_e / B - attention)
f = 2 * (expert parameters) FLOPs per token-slot, B the link's bytes/s each way, b bytes per
activation element. Baselines: "offload all" brings every expert (ZeRO-Offload style parameter
streaming); "host all" computes every expert on the host.

The decision minimises T_forward + T_backward per layer: every subset for up to 12 experts,
otherwise the best prefix of the experts sorted by load (the experts with the most tokens gain the
most from the GPU for the same weight transfer). Loads come from routing (`expert_loads`): a
routing trace, or k slots per token spread with a skew. No torch.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from ..spec.cluster import ClusterSpec
from ..spec.model import LayerSpec, ModelSpec
from ..spec.workload import Workload
from .compute import achieved_flops

GPU, HOST = "gpu", "host"


@dataclass(frozen=True)
class HostSpec:
    """The host side of one GPU: its share of host compute (FLOP/s in the working dtype) and of
    the host link (bytes/s each way)."""

    flops: float
    link_bandwidth: float


@dataclass(frozen=True)
class LayerOffload:
    """One MoE layer's decision and its predicted seconds per micro-batch (forward + backward)."""

    where: tuple[str, ...]  # per expert: "gpu" (brought) or "host"
    seconds: float
    offload_all_s: float
    host_all_s: float


@dataclass(frozen=True)
class OffloadPlan:
    """Per MoE layer (in model order) the decision; totals per micro-batch and per step."""

    layers: tuple[LayerOffload, ...]
    micro_batches: int

    @property
    def step_s(self) -> float:
        return self.micro_batches * sum(layer.seconds for layer in self.layers)

    @property
    def offload_all_s(self) -> float:
        return self.micro_batches * sum(layer.offload_all_s for layer in self.layers)

    @property
    def host_all_s(self) -> float:
        return self.micro_batches * sum(layer.host_all_s for layer in self.layers)

    def to_json_dict(self) -> dict:
        return {"micro_batches": self.micro_batches,
                "layers": [{"where": list(layer.where), "seconds": layer.seconds} for layer in self.layers]}


def expert_loads(tokens: int, layer: LayerSpec, skew: float = 1.0) -> np.ndarray:
    """Token-slots per expert for `tokens` tokens: k per token, the hottest expert `skew` times the
    mean and the others evenly below it (skew in [1, E])."""
    e = layer.num_experts
    mean = tokens * layer.top_k / e
    hot = min(skew, e) * mean
    rest = (tokens * layer.top_k - hot) / (e - 1) if e > 1 else 0.0
    return np.array([hot] + [rest] * (e - 1))


def pass_times(layer: LayerSpec, loads: np.ndarray, on_gpu: np.ndarray, gpu_flops: float, host: HostSpec,
               attention_s: float, act_elt: int, param_elt: int) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of one layer for placements `on_gpu` (M, E) bool (or one (E,))."""
    g = np.atleast_2d(np.asarray(on_gpu, dtype=bool))
    w = param_elt * layer.expert_params / layer.num_experts
    f = 2.0 * layer.expert_params / layer.num_experts
    b = host.link_bandwidth
    rows = loads * layer.hidden * act_elt
    brought = g.sum(1)
    host_rows = (~g) @ rows
    fill = np.where(brought > 0, max(0.0, w / b - attention_s), 0.0)
    gpu_fwd = attention_s + f * (g @ loads) / gpu_flops
    host_fwd = f * ((~g) @ loads) / host.flops
    up = w * brought + host_rows
    fwd = np.maximum.reduce([up / b, host_rows / b, gpu_fwd, host_fwd]) + fill
    bwd = np.maximum.reduce([up / b, up / b, 2 * gpu_fwd, 2 * host_fwd]) + fill  # down = up in backward
    return fwd, bwd


def decide_layer(layer: LayerSpec, loads: np.ndarray, gpu_flops: float, host: HostSpec, attention_s: float,
                 act_elt: int, param_elt: int) -> LayerOffload:
    """The fastest placement of one layer's experts (module docstring)."""
    e = layer.num_experts
    if e <= 12:
        masks = np.array(list(itertools.product((False, True), repeat=e)), dtype=bool)
    else:
        order = np.argsort(-loads, kind="stable")
        masks = np.zeros((e + 1, e), dtype=bool)
        for j in range(1, e + 1):
            masks[j, order[:j]] = True
    fwd, bwd = pass_times(layer, loads, masks, gpu_flops, host, attention_s, act_elt, param_elt)
    total = fwd + bwd
    best = int(np.argmin(total))
    ends = [int(np.flatnonzero(masks.all(1))[0]), int(np.flatnonzero(~masks.any(1))[0])]
    return LayerOffload(where=tuple(GPU if x else HOST for x in masks[best]), seconds=float(total[best]),
                        offload_all_s=float(total[ends[0]]), host_all_s=float(total[ends[1]]))


def plan_expert_offload(model: ModelSpec, cluster: ClusterSpec, workload: Workload, host: HostSpec,
                        micro_batch_tokens: int, loads: np.ndarray | None = None, skew: float = 1.0,
                        micro_batches: int = 1) -> OffloadPlan:
    """APTMoE's decision for every MoE layer of `model` on one GPU of `cluster` (the layers it
    holds) with `micro_batch_tokens` tokens per micro-batch; `loads` (layers, E) from a routing
    trace, else `expert_loads` with `skew`."""
    gpu_flops = achieved_flops(cluster, workload.dtype)
    act_elt = param_elt = workload.param_bytes
    moe = [layer for layer in model.layers if layer.num_experts]
    out = []
    for i, layer in enumerate(moe):
        expert_flops = 2.0 * layer.top_k * layer.expert_params / layer.num_experts
        attention_s = micro_batch_tokens * (layer.flops_per_token - expert_flops
                                            + layer.attn_flops_coeff * workload.seq_len) / gpu_flops
        lay = loads[i] if loads is not None else expert_loads(micro_batch_tokens, layer, skew)
        out.append(decide_layer(layer, np.asarray(lay, dtype=float), gpu_flops, host, attention_s, act_elt, param_elt))
    return OffloadPlan(layers=tuple(out), micro_batches=micro_batches)
