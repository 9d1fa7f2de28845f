"""Time and memory of one layer under each of many strategies (vectorised with numpy).

`layer_costs(layer, table, ctx)` returns, per candidate strategy, per device:

Per micro-batch (seconds):
    compute  f_c, b_c per operation (compute.py: GEMMs by shape after TP sharding, attention by
             its kernel, memory-bound bytes over bandwidth, launches), or, for a measured layer
             or a device without a GEMM description, by FLOPs at the flat efficiency; the GEMM
             and attention time x (1 + [tp > 1] tp_slowdown + [Ulysses] sp_slowdown) (measured;
             TP's per degree, `LayerSpec.tp_costs`); b_c includes recompute (the forward for
             full, the attention core for selective) and, per operation, adding the micro-batch's
             weight gradients into the device's gradient buffer (3 x its bytes over bandwidth,
             all micro-batches but the first: x (m - 1) / m);
             wgrad = the weight-gradient GEMMs (zero-bubble's W).
    fixed    measured per-call costs, per micro-batch, split as the compute (backward = 2x):
             f_c += (call_overhead_s + [tp > 1] tp_overhead_s + [Ulysses] sp_overhead_s
             + [ZeRO-3 over > 1 rank] zero3_overhead_s) / 3, b_c += 2/3 of the same
             (+ 1/3 more under full recompute, which replays the forward).

Collectives charged (the list `cost/collectives.py` compares with the runtime). t = tokens per
device, h = hidden, a = activation bytes per element, pb = parameter bytes, P = the layer's
parameters / tp (experts / (tp ep)), S = ZeRO shard degree, m = micro-batches:
    TP       on the critical path (DTensor TP issues them between dependent GEMMs and does not
             overlap them; Megatron's --tp-comm-overlap is not what the runtime runs), over the tp
             group (stride 1), message t h a (`collectives.tp_collective_counts`):
             blocks 2 all-reduces forward + 2 backward (Megatron SP: 2 all-gathers + 2
             reduce-scatters each way, same volume); embedding 1 all-reduce forward (SP: a
             reduce-scatter forward, an all-gather backward); LM head 1 all-reduce backward (SP:
             an all-gather forward, a reduce-scatter backward). Full recompute replays a block's
             forward collectives but its last in the backward (selective keeps their outputs):
             per micro-batch.
    Ulysses  4 all-to-alls forward (q, k, v, output; message t h a / tp per rank for q and the
             output, x kv_heads r / heads for k and v, r = the runtime's KV repeats when the group
             outnumbers the KV heads) and 4 backward over the sp group (stride tp); full
             and selective recompute replay the forward's (selective saves matmul outputs only:
             the attention core and the all-to-alls around it run again).
    CP       ring attention (runtime/context_parallel.py) over the cp group (stride tp sp): the
             sequence is cut into 2 cp chunks, rank c holding chunks c and 2cp-1-c, so each rank
             does 1/cp of the causal attention work in cp equal steps. A K/V block per step
             point to point, forward cp - 1 of them, each of
                 kv = 2 (t_cp) (kv_heads r / (tp sp)) head_dim a      (t_cp = tokens / cp per replica)
             (grouped-query K/V heads on the wire; r = Ulysses KV repeats), and backward cp - 1
             K/V blocks plus cp dK/dV accumulators (fp32, 4 bytes an element) travelling with
             them. Block j's transfer is posted before step j - 1's block attention and overlaps
             it (c_a = the attention core's time / cp per step):
                 forward   (cp - 1) overlapped(c_a, p2p(kv))
                 backward  (cp - 1) overlapped(c_a', p2p(kv) + p2p(dkv)) + p2p(dkv)   (the last
                           hop returns each block's gradient to its owner, nothing to hide it)
             with p2p over the network when the cp group spans nodes; full and selective
             recompute replay the forward's ring (selective recomputes the attention core).
    EP       MoE layers: cost/moe.py — a counts all-to-all, dispatch and combine all-to-alls (t top_k h a
             per rank, the busiest rank's load x the routing skew; the inter-node share scaled by
             `a2a_internode_scale`) forward, the two token ones backward, over ep ranks (stride
             tp); full and selective recompute replay the forward's; the skewed expert compute.
    ZeRO     over the shard group (S ranks, stride tp sp), message pb P for parameter all-gathers,
             gb P for gradient reductions (gb = `Workload.grad_bytes`, 4: fp32); overlapped with the
             layer's compute: overlapped(c, x) = c + (slowdown - 1) min(c, x) + max(0, x - c):
             ZeRO-0  1 all-reduce over dp sp ranks per step (after the last micro-batch);
             ZeRO-1  1 reduce-scatter + 1 all-gather per step (gradients accumulate unsharded);
             ZeRO-2  1 reduce-scatter per micro-batch; 1 all-gather per step (parameters kept
                     unsharded over the step's micro-batches), under the first forward;
             ZeRO-3  1 all-gather forward, 1 all-gather + 1 reduce-scatter backward, per
                     micro-batch;
             HSDP (S < dp sp) and Ulysses replicas: 1 all-reduce of the gb P / S shard over the
                     replicas per step.
             The once-per-step ones ride on the last micro-batch's backward after its ZeRO-2/3
             traffic (DDP buckets and FSDP2's post-backward issue them per layer).
    Offload  (FSDP2 CPUOffloadPolicy) the 4 P / S fp32 parameter shard host-to-device before every
             all-gather and the gradient shard device-to-host after every reduce-scatter, over
             `host_bandwidth`, on the path of that collective; the AdamW step on the host at
             `host_memory_bandwidth`, not overlapped.
    Tied     an LM head tied to the embedding on another pipeline rank (pp > 1): 1 all-reduce of
             its gb V h / (tp S) gradient shard with the embedding's rank per step.
Per step (seconds, once) besides: the optimizer update, memory-bound, (2 (ob + [fp32] pb) + gb) P / S
    bytes (the fp32 states read and written, the gradient read) at the device's streaming
    bandwidth, or offloaded at the host's.
Group spans follow the rank layout (tp innermost, then sp, then cp, then dp): the tp group has
stride 1, Ulysses stride tp, the cp ring stride tp sp, ZeRO shard groups (dp x cp ranks, which hold
the same parameters) stride tp sp (comm.py enumerates the groups). Every per-token term of a
context-parallel layer (its GEMMs, TP and Ulysses messages, activations) counts t / cp tokens.

Memory: see memory.py. No torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np

from ..plan import LayerStrategy, SPKind
from ..spec.cluster import ClusterSpec
from ..spec.model import LayerKind, LayerSpec
from ..spec.workload import Workload
from .collectives import tp_collective_counts
from .comm import collective_times, p2p_time, spans_nodes
from .compute import (BACKWARD_FACTOR, achieved_flops, attention_seconds, linear_seconds, memory_bound_seconds,
                      per_operation)
from .moe import moe_times
from .reshard import busiest_share, group_size, layout_of
from .memory import (RC_FULL, RC_NONE, RC_SELECTIVE, activation_bytes, buffer_bytes, expert_shard,
                     model_state_bytes, offloaded_bytes, tp_rank_params)

_RC_CODE = {"none": RC_NONE, "selective": RC_SELECTIVE, "full": RC_FULL}


_RC_NAME = {v: k for k, v in _RC_CODE.items()}
MASTER_BYTES = 4  # FSDP2's sharded parameter (the fp32 master), what offload moves to the device
INFEASIBLE_BYTES = 1e30  # the device memory of a strategy that cannot run (finite: the search does arithmetic on it)


@dataclass(frozen=True)
class StrategyTable:
    """Candidate strategies as parallel arrays; `get(i)` builds strategy i as a LayerStrategy.

    `dp_shard` is the plan's field (0 = shard over all dp); `shard` the resulting ZeRO shard
    degree (1 without ZeRO)."""

    dp: np.ndarray
    tp: np.ndarray
    sp: np.ndarray  # Ulysses degree
    megatron: np.ndarray
    zero: np.ndarray
    dp_shard: np.ndarray
    recompute: np.ndarray
    offload: np.ndarray
    ep: np.ndarray
    cp: np.ndarray  # context-parallel (ring attention) degree

    @property
    def shard(self) -> np.ndarray:
        """ZeRO shard group: the dp ranks (or the HSDP group) times the cp ranks."""
        return np.where(self.zero > 0, np.where(self.dp_shard > 0, self.dp_shard, self.dp) * self.cp, 1)

    @classmethod
    def build(cls, strategies: Sequence[LayerStrategy]) -> "StrategyTable":
        return cls.from_rows([(x.dp, x.tp, x.sp_degree, x.sp == SPKind.MEGATRON, x.zero, x.dp_shard,
                               _RC_CODE[x.recompute.value], x.offload_optimizer, x.ep, x.cp) for x in strategies])

    @classmethod
    def from_rows(cls, rows: Sequence[tuple]) -> "StrategyTable":
        """Rows of (dp, tp, sp, megatron, zero, dp_shard, recompute code, offload, ep[, cp])."""
        a = np.array([tuple(r) + (1,) * (10 - len(r)) for r in rows], dtype=np.int64).reshape(-1, 10)
        return cls(dp=a[:, 0], tp=a[:, 1], sp=a[:, 2], megatron=a[:, 3].astype(bool), zero=a[:, 4],
                   dp_shard=a[:, 5], recompute=a[:, 6], offload=a[:, 7].astype(bool), ep=a[:, 8], cp=a[:, 9])

    def get(self, i: int) -> LayerStrategy:
        """Strategy i (memoised: LayerStrategy is immutable, and a search assembles the same rows
        into plan after plan)."""
        i = int(i)
        got = self._built.get(i)
        if got is None:
            got = self._built[i] = self._build(i)
        return got

    @cached_property
    def _built(self) -> dict[int, LayerStrategy]:
        return {}

    def _build(self, i: int) -> LayerStrategy:
        u = int(self.sp[i])
        kind = SPKind.ULYSSES if u > 1 else (SPKind.MEGATRON if self.megatron[i] else SPKind.NONE)
        return LayerStrategy(dp=int(self.dp[i]), tp=int(self.tp[i]), sp=kind, sp_degree=u,
                             zero=int(self.zero[i]), dp_shard=int(self.dp_shard[i]),
                             recompute=_RC_NAME[int(self.recompute[i])],
                             offload_optimizer=bool(self.offload[i]), ep=int(self.ep[i]), cp=int(self.cp[i]))

    def __len__(self) -> int:
        return len(self.dp)

    def subset(self, index) -> "StrategyTable":
        index = np.asarray(index)
        return StrategyTable(**{f: getattr(self, f)[index] for f in self.__dataclass_fields__})


@dataclass(frozen=True)
class StepContext:
    """What a layer's cost depends on besides its own strategy."""

    cluster: ClusterSpec
    workload: Workload
    stage_size: int  # devices of a pipeline stage (= dp * sp * tp of every layer in it)
    micro_batch_seqs: int  # sequences per micro-batch over the stage (micro_batch_size * dp_of_batch)
    # Layers whose offloaded states share a device's host memory (the search: the model's layers
    # per pipeline rank); an offloaded strategy that would overflow the host if every one of them
    # took as much is infeasible. 0: not checked here (`evaluate` checks each rank's exact sum).
    host_layers: float = 0.0

    @property
    def act_elt(self) -> int:
        return 4 if self.workload.dtype == "fp32" else 2


