"""Cost of one sequence under Ulysses sequence parallelism of degree d (vectorised over sequences).

A group of d ranks runs a packed set of sequences (one packed sequence per micro-batch, a
per-document causal mask). With L a sequence's length and Tk the group's total tokens:

    time(group)   = alpha_d + sum_s c(L_s, d)
    c(L, d)       = (lin * L + attn * L**2) / d  +  beta_d * L
    memory(group) = act * Tk / d   <=   budget

- `lin`, `attn`: seconds per token and per token^2 on one device, forward + backward (incl. the
  plan's recompute), summed over the layers with `cost.compute.layer_compute_time`.
- `alpha_d + beta_d * Tk`: the Ulysses all-to-alls, 4 in forward (q, k, v, output) and 4 in
  backward per block (4 more when full recompute replays the forward), each rank sending Tk/d
  tokens of its heads; `cost.comm.collective_time` over a block of d consecutive ranks (within a
  node for d <= gpus_per_node, spanning d/gpus_per_node nodes beyond). The collective is affine in
  the message size (latency + bytes/bandwidth); a measured curve is linearised between 1 and 64 MiB.
- `act`: activation bytes per token kept for backward over all layers (see `activation_bytes_per_token`).
- `budget`: device memory - framework reserve - model states (parameters, gradients, optimizer)
  of the static plan, which are the same whatever the per-step groups are.

Data-parallel traffic overlaps compute as in the planner's cost model (`cost.layer`), with
overlapped(c, x) = c + (slowdown - 1) min(c, x) + max(0, x - c):
- per micro-batch, ZeRO-3's parameter all-gather under the forward (`zero_fwd_s`) and all-gather +
  gradient reduce-scatter under the backward (`zero_bwd_s`; ZeRO-2: the reduce-scatter), so a
  micro-batch whose slowest group computes t seconds (a `backward_share` of it in backward) takes
  `micro_batch_time(t)`;
- once per step, the gradient sync (`step_sync_s`: the HSDP replica all-reduce, or ZeRO-0/1's
  reduction) queued after the last micro-batch's backward traffic (`step_time`).

No torch import.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..cost.comm import collective_time
from ..cost.compute import layer_compute_time
from ..cost.layer import overlap_extra
from ..cost.memory import RC_FULL, RC_NONE, RC_SELECTIVE, activation_bytes
from ..errors import TesseraError
from ..spec.cluster import ClusterSpec
from ..spec.model import LayerKind, LayerSpec, ModelSpec

BLOCK_KINDS = (LayerKind.DECODER, LayerKind.MOE_DECODER, LayerKind.ENCODER)
_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_LINEARISE_BYTES = (2.0**20, 2.0**26)


def activation_bytes_per_token(layers: tuple[LayerSpec, ...], recompute: tuple[str, ...],
                               dtype: str = "bf16") -> float:
    """Bytes per token held for backward across all layers (TP degree 1, pipeline degree 1):
    `cost.memory.activation_bytes` of every layer (none: act_tp + act_replicated; selective: less
    act_selective; full: act_input only), plus, with full recompute, the largest layer's full set
    while its forward is replayed (the token-dependent part of the search's transient buffer).
    Activation fields are for 16-bit activations; fp32 doubles them."""
    codes = {"none": RC_NONE, "selective": RC_SELECTIVE, "full": RC_FULL}
    kept, replay = 0.0, 0.0
    for layer, rc in zip(layers, recompute):
        rc = rc if layer.kind in BLOCK_KINDS else "none"
        kept += float(activation_bytes(layer, 1.0, 1, False, codes[rc]))
        if rc == "full":
            replay = max(replay, float(activation_bytes(layer, 1.0, 1, False, RC_NONE)))
    return (kept + replay) * _DTYPE_BYTES[dtype] / 2


def gathered_weight_bytes(model: ModelSpec, param_bytes: int) -> float:
    """ZeRO-3 transient: a layer's gathered weights and the prefetched next layer's (largest layer)."""
    return 2.0 * param_bytes * max(layer.params for layer in model.layers)


def power_of_two_degrees(num_devices: int) -> np.ndarray:
    """1, 2, 4, ... up to the largest power of two <= num_devices."""
    return 2 ** np.arange(int(math.log2(num_devices)) + 1)


def ulysses_degrees(model: ModelSpec, num_devices: int) -> np.ndarray:
    """The power-of-two degrees <= num_devices that split every attention layer's heads evenly:
    Ulysses gives each rank whole heads, so a degree above the head count cannot run."""
    degrees = power_of_two_degrees(num_devices)
    heads = [layer.num_heads for layer in model.layers if layer.kind in BLOCK_KINDS and layer.num_heads]
    return np.array([d for d in degrees if all(h % d == 0 for h in heads)], dtype=degrees.dtype)


def kv_head_repeats(num_heads: int, num_kv_heads: int, degree: int) -> int:
    """Ulysses repeats kv heads the fewest times that lets them split over `degree` ranks."""
    if num_kv_heads == 0 or degree <= 1:
        return 1
    group = num_heads // num_kv_heads
    for r in range(1, group + 1):
        if group % r == 0 and (num_kv_heads * r) % degree == 0:
            return r
    return group


@dataclass(frozen=True)
class SeqCostModel:
    """Per-sequence time and memory at each power-of-two SP degree (see the module docstring)."""

    num_devices: int
    degrees: np.ndarray  # (D,) ints 1, 2, 4, ...
    lin_s_per_token: float
    attn_s_per_token2: float
    a2a_alpha_s: np.ndarray  # (D,) seconds per group per micro-batch
    a2a_beta_s_per_token: np.ndarray  # (D,) seconds per token of the group
    act_bytes_per_token: float
    budget_bytes: float
    zero_fwd_s: float = 0.0  # ZeRO traffic under each micro-batch's forward
    zero_bwd_s: float = 0.0  # ... and under its backward
    step_sync_s: float = 0.0  # gradient sync once per step, after the last backward's traffic
    overlap_slowdown: float = 1.0
    backward_share: float = 2.0 / 3.0  # of a group's time spent in backward

    # --- construction ------------------------------------------------------------------------
    @classmethod
    def build(cls, model: ModelSpec, cluster: ClusterSpec, budget_bytes: float,
              recompute: str | tuple[str, ...] = "selective", dtype: str = "bf16",
              num_devices: int | None = None, zero_traffic: "ZeroTraffic | None" = None) -> "SeqCostModel":
        n = num_devices or cluster.num_gpus
        rc = (recompute,) * len(model.layers) if isinstance(recompute, str) else tuple(recompute)
        if len(rc) != len(model.layers):
            raise ValueError(f"{len(rc)} recompute settings for a model of {len(model.layers)} layers")
        if budget_bytes <= 0:
            raise TesseraError(
                f"no device memory is left for activations (budget {budget_bytes / 2**30:.1f} GiB): "
                "shard the model states further (ZeRO-3) or use more devices")
        lin = attn = lin_bwd = 0.0
        for layer, r in zip(model.layers, rc):
            r = r if layer.kind in BLOCK_KINDS else "none"
            f0, b0 = layer_compute_time(layer, 0, 1.0, 1, cluster, dtype, r)
            f1, b1 = layer_compute_time(layer, 1, 1.0, 1, cluster, dtype, r)
            lin += f0 + b0
            lin_bwd += b0
            attn += (f1 + b1) - (f0 + b0)
        zt = zero_traffic or ZeroTraffic()
        degrees = ulysses_degrees(model, n)
        alpha, beta = cls._all_to_all_coefficients(model, cluster, rc, dtype, degrees)
        return cls(num_devices=n, degrees=degrees, lin_s_per_token=lin, attn_s_per_token2=attn,
                   a2a_alpha_s=alpha, a2a_beta_s_per_token=beta,
                   act_bytes_per_token=activation_bytes_per_token(model.layers, rc, dtype),
                   budget_bytes=float(budget_bytes), zero_fwd_s=zt.forward_s, zero_bwd_s=zt.backward_s,
                   step_sync_s=zt.step_s, overlap_slowdown=cluster.overlap_slowdown,
                   backward_share=lin_bwd / lin if lin > 0 else 2.0 / 3.0)

    @staticmethod
    def _all_to_all_coefficients(model, cluster, recompute, dtype, degrees):
        nbytes = _DTYPE_BYTES[dtype]
        alpha = np.zeros(len(degrees))
        beta = np.zeros(len(degrees))
        for i, d in enumerate(int(x) for x in degrees):
            if d == 1:
                continue
            t1, t2 = (collective_time(cluster, "all_to_all", b, d) for b in _LINEARISE_BYTES)
            per_byte = (t2 - t1) / (_LINEARISE_BYTES[1] - _LINEARISE_BYTES[0])
            latency = max(0.0, t1 - per_byte * _LINEARISE_BYTES[0])
            for layer, rc in zip(model.layers, recompute):
                if layer.kind not in BLOCK_KINDS or not layer.num_heads:
                    continue
                head_dim = layer.hidden // layer.num_heads
                q_dim = layer.num_heads * head_dim
                kv_dim = layer.num_kv_heads * head_dim * kv_head_repeats(layer.num_heads, layer.num_kv_heads, d)
                passes = 3 if rc == "full" else 2  # forward, backward, and the replayed forward
                dims = passes * (2 * q_dim + 2 * kv_dim)  # q, k, v and the output, per pass
                alpha[i] += passes * 4 * latency
                beta[i] += dims * nbytes / d * per_byte  # each rank sends Tk/d tokens
        return alpha, beta

    # --- evaluation --------------------------------------------------------------------------
    def micro_batch_time(self, slowest_s: float) -> float:
        """A micro-batch whose slowest group computes `slowest_s`, with its ZeRO traffic overlapped."""
        bwd = self.backward_share * slowest_s
        return (slowest_s + overlap_extra(slowest_s - bwd, self.zero_fwd_s, self.overlap_slowdown)
                + overlap_extra(bwd, self.zero_bwd_s, self.overlap_slowdown))

    def step_time(self, slowest_s) -> float:
        """Micro-batches run in this order (slowest group times); the gradient sync follows the last
        one's backward traffic, and only what outlasts that backward is exposed."""
        if len(slowest_s) == 0:
            return 0.0
        bwd, s = self.backward_share * slowest_s[-1], self.overlap_slowdown
        sync = (overlap_extra(bwd, self.zero_bwd_s + self.step_sync_s, s)
                - overlap_extra(bwd, self.zero_bwd_s, s))
        return sum(self.micro_batch_time(t) for t in slowest_s) + sync

    @property
    def busy_floor_s(self) -> float:
        """Group time below which a micro-batch waits on its ZeRO traffic: shortening its groups
        further gains only the overlap slowdown."""
        fwd_share = 1.0 - self.backward_share
        return max(self.zero_fwd_s / fwd_share if fwd_share > 0 else 0.0,
                   self.zero_bwd_s / self.backward_share if self.backward_share > 0 else 0.0)

    def degree_index(self, degree: int) -> int:
        return int(np.searchsorted(self.degrees, degree))

    def compute_time(self, lens) -> np.ndarray:
        """Seconds of compute of each sequence on one device (all degrees divide this)."""
        lens = np.asarray(lens, dtype=np.float64)
        return self.lin_s_per_token * lens + self.attn_s_per_token2 * lens * lens

    def seq_time(self, lens) -> np.ndarray:
        """(n, D): c(L, d) = compute / d + beta_d * L, for each sequence and degree."""
        lens = np.asarray(lens, dtype=np.float64)
        return (self.compute_time(lens)[:, None] / self.degrees[None, :]
                + lens[:, None] * self.a2a_beta_s_per_token[None, :])

    def group_time(self, lens, degree: int) -> float:
        """alpha_d + sum c(L_s, d) for a group of `degree` ranks running these sequences."""
        lens = np.asarray(lens, dtype=np.float64)
        if lens.size == 0:
            return 0.0
        i = self.degree_index(degree)
        return float(self.a2a_alpha_s[i] + self.seq_time(lens)[:, i].sum())

    def token_capacity(self, degree) -> np.ndarray | float:
        """Most tokens a group of `degree` ranks holds in one micro-batch."""
        return self.budget_bytes * np.asarray(degree, dtype=np.float64) / self.act_bytes_per_token

    def group_memory(self, lens, degree: int) -> float:
        """Activation bytes per device of a group running these sequences in one micro-batch."""
        return self.act_bytes_per_token * float(np.sum(lens)) / degree

    def min_degree(self, lens) -> np.ndarray:
        """Smallest power-of-two degree that holds each sequence alone; 0 where none does."""
        lens = np.asarray(lens, dtype=np.float64)
        cap = self.token_capacity(self.degrees)
        fits = lens[:, None] <= cap[None, :]
        first = np.argmax(fits, axis=1)
        return np.where(fits.any(axis=1), self.degrees[first], 0)

    def check_fits(self, lens) -> None:
        lens = np.asarray(lens)
        bad = self.min_degree(lens) == 0
        if bad.any():
            longest = int(lens[bad].max())
            cap = float(self.token_capacity(self.degrees[-1]))
            raise TesseraError(
                f"a sequence of {longest} tokens does not fit in memory even over all "
                f"{self.degrees[-1]} devices (at most {int(cap)} tokens); use more devices, "
                "recompute, or a shorter length cap")


# --- from a static plan, or from a memory budget -------------------------------------------------


@dataclass(frozen=True)
class ZeroTraffic:
    """Seconds of data-parallel traffic: under each micro-batch's forward and backward, and once
    per step (see `zero_traffic`)."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    step_s: float = 0.0


def zero_traffic(params: float, cluster: ClusterSpec, zero: int, num_devices: int,
                 param_bytes: int = 2, shard: int | None = None) -> ZeroTraffic:
    """The data-parallel traffic of ZeRO-`zero` as the planner's cost model (`cost.layer`) has it.

    ZeRO shards the model states over groups of `shard` consecutive ranks (all of them by default;
    fewer is hybrid sharding, HSDP) and replicates them across the num_devices / shard groups.
    Per micro-batch: ZeRO-3 gathers the parameters in forward, and again in backward with the
    gradient reduce-scatter; ZeRO-2 reduce-scatters the gradients in backward. Once per step: the
    all-reduce across the replicas of each shard (HSDP); ZeRO-0's all-reduce over all ranks;
    ZeRO-1's reduce-scatter + all-gather; ZeRO-2's all-gather of the updated parameters."""
    nbytes = params * param_bytes
    shard = shard or num_devices
    replicas = num_devices // shard
    ag = collective_time(cluster, "all_gather", nbytes, shard)
    rs = collective_time(cluster, "reduce_scatter", nbytes, shard)
    across = collective_time(cluster, "all_reduce", nbytes / shard, replicas, stride=shard)
    if zero >= 3:
        return ZeroTraffic(ag, ag + rs, across)
    if zero == 2:
        return ZeroTraffic(0.0, rs, ag + across)
    if zero == 1:
        return ZeroTraffic(0.0, 0.0, rs + ag + across)
    return ZeroTraffic(0.0, 0.0, collective_time(cluster, "all_reduce", nbytes, num_devices))


def model_state_bytes_per_device(params: float, num_devices: int, zero: int, param_bytes: int = 2,
                                 optimizer_bytes: int = 12) -> float:
    """Parameters + gradients + optimizer state per device under ZeRO over `num_devices` ranks."""
    shard = lambda stage: num_devices if zero >= stage else 1  # noqa: E731
    return params * (param_bytes / shard(3) + param_bytes / shard(2) + optimizer_bytes / shard(1))


def cost_model_from_budget(model: ModelSpec, cluster: ClusterSpec, budget_bytes: float | None = None,
                           recompute: str = "selective", dtype: str = "bf16", zero: int = 3,
                           num_devices: int | None = None, optimizer_bytes: int = 12,
                           shard: int | None = None) -> SeqCostModel:
    """Cost model for ZeRO-`zero` sharded over groups of `shard` ranks (all by default); the
    activation budget defaults to device memory - reserve - the model states left on each device."""
    n = num_devices or cluster.num_gpus
    shard = shard or n
    if n % shard:
        raise TesseraError(f"ZeRO shard group of {shard} ranks does not divide {n} devices")
    pbytes = _DTYPE_BYTES[dtype]
    if budget_bytes is None:
        states = model_state_bytes_per_device(model.num_params, shard, zero, pbytes, optimizer_bytes)
        if zero >= 3:
            states += gathered_weight_bytes(model, pbytes)
        budget_bytes = cluster.device.memory_bytes - cluster.device.reserved_bytes - states
    traffic = zero_traffic(model.num_params, cluster, zero, n, pbytes, shard)
    return SeqCostModel.build(model, cluster, budget_bytes, recompute, dtype, n, traffic)


def cost_model_from_plan(plan) -> SeqCostModel:
    """Cost model for per-step groups under a static plan (pipeline and tensor degree 1).

    The budget is device memory - reserve - the plan's model states (from its prediction when it
    has one, else computed with ZeRO sharding over each layer's dp * sp ranks); the recompute
    setting of every layer is the plan's."""
    if plan.pipeline.degree != 1 or any(s.tp != 1 for s in plan.layers):
        raise TesseraError("adaptive sequence parallelism needs a plan without pipeline or tensor "
                           "parallelism (pp=1, tp=1); make one with ZeRO and Ulysses only")
    w = plan.workload
    n = plan.world_size
    if plan.prediction is not None:
        peak = max(plan.prediction.stage_memory, key=lambda m: m.total)
        states = peak.params + peak.grads + peak.optimizer + peak.buffers
    else:
        states = 0.0
        for layer, s in zip(plan.model.layers, plan.layers):
            states += model_state_bytes_per_device(layer.params, s.shard_degree * s.sp_degree,
                                                   s.zero, w.param_bytes,
                                                   0 if s.offload_optimizer else w.optimizer_bytes)
        if any(s.zero >= 3 for s in plan.layers):
            states += gathered_weight_bytes(plan.model, w.param_bytes)
    budget = plan.cluster.device.memory_bytes - plan.cluster.device.reserved_bytes - states
    zero = min(s.zero for s in plan.layers)
    shard = min(s.shard_degree * s.sp_degree for s in plan.layers) if zero else n
    traffic = zero_traffic(plan.model.num_params, plan.cluster, zero, n, w.param_bytes,
                                     shard if n % shard == 0 else n)
    return SeqCostModel.build(plan.model, plan.cluster, budget, tuple(s.recompute.value for s in plan.layers),
                              w.dtype, n, traffic)