@dataclass(frozen=True)
class LayerCosts:
    """Per strategy (arrays), per device. Times in seconds, memory in bytes."""

    fwd: np.ndarray  # per micro-batch, incl. exposed TP / Ulysses / EP / ZeRO-3 communication
    bwd: np.ndarray  # per micro-batch, incl. recompute and exposed communication
    wgrad: np.ndarray  # weight-gradient compute inside bwd
    compute_fwd: np.ndarray
    compute_bwd: np.ndarray
    step: np.ndarray  # once per step: exposed gradient sync + optimizer update
    optimizer_time: np.ndarray  # the update part of `step`
    params: np.ndarray
    grads: np.ndarray
    optimizer: np.ndarray
    act: np.ndarray  # per in-flight micro-batch
    buf: np.ndarray
    host: np.ndarray  # offloaded states in host memory
    # Of params + grads, the runtime's extra copies (`_runtime_copies`), and of `act`, what the
    # training loop holds without autograd saving it (the logits): what an instrumented count of
    # model-state tensors and saved tensors cannot see (tessera.profile.results.predicted_memory).
    copies: np.ndarray | None = None
    held: np.ndarray | None = None
    # The data-parallel collectives the times above charge, unexposed (seconds, offload copies
    # included): the all-gather of the layer's parameters over its shard group, the reduce-scatter
    # of its gradients, and the all-reduce of the gradient shard across replicas. For planners that
    # compose micro-batches themselves (tessera.adapt prices per-step groups with them).
    zero_gather: np.ndarray | None = None
    zero_reduce: np.ndarray | None = None
    replica_reduce: np.ndarray | None = None

    @property
    def states(self) -> np.ndarray:
        return self.params + self.grads + self.optimizer

    def first(self, name: str) -> float:
        """The first strategy's value of field `name`, as a float (memoised: a plan's evaluation
        reads the same cached layer's fields once per layer and chunk, many thousand times a search)."""
        value = self._firsts.get(name)
        if value is None:
            value = self._firsts[name] = float(np.asarray(getattr(self, name)).reshape(-1)[0])
        return value

    @cached_property
    def _firsts(self) -> dict[str, float]:
        return {}


def cost_key(layer: LayerSpec) -> tuple:
    """What a layer's cost depends on: every field but its name (all decoder blocks of a dense
    model share one key, so they are costed once)."""
    return tuple(v for k, v in layer.__dict__.items() if k != "name")


def overlap_extra(c, x, slowdown):
    """Extra seconds when x seconds of communication overlap c seconds of compute (arrays or scalars)."""
    return (slowdown - 1.0) * np.minimum(c, x) + np.maximum(0.0, x - c)


def tp_terms(layer: LayerSpec, tp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(overhead seconds, slowdown) per strategy: `LayerSpec.tp_costs` of its TP degree, looked up
    once per distinct degree."""
    degrees, index = np.unique(tp, return_inverse=True)
    terms = np.array([layer.tp_costs(int(d)) for d in degrees]).reshape(len(degrees), 2)
    return terms[index.reshape(np.shape(tp)), 0], terms[index.reshape(np.shape(tp)), 1]


def kv_repeats(num_heads: int, num_kv_heads: int, size: int) -> int:
    """Fewest repeats r of each KV head such that the KV heads split over a Ulysses group of
    `size` ranks (num_kv_heads r divisible by size) and still group the query heads evenly: what
    the runtime's Ulysses attention does (runtime/attention.py). 1 when they split as they are."""
    if size <= 1 or not num_kv_heads:
        return 1
    group = max(1, num_heads // num_kv_heads)
    for r in range(1, group + 1):
        if group % r == 0 and (num_kv_heads * r) % size == 0:
            return r
    return group


def _kv_repeats(layer: LayerSpec, tp, sp) -> np.ndarray:
    """`kv_repeats` per strategy: the runtime repeats the KV heads of a tensor-parallel rank
    (num_heads / tp query heads, num_kv_heads / tp KV heads) for its Ulysses group of sp ranks."""
    tp, sp = np.broadcast_arrays(np.asarray(tp), np.asarray(sp))
    pairs, index = np.unique(np.stack([np.ravel(tp), np.ravel(sp)], axis=1), axis=0, return_inverse=True)
    reps = np.array([kv_repeats(layer.num_heads // int(a), layer.num_kv_heads // int(a), int(b)) for a, b in pairs],
                    dtype=float)
    return reps[np.ravel(index)].reshape(np.shape(sp))


def _compute(layer: LayerSpec, t: StrategyTable, ctx: StepContext, tokens, slowdown):
    """(forward, backward incl. recompute, weight-gradient, attention core forward, attention core
    backward) compute seconds per micro-batch, per strategy (cost/compute.py)."""
    cl, wl = ctx.cluster, ctx.workload
    seq = wl.seq_len
    if not per_operation(layer, cl):
        rate = achieved_flops(cl, wl.dtype) * t.tp * t.sp * t.cp / slowdown
        lin = tokens * layer.flops_per_token * layer.linear_time_scale
        att = tokens * layer.attn_flops_coeff * seq * layer.attn_time_scale
        cf = (lin + att) / rate
        cb = BACKWARD_FACTOR * cf
        cb = cb + np.where(t.recompute == RC_FULL, cf, 0.0)
        cb = cb + np.where(t.recompute == RC_SELECTIVE,
                           (att * layer.selective_attn_fraction
                            + tokens * layer.selective_flops_per_token * layer.linear_time_scale) / rate, 0.0)
        return cf, cb, lin / rate, att / rate, BACKWARD_FACTOR * att / rate
    ab = ctx.act_elt
    local = tokens / (t.sp * t.cp)
    lf, ld, lw = linear_seconds(layer, cl, wl.dtype, ab, local, t.tp, t.ep)
    af, abk = attention_seconds(layer, cl, wl.dtype, ab, tokens / seq, seq, t.tp, t.sp, t.cp)
    tp_sp = np.where(t.megatron, t.tp, 1)
    mf, mb = memory_bound_seconds(layer, cl, ab, local, t.tp, tp_sp)
    rf, rb = ring_memory_seconds(layer, cl, ab, tokens, t)
    cf = (lf + af) * slowdown + mf + rf
    cb = (ld + lw + abk) * slowdown + mb + rb
    cb = cb + np.where(t.recompute == RC_FULL, cf, 0.0)
    cb = cb + np.where(t.recompute == RC_SELECTIVE, (af * slowdown + rf) * layer.selective_attn_fraction, 0.0)
    return cf, cb, lw * slowdown, af * slowdown, abk * slowdown


def ring_heads(layer: LayerSpec, t: StrategyTable) -> tuple[np.ndarray, np.ndarray]:
    """(query heads, K/V heads) per rank inside the ring: split over tp, then over the Ulysses
    group after the KV repeats the runtime makes for a tensor-parallel rank's heads."""
    reps = _kv_repeats(layer, t.tp, t.sp)
    return layer.num_heads / (t.tp * t.sp), layer.num_kv_heads * reps / (t.tp * t.sp)


def ring_memory_seconds(layer: LayerSpec, cl: ClusterSpec, ab: float, tokens, t: StrategyTable):
    """(forward, backward) memory-bound seconds ring attention adds per micro-batch (0 unless
    cp > 1), over the cp - 1 steps after the first, each covering 3/4 of the L = tokens / cp
    local rows on average (all of them against the first half of a block, or half of them
    against a whole block): forward, the online-softmax merge (read and write the fp32
    accumulator, read the block's output: 8 + a bytes per output element) and the K/V heads
    copied to the query heads' layout (K and V written and read: 4 a per element); backward, the fp32
    dQ and dK/dV accumulations (read and write, 8 + a per element) and the same K/V copies (each
    step's block is sliced and, under grouped-query attention, repeated to the query heads)."""
    if not (layer.num_heads and layer.attn_flops_coeff and layer.head_dim):
        return 0.0, 0.0
    q_heads, kv_heads = ring_heads(layer, t)
    rows = 0.75 * tokens / t.cp * (t.cp - 1)
    q, kv, rep = rows * q_heads * layer.head_dim, rows * kv_heads * layer.head_dim, rows * q_heads * layer.head_dim
    bw = cl.device.streaming_bandwidth
    fwd = (q * (8.0 + ab) + rep * 4.0 * ab) / bw
    bwd = ((q + 2.0 * kv) * (8.0 + ab) + rep * 4.0 * ab) / bw
    return fwd, bwd


def ring_buffer_bytes(layer: LayerSpec, ab: float, tokens, t: StrategyTable):
    """Transient bytes of ring attention's backward (0 unless cp > 1), with L = tokens / cp local
    rows, h_q and h_kv the heads per rank (`ring_heads`), d the head dimension:
        L d [h_q (4 + 5 a) + h_kv (24 + 4 a)]
    = the fp32 dQ accumulator, the block's K/V repeated to h_q heads (2 a) and its dQ, dK, dV
    (3 a); three fp32 dK/dV accumulators (travelling, received, this step's: 3 x 2 x 4) and the
    held and incoming K/V blocks (2 x 2 a). The forward's (fp32 output and log-sum-exp
    accumulators, K/V blocks) is smaller."""
    if not (layer.num_heads and layer.attn_flops_coeff and layer.head_dim):
        return 0.0
    q_heads, kv_heads = ring_heads(layer, t)
    per_row = layer.head_dim * (q_heads * (4.0 + 5.0 * ab) + kv_heads * (24.0 + 4.0 * ab))
    return np.where(t.cp > 1, tokens / t.cp * per_row, 0.0)


def ring_attention_comm(layer: LayerSpec, cl: ClusterSpec, ab: float, tokens, t: StrategyTable,
                        attn_fwd, attn_bwd, slow: float):
    """(forward, backward) exposed seconds of ring attention's K/V (and dK/dV) transfers per
    micro-batch (the module docstring's CP line); 0 unless cp > 1."""
    if not (layer.num_heads and layer.attn_flops_coeff and layer.head_dim):
        return 0.0, 0.0
    _, kv_heads = ring_heads(layer, t)
    kv = 2.0 * tokens / t.cp * kv_heads * layer.head_dim
    p_kv = collective_times(cl, "p2p", kv * ab, t.cp, t.tp * t.sp)
    p_grad = collective_times(cl, "p2p", kv * 4.0, t.cp, t.tp * t.sp)
    steps = t.cp - 1
    fwd = steps * overlap_extra(attn_fwd / t.cp, p_kv, slow)
    bwd = steps * overlap_extra(attn_bwd / t.cp, p_kv + p_grad, slow) + p_grad
    return np.where(t.cp > 1, fwd, 0.0), np.where(t.cp > 1, bwd, 0.0)


def layer_costs(layer: LayerSpec, t: StrategyTable, ctx: StepContext) -> LayerCosts:
    cl, wl = ctx.cluster, ctx.workload
    ab, pb, gb, ob = ctx.act_elt, wl.param_bytes, wl.grad_bytes, wl.optimizer_bytes
    tokens = ctx.micro_batch_seqs / t.dp * wl.seq_len  # per data-parallel replica
    tokens_dev = tokens / (t.sp * t.cp)  # Ulysses and context parallelism shard the sequence
    tp_overhead, tp_slowdown = tp_terms(layer, t.tp)
    slowdown = 1.0 + tp_slowdown + np.where(t.sp > 1, layer.sp_slowdown, 0.0)
    cf, cb, wgrad, attn_f, attn_b = _compute(layer, t, ctx, tokens, slowdown)
    # Fixed per-call costs (measured): 1/3 forward, 2/3 backward; full recompute replays the forward's.
    fixed = (layer.call_overhead_s + tp_overhead
             + np.where(t.sp > 1, layer.sp_overhead_s, 0.0)
             + np.where((t.zero >= 3) & (t.shard > 1), layer.zero3_overhead_s, 0.0))
    cf = cf + fixed / 3.0
    cb = cb + 2.0 * fixed / 3.0 + np.where(t.recompute == RC_FULL, fixed / 3.0, 0.0)
    full = t.recompute == RC_FULL

    # Tensor parallel: activation t x h on the tp group, on the critical path (DTensor TP does not
    # overlap its collectives); full recompute replays a block's but its last (`tp_collective_counts`).
    act_msg = tokens_dev * layer.hidden * ab
    times = {kind: collective_times(cl, kind, act_msg, t.tp, 1) for kind in ("all_reduce", "all_gather", "reduce_scatter")}
    comm_f = comm_b = 0.0
    for megatron in (False, True):
        for recompute in (False, True):
            fwd, bwd = tp_collective_counts(layer.kind, megatron, recompute, layer.recompute_replays_all)
            where = (t.megatron == megatron) & (full == recompute)
            comm_f = comm_f + np.where(where, sum(n * times[k] for k, n in fwd.items()), 0.0)
            comm_b = comm_b + np.where(where, sum(n * times[k] for k, n in bwd.items()), 0.0)
    repeats = np.ones(np.shape(t.sp))
    if layer.num_heads and layer.attn_flops_coeff:
        # Ulysses: q, k, v and the output; K and V repeated when the group outnumbers the KV heads.
        repeats = _kv_repeats(layer, t.tp, t.sp)
        kv = np.minimum(1.0, layer.num_kv_heads * repeats / layer.num_heads)
        q_msg = tokens_dev * layer.hidden * ab / t.tp
        a2a = (2 * collective_times(cl, "all_to_all", q_msg, t.sp, t.tp)
               + 2 * collective_times(cl, "all_to_all", q_msg * kv, t.sp, t.tp))
        comm_f = comm_f + a2a
        comm_b = comm_b + a2a + np.where(full | (t.recompute == RC_SELECTIVE), a2a, 0.0)
        # Context parallel: the ring's K/V (and dK/dV) blocks, hidden behind each step's block
        # attention; recompute (full, or selective's attention core) replays the forward's ring.
        ring_f, ring_b = ring_attention_comm(layer, cl, ab, tokens, t, attn_f, attn_b, cl.overlap_slowdown)
        comm_f = comm_f + ring_f
        comm_b = comm_b + ring_b + np.where(full | (t.recompute == RC_SELECTIVE), ring_f, 0.0)
    if layer.num_experts:  # all-to-alls, routing skew, node crossing: cost/moe.py
        comm_f, comm_b = (a + b for a, b in zip((comm_f, comm_b), moe_times(layer, t, cl, tokens_dev, ab, cf)))

    # Data parallel / ZeRO over S = shard ranks (stride tp * sp), replicas R = dp * sp / S.
    # A tied LM head shares the embedding's weight on the same pipeline rank (pp = 1: counted
    # there once); on another rank it holds a copy whose gradient joins the embedding's.
    pp = max(1, cl.num_gpus // ctx.stage_size)
    shared = layer.tied_params if pp == 1 else 0
    shard = t.shard
    es = expert_shard(shard, t.dp * t.cp, t.sp, t.ep)
    slow = cl.overlap_slowdown
    # P_d: the gathered dense parameters of a tp rank, padded as FSDP2 pads them (`tp_rank_params`).
    pd = tp_rank_params(layer, t.tp, shard, layer.dense_params - shared)
    pe = layer.expert_params / (t.tp * t.ep)
    ag = rs = ar_step = rep = h2d = d2h = 0.0
    for p, s, group in ((pd, shard, t.dp * t.cp * t.sp), (pe, es, t.dp * t.cp * t.sp // t.ep)):
        if not np.any(p):
            continue
        st = t.tp * t.sp
        ag = ag + collective_times(cl, "all_gather", pb * p, s, st)
        rs = rs + collective_times(cl, "reduce_scatter", gb * p, s, st)
        ar_step = ar_step + collective_times(cl, "all_reduce", gb * p, group, t.tp)
        replicas = group // s
        rep_stride = np.where(t.sp > 1, t.tp, t.tp * t.sp * s)
        rep = rep + collective_times(cl, "all_reduce", gb * p / s, replicas, rep_stride)
        # Offload (FSDP2 CPUOffloadPolicy): the fp32 parameter shard comes up before every
        # all-gather (cast to the working dtype on the device), the gradient shard goes down after
        # every reduce-scatter, over the host link.
        h2d = h2d + np.where(t.offload, MASTER_BYTES * p / s / cl.host_bandwidth, 0.0)
        d2h = d2h + np.where(t.offload, gb * p / s / cl.host_bandwidth, 0.0)
    ag, rs = ag + h2d, rs + d2h
    z = t.zero
    fwd = cf + comm_f + np.where(z == 3, overlap_extra(cf, ag, slow), 0.0)
    bwd = cb + comm_b + np.where(z == 3, overlap_extra(cb, ag + rs, slow),
                                 np.where(z == 2, overlap_extra(cb, rs, slow), 0.0))
    # Once per step, the last micro-batch's backward also carries the gradient sync (ZeRO-0
    # all-reduce, ZeRO-1 reduce-scatter + all-gather) and the HSDP replica all-reduce, queued after
    # that backward's own ZeRO-2/3 traffic: charge the extra exposure they add. A tied head's
    # copy on another stage all-reduces its gradient with the embedding's (2 ranks, once).
    per_mb = np.where(z == 3, ag + rs, np.where(z == 2, rs, 0.0))
    once = np.where(z == 0, ar_step, np.where(z == 1, ag + rs, 0.0) + rep)  # ZeRO-0: ar_step is the whole sync
    if layer.tied_params and pp > 1:
        once = once + collective_times(cl, "all_reduce", gb * layer.tied_params / t.tp / shard, 2,
                                       ctx.stage_size * (pp - 1))
    exposed_once = once if layer.grad_sync_after_backward else overlap_extra(cb, per_mb + once, slow) - \
        overlap_extra(cb, per_mb, slow)
    sync = exposed_once + np.where(z == 2, overlap_extra(cf, ag, slow), 0.0)

    params, grads, optimizer = model_state_bytes(layer, wl, t.tp, t.ep, z, shard, es, t.offload,
                                                 dense_params=layer.dense_params - shared)
    host = offloaded_bytes(layer, wl, t.tp, t.ep, shard, es, t.offload, dense_params=layer.dense_params - shared)
    if per_operation(layer, cl):
        # Every micro-batch's weight gradients but the first's are added into the gradient buffer
        # the device keeps (unsharded under ZeRO-0/1, the shard under ZeRO-2/3): read both, write
        # one; charged to each micro-batch as (m - 1) / m of that. The DDP path accumulates every
        # micro-batch into its buckets (zeroed in place between steps).
        m = max(1.0, wl.global_batch / ctx.micro_batch_seqs)
        ddp = (t.tp == 1) & (z == 0) & ~t.offload & (t.dp * t.sp > 1) & (pp == 1)
        accumulate = 3.0 * grads / cl.device.streaming_bandwidth * np.where(ddp, 1.0, (m - 1) / m)
        cb, bwd = cb + accumulate, bwd + accumulate
    before = params + grads
    params, grads = _runtime_copies(params, grads, wl, t, z, pp, pd, pe, shard, es,
                                    m=max(1.0, wl.global_batch / ctx.micro_batch_seqs))
    copies = params + grads - before
    if ctx.host_layers:
        params = np.where(host * ctx.host_layers > cl.host_memory_bytes, INFEASIBLE_BYTES, params)
    local = pd / np.where(z >= 1, shard, 1) + pe / np.where(z >= 1, es, 1)
    # The update: memory-bound, on the device or, offloaded, on the host at its DRAM bandwidth:
    # the fp32 states (master, m, v; the fp32 parameter itself in an fp32 run) read and written,
    # the gradient read: 2 (ob + [fp32] pb) + gb per parameter. FSDP2's sharded parameter is the
    # master (it casts while gathering) and the DDP path's fp32 weights are: no working copy.
    update_bytes = 2 * (ob + (pb if wl.dtype == "fp32" else 0)) + gb
    opt_time = update_bytes * local / np.where(t.offload, cl.host_memory_bandwidth, cl.device.streaming_bandwidth)
    fused_norms = cl.device.sm_count > 0  # CUDA's fused RMSNorm; a CPU runs the composite (memory.py)
    act = activation_bytes(layer, tokens_dev, t.tp, t.megatron, t.recompute, seq_len=wl.seq_len, sp=t.sp,
                           elt=ab, fused_norms=fused_norms)
    if layer.num_heads and layer.head_dim:
        # Ulysses: repeated K and V (more ranks than KV heads) are what attention saves, and the
        # output projection saves the all-to-all's copy of the attention output beside SDPA's.
        kv_dim = layer.num_kv_heads * layer.head_dim
        q_dim = layer.num_heads * layer.head_dim
        act = act + np.where(full | (t.recompute == RC_SELECTIVE), 0.0,
                             tokens_dev * ab * ((repeats - 1) * 2 * kv_dim + np.where(t.sp > 1, q_dim, 0)) / t.tp)
        # Ring attention keeps its output (the activation dtype) and fp32 log-sum-exp like
        # SDPA does; what it adds is transient (`ring_buffer_bytes`).
    buf = buffer_bytes(layer, wl, tokens_dev, t.tp, t.ep, t.megatron, z, t.recompute, offload=t.offload,
                       seq_len=wl.seq_len, sp=t.sp, dense_params=layer.dense_params - shared, elt=ab, shard=shard,
                       fused_norms=fused_norms)
    buf = buf + ring_buffer_bytes(layer, ab, tokens, t)
    shape = np.shape(t.dp)
    full_ = lambda x: np.broadcast_to(np.asarray(x, dtype=float), shape)  # noqa: E731
    return LayerCosts(fwd=full_(fwd), bwd=full_(bwd), wgrad=full_(wgrad), compute_fwd=full_(cf),
                      compute_bwd=full_(cb), step=full_(sync + opt_time), optimizer_time=full_(opt_time),
                      params=full_(params), grads=full_(grads), optimizer=full_(optimizer),
                      act=full_(act), buf=full_(buf), host=full_(host), copies=full_(copies),
                      held=full_(tokens_dev * (ab / 2.0) * layer.act_held_tp / t.tp),
                      zero_gather=full_(ag), zero_reduce=full_(rs), replica_reduce=full_(rep))


def _runtime_copies(params, grads, wl: Workload, t: StrategyTable, z, pp: int, pd, pe, shard, es, m: float):
    """Copies of model states the runtime keeps beside the ones ZeRO's formulas count.

    - FSDP2 keeping parameters unsharded (ZeRO 1 over FSDP2, ZeRO 2): the sharded parameter stays
      beside the unsharded one. In mixed precision that shard is the fp32 master the optimizer
      bytes already count; an fp32 run has no master, so it is pb P / S more.
    The DDP path (tp = 1, ZeRO 0, no pipeline, no offload) keeps one gradient copy: its gradients
    are views into DDP's buckets from the start and are zeroed in place between steps
    (`Parallelized.wrap_ddp`), so micro-batches under `no_sync` accumulate into the buckets."""
    if wl.dtype == "fp32":
        fsdp_unsharded = (z == 1) | (z == 2)
        params = params + np.where(fsdp_unsharded & (shard > 1), wl.param_bytes * (pd / shard + pe / es), 0.0)
    return params, grads


Layout = tuple  # (dp, tp, sp, megatron[, cp]): what `shape_key` returns


def shape_key(s: LayerStrategy) -> Layout:
    """What decides how activations are laid out between layers: (dp, tp, sp, megatron, cp)."""
    return (s.dp, s.tp, s.sp_degree, s.sp == SPKind.MEGATRON, s.cp)


def _layout_array(layouts) -> np.ndarray:
    """Layouts as rows (dp, tp, sp, megatron, cp); cp 1 where a 4-element key leaves it out."""
    return np.array([tuple(k) + (1,) * (5 - len(k)) for k in layouts], dtype=np.int64).reshape(-1, 5)


def transition_time(hidden: int, a: Layout, b: Layout, ctx: StepContext) -> float:
    """Seconds per micro-batch (forward + backward) to re-shard the activation between two
    adjacent layers whose layouts differ (`cost/reshard.py`, what the runtime issues): an
    all-to-all over the lcm(tp * sp * cp) consecutive ranks whose blocks overlap (stride 1)
    forward, each rank sending its peers only what they need and do not hold, and the gradient
    back the same way; each priced by its busiest rank's bytes. Layouts with the same blocks
    cost nothing."""
    if tuple(a) + (1,) * (5 - len(a)) == tuple(b) + (1,) * (5 - len(b)):
        return 0.0  # the same layout (the common case between blocks): no matrix to build
    return float(transition_matrix(hidden, [a, b], ctx)[0, 1])


def transition_matrix(hidden: int, layouts: Sequence[Layout], ctx: StepContext) -> np.ndarray:
    """`transition_time` for every ordered pair of layouts (dp, tp, sp, megatron[, cp]) at once."""
    whole = ctx.micro_batch_seqs * ctx.workload.seq_len * hidden * ctx.act_elt  # one micro-batch's activation
    lay = _layout_array(layouts)
    keys = [layout_of(int(dp), int(sp), int(tp), bool(meg), int(cp)) for dp, tp, sp, meg, cp in lay]
    n = len(keys)
    share = np.zeros((n, n))
    group = np.ones((n, n), dtype=np.int64)
    for i, x in enumerate(keys):
        for j, y in enumerate(keys):
            if i != j:
                share[i, j] = busiest_share(x, y)
                group[i, j] = group_size(x, y)
    moves = collective_times(ctx.cluster, "all_to_all", share * whole, group, 1)
    return np.where(share > 0, moves, 0.0) + np.where(share.T > 0, moves.T, 0.0)


def pipeline_p2p_time(hidden: int, ctx: StepContext) -> float:
    """Seconds to pass one micro-batch's activation between adjacent pipeline stages: each device
    sends its 1/stage_size share to its peer `stage_size` ranks away."""
    n = ctx.micro_batch_seqs * ctx.workload.seq_len * hidden * ctx.act_elt / ctx.stage_size
    inter = spans_nodes(2, ctx.stage_size, ctx.cluster.gpus_per_node)
    return p2p_time(ctx.cluster, n, inter)
