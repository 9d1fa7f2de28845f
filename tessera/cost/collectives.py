"""The collectives one training step issues on one rank, as the cost model prices them.

`step_collectives(plan, rank)` lists, for the layers of the pipeline rank that `rank` belongs to,
every collective of one optimizer step: kind, group size, bytes, count, the layer and why. It
follows `cost/layer.py` (what each strategy communicates) and the runtime/cost-model contract
(when gradient synchronisation happens); a dry run of the runtime
(`tessera.runtime.dryrun`) counts what the runtime really issues and compares the two.

Bytes use `cost/comm.py`'s convention: the full (gathered) size for all-gather, reduce-scatter
and all-reduce, what each rank sends for all-to-all, the message for send / recv. Notation per
layer: m micro-batches; b = micro_batch_size * dp_of_batch sequences per micro-batch over the
stage; t = b / dp * seq_len / (u cp) tokens on the device (u: Ulysses degree, cp: context
parallel degree); h hidden size; ab = activation bytes per element (2, or 4 for fp32); pb =
parameter bytes; gb = gradient bytes (`Workload.grad_bytes`: 4, the runtime reduces in fp32);
P = the layer's parameters / tp (`memory.tp_rank_params`: the embedding's and LM head's vocabulary
rows padded to a multiple of S as FSDP2 pads them, GPT-2's positions and the final norm whole; an
LM head tied to the embedding on its pipeline rank without the table, which is the embedding's);
S the ZeRO shard degree (dp, or the HSDP group, times cp);
R = dp * cp * u / S replicas.

Per micro-batch (count m):
    TP (tp > 1)        of t*h*ab over tp (`tp_collective_counts`): blocks 2 all-reduces forward
                       and 2 backward, with Megatron sequence parallelism an all-gather +
                       reduce-scatter pair each instead; embedding 1 all-reduce forward (SP: a
                       reduce-scatter forward, an all-gather backward); LM head 1 all-reduce
                       backward (SP: an all-gather forward, a reduce-scatter backward). Full
                       recompute replays a block's forward collectives but its last.
    Ulysses (u > 1)    4 all-to-alls forward (q, k, v, output) and 4 backward over u, q and
                       output t*h*ab/tp, k and v scaled by kv_heads r/heads (r: the repeats of
                       a tensor-parallel rank's KV heads for the group); replayed by full
                       and selective recompute (selective saves only matmul outputs).
    ring attention (cp > 1, attention layers): the K/V block, kv = 2 (b / dp) (seq / cp)
                       (kv_heads r / (tp u)) head_dim ab bytes (r: Ulysses KV repeats), sent to
                       the next cp rank and received from the previous one cp - 1 times forward
                       and cp - 1 times backward, and the fp32 dK/dV accumulator (kv * 4 / ab)
                       cp times backward; full or selective recompute replays the forward's.
    MoE layers         `cost/moe.py` `ep_collectives`: routing counts, dispatch and combine
                       all-to-alls over ep (and their gradients, replayed under recompute), the
                       load-balancing counts over dp*u, the routing-weight gradients over tp.
    ZeRO-3             all-gather pb*P forward and backward, reduce-scatter gb*P backward, over S;
                       under ep the experts (P_e = expert params / (tp ep)) follow every ZeRO rule
                       over their replicas R_e = dp*u/ep, sharded over gcd(S, R_e), the rest as P.
    ZeRO-2             reduce-scatter gb*P over S.
    re-sharding        two adjacent layers with different activation blocks (the second's input
                       moved on its chunk, across a pipeline boundary too): one all-to-all forward
                       and one backward over the lcm(tp*u*cp) consecutive ranks that exchange, of
                       what this rank sends (`cost/reshard.py`, `layer.transition_time`).
    pipeline           each chunk boundary: the activation forward and its gradient backward,
                       micro_batch_seqs * seq_len * h * ab / stage_size bytes (send + recv).
Per step (count 1):
    ZeRO-0             all-reduce gb*P over dp*cp*u.
    ZeRO-1             reduce-scatter gb*P + all-gather pb*P over S.
    ZeRO-2             all-gather pb*P over S (parameters kept unsharded across micro-batches).
    HSDP (R > 1)       replica all-reduce of the shard gb*P/S over R (ZeRO >= 1).
Bookkeeping the runtime issues and the cost model does not price (tiny, listed so that the counts
can match exactly; `why` starts with "bookkeeping"):
    the step's loss       one all-reduce over the world (4 bytes; 8 with a pipeline);
    gradient norm         one 4-byte all-reduce per mesh axis of each distinct set of groups over
                          which a rank's gradients are sharded (ZeRO shard group, and the TP group
                          for the TP-sharded weights), and one over pp;
    loss parallel         LM head with tp > 1: per micro-batch, all-reduces over tp of the
                          per-token maximum, of the sum of exponentials and of the target logit
                          (4 bytes per token each: the loss is taken on fp32 logits);
    sequence-parallel norms  an all-reduce over tp of each norm parameter's gradient, which
                          Megatron SP leaves partial per rank: per micro-batch (h*ab bytes) where
                          an FSDP2 unit reduces every micro-batch (ZeRO-2/3, pipelines too), or
                          once (h*4 bytes) where gradients accumulate over the step (ZeRO-0/1, or
                          a layer FSDP2 does not wrap: one rank, fp32, no offload);
    tied embeddings       with a pipeline, one all-reduce (first and last stage) of the tied
                          weight's gradient shard (4 bytes per element); an LM head that holds
                          its copy of the table in another layout than the embedding's (on
                          their pipeline rank, or on another stage) instead exchanges shards
                          with it: one all-to-all over the ranks of both copies, of what this
                          rank sends (`cost/tied.py`).
Collectives over one rank move nothing and are left out. No torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..plan import LayerStrategy, Plan, Recompute, SPKind
from ..spec.model import LayerKind, LayerSpec
from .memory import expert_shard, tp_rank_params
from .moe import ep_collectives
from .reshard import exchange, layout_of, same_blocks, sent_by, seq_multiple
from .tied import group_ranks, sent_rows, tied_copies

@dataclass(frozen=True)
class Collective:
    kind: str  # all_reduce, all_gather, reduce_scatter, all_to_all, send, recv
    group_size: int
    bytes: float
    count: int
    layer: str  # a layer name, or "step"
    why: str


def _is_block(layer: LayerSpec) -> bool:
    return layer.kind not in (LayerKind.EMBEDDING, LayerKind.LM_HEAD)


class _Rank:
    """The data of one rank a plan's collectives depend on."""

    def __init__(self, plan: Plan, rank: int):
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"rank {rank} is outside the plan's world of {plan.world_size} ranks")
        self.plan, self.rank = plan, rank
        self.pp_rank, self.stage_rank = divmod(rank, plan.stage_size)
        pipe = plan.pipeline
        self.chunks = [c for c in range(len(pipe.stages)) if pipe.rank_of_chunk(c) == self.pp_rank]
        self.m = plan.num_micro_batches
        self.b = plan.micro_batch_size * plan.dp_of_batch  # sequences per micro-batch over the stage
        wl = plan.workload
        self.seq, self.ab, self.pb, self.gb = wl.seq_len, (4 if wl.dtype == "fp32" else 2), wl.param_bytes, wl.grad_bytes
        self.copies = tied_copies(plan)  # an LM head holding a copy of the tied embedding in another layout

    def tokens(self, s: LayerStrategy) -> float:
        """Tokens of a micro-batch on this device under strategy `s`."""
        return self.b / s.dp * self.seq / (s.sp_degree * s.cp)

    def shard_group(self, s: LayerStrategy) -> tuple[int, ...]:
        """Global ranks of this rank's ZeRO shard group under `s` (mesh.py's layer layout: the
        dp ranks of the shard group times the cp ranks under ZeRO)."""
        u, tp, cp = s.sp_degree, s.tp, s.cp
        shard_cp = cp if s.zero else 1
        shard_dp = s.shard_degree // shard_cp
        dc, rest = divmod(self.stage_rank, u * tp)
        d, c = divmod(dc, cp)
        d_rep = d // shard_dp
        base = self.pp_rank * self.plan.stage_size
        return tuple(base + ((d_rep * shard_dp + k) * cp + (j if shard_cp > 1 else c)) * u * tp + rest
                     for k in range(shard_dp) for j in range(shard_cp))

    def expert_groups(self, s: LayerStrategy) -> tuple[tuple[int, ...], ...]:
        """The groups an expert gradient of this rank is summed over for the gradient norm: its
        ZeRO shard group (es > 1), its tp group (tp > 1), its expert-parallel group; the expert
        mesh of runtime/expert_parallel.py: stage rank ((j_rep es + j_shard) ep + i) tp + t."""
        es = expert_shard(s.shard_degree, s.dp, s.sp_degree, s.ep)
        base = self.pp_rank * self.plan.stage_size
        q, t = divmod(self.stage_rank, s.tp)
        j, i = divmod(q, s.ep)
        j_rep, j_shard = divmod(j, es)
        rank = lambda js, i_, t_: base + ((j_rep * es + js) * s.ep + i_) * s.tp + t_  # noqa: E731
        out = []
        if es > 1:
            out.append(tuple(rank(k, i, t) for k in range(es)))
        if s.tp > 1:
            out.append(tuple(rank(j_shard, i, k) for k in range(s.tp)))
        out.append(tuple(rank(j_shard, k, t) for k in range(s.ep)))
        return tuple(out)

    def tp_group(self, s: LayerStrategy) -> tuple[int, ...]:
        first = self.rank - self.stage_rank % s.tp
        return tuple(range(first, first + s.tp))


def step_collectives(plan: Plan, rank: int) -> list[Collective]:
    """Every collective of one step on `rank` (see the module docstring), in layer order."""
    r = _Rank(plan, rank)
    out: list[Collective] = []

    def add(kind, group, nbytes, count, layer, why, empty=False):
        """`empty`: the rank takes part even when it moves no bytes itself (an all-to-all)."""
        if group > 1 and count > 0 and (nbytes > 0 or empty):
            out.append(Collective(kind, int(group), float(nbytes), int(count), layer, why))

    layers = [i for c in r.chunks for i in range(*plan.pipeline.stages[c])]
    for i in layers:
        _layer_collectives(r, i, add)
    for c in r.chunks:
        start, end = plan.pipeline.stages[c]
        for i in range(max(start, 1), end):  # a chunk re-shards its input to its first layer too
            _transition(r, i, add)
        _pipeline_p2p(r, c, add)
    _bookkeeping(r, layers, add)
    return out


def tp_collective_counts(kind: LayerKind, megatron: bool, full_recompute: bool,
                         replays_all: bool = False) -> tuple[dict, dict]:
    """(forward, backward) collectives over tp of one layer's tensor parallelism per micro-batch,
    {kind: count}, each of the (tokens x hidden) activation:
        block       2 all-reduces each way (attention and MLP outputs forward, their inputs'
                    gradients backward); Megatron SP: 2 all-gathers + 2 reduce-scatters each way
        embedding   vocabulary-parallel: 1 all-reduce forward; SP: 1 reduce-scatter forward,
                    its all-gather backward
        LM head     column-parallel on a replicated input: 1 all-reduce backward; SP: 1
                    all-gather forward, its reduce-scatter backward
    Full recompute replays a block's forward in its backward up to its last saved tensor, i.e.
    all but the block's last collective: 1 all-reduce, or 2 all-gathers + 1 reduce-scatter
    (`replays_all`, a reentrant checkpoint: all of them, 2 all-reduces or 2 + 2)."""
    if kind == LayerKind.EMBEDDING:
        return ({"reduce_scatter": 1}, {"all_gather": 1}) if megatron else ({"all_reduce": 1}, {})
    if kind == LayerKind.LM_HEAD:
        return ({"all_gather": 1}, {"reduce_scatter": 1}) if megatron else ({}, {"all_reduce": 1})
    if megatron:
        fwd, bwd = {"all_gather": 2, "reduce_scatter": 2}, {"all_gather": 2, "reduce_scatter": 2}
        if full_recompute:
            bwd = {"all_gather": 4, "reduce_scatter": 4 if replays_all else 3}
        return fwd, bwd
    return {"all_reduce": 2}, {"all_reduce": (4 if replays_all else 3) if full_recompute else 2}


def _layer_collectives(r: _Rank, i: int, add) -> None:
    layer, s = r.plan.model.layers[i], r.plan.layers[i]
    name, m = layer.name, r.m
    tokens = r.tokens(s)
    # Tensor parallel: per micro-batch.
    if s.tp > 1:
        megatron = s.sp == SPKind.MEGATRON
        fwd, bwd = tp_collective_counts(layer.kind, megatron, s.recompute == Recompute.FULL,
                                        layer.recompute_replays_all)
        msg = tokens * layer.hidden * r.ab
        why = "tensor parallel (Megatron SP), activations" if megatron else "tensor parallel, activations"
        for kind in ("all_reduce", "all_gather", "reduce_scatter"):
            add(kind, s.tp, msg, m * (fwd.get(kind, 0) + bwd.get(kind, 0)), name, why)
    # Ulysses: 4 all-to-alls each way per micro-batch.
    if s.sp_degree > 1 and layer.num_heads and layer.attn_flops_coeff:
        q = tokens * layer.hidden * r.ab / s.tp
        kv = q * min(1.0, layer.num_kv_heads * _kv_repeats(layer, s) / layer.num_heads)
        ways = 3 if s.recompute in (Recompute.FULL, Recompute.SELECTIVE) else 2
        add("all_to_all", s.sp_degree, q, m * 2 * ways, name, "Ulysses q and output")
        add("all_to_all", s.sp_degree, kv, m * 2 * ways, name, "Ulysses k and v")
    # Ring attention: K/V blocks to the next cp rank (and their gradients, backward).
    if s.cp > 1 and layer.num_heads and layer.attn_flops_coeff:
        replay = s.recompute in (Recompute.FULL, Recompute.SELECTIVE)
        kv = 2 * r.b / s.dp * r.seq / s.cp * _ring_kv_heads(layer, s) * layer.head_dim * r.ab
        blocks = m * (s.cp - 1) * (3 if replay else 2)
        for kind in ("send", "recv"):
            add(kind, 2, kv, blocks, name, "ring attention: K/V blocks")
            add(kind, 2, kv * 4 / r.ab, m * s.cp, name, "ring attention: dK/dV accumulators (fp32)")
    # Expert parallelism: the MoE layer's own collectives per micro-batch (cost/moe.py).
    if layer.num_experts:
        aux = r.plan.model.config is not None and bool(r.plan.model.config.router_aux_loss_coef)
        for c in ep_collectives(layer, s, tokens, r.ab, aux):
            add(c.op, c.group, c.nbytes, m, name, f"expert parallel: {c.what}")
    # Data parallel / ZeRO on the parameters (P = params / tp): parameters gathered in the
    # working dtype (pb bytes), gradients reduced in `grad_dtype` (gb bytes). Under expert
    # parallelism the experts (params / (tp ep)) sync over their dp * cp * u / ep replicas, sharded
    # over es = gcd(S, dp * u / ep) (runtime/expert_parallel.py), the rest as a dense layer's.
    # A tied LM head on the embedding's pipeline rank uses the embedding's weight (one layout,
    # search/planner.py): its own collectives are those of the rest (the final norm).
    group = s.dp * s.cp * s.sp_degree
    shared = layer.tied_params if r.plan.pipeline.degree == 1 and r.copies is None else 0
    dense = tp_rank_params(layer, s.tp, s.shard_degree, layer.dense_params - shared)
    parts = [(dense, s.shard_degree, group, "")]
    if layer.num_experts and s.ep > 1:
        replicas = group // s.ep
        parts.append((layer.expert_params / s.ep / s.tp, expert_shard(s.shard_degree, s.dp, s.sp_degree, s.ep),
                      replicas, "experts: "))
    elif layer.num_experts:
        parts = [(dense + layer.expert_params / s.tp, s.shard_degree, group, "")]
    for params, shard, over, label in parts:
        _zero_collectives(add, s.zero, r.pb * params, r.gb * params, shard, over, m, name, label)


def _zero_collectives(add, z: int, p: float, g: float, shard: int, group: int, m: int, name: str,
                      label: str) -> None:
    """Gradient sync of a layer's p bytes of parameters (g bytes of gradients) with ZeRO stage z
    over `group` ranks, sharded over `shard` of them (the runtime / cost-model contract)."""
    if z == 0:
        add("all_reduce", group, g, 1, name, f"{label}gradient all-reduce (ZeRO-0), once per step")
    elif z == 1:
        add("reduce_scatter", shard, g, 1, name, f"{label}gradient reduce-scatter (ZeRO-1), once per step")
        add("all_gather", shard, p, 1, name, f"{label}parameter all-gather (ZeRO-1), once per step")
    elif z == 2:
        add("reduce_scatter", shard, g, m, name, f"{label}gradient reduce-scatter (ZeRO-2), every micro-batch")
        add("all_gather", shard, p, 1, name, f"{label}parameter all-gather (ZeRO-2), once per step")
    else:
        add("all_gather", shard, p, 2 * m, name, f"{label}parameter all-gather (ZeRO-3), forward and backward")
        add("reduce_scatter", shard, g, m, name, f"{label}gradient reduce-scatter (ZeRO-3), every micro-batch")
    if z >= 1:
        add("all_reduce", group // shard, g / shard, 1, name, f"{label}HSDP replica all-reduce of the gradient shard")


def _kv_repeats(layer: LayerSpec, s: LayerStrategy) -> int:
    """Repeats of each KV head of a tensor-parallel rank for its Ulysses group (`layer.kv_repeats`)."""
    from .layer import kv_repeats  # layer.py imports this module

    return kv_repeats(layer.num_heads // s.tp, layer.num_kv_heads // s.tp, s.sp_degree)


def _ring_kv_heads(layer: LayerSpec, s: LayerStrategy) -> float:
    """K/V heads per rank inside the ring (after tp, and Ulysses with its KV repeats)."""
    return layer.num_kv_heads * _kv_repeats(layer, s) / (s.tp * s.sp_degree)


def _transition(r: _Rank, i: int, add) -> None:
    """Re-sharding from plan layer i-1's activation layout to layer i's (`cost/reshard.py`): one
    all-to-all forward and one backward per micro-batch over the re-sharding group, of what this
    rank sends (every rank of the group takes part, a rank that sends nothing too)."""
    a, b = (_layout(r.plan.layers[j]) for j in (i - 1, i))
    if same_blocks(a, b):
        return
    # The runtime pads the sequence to a multiple every layer's blocks divide (`sequence_multiple`).
    multiple = math.lcm(*(seq_multiple(_layout(s)) for s in r.plan.layers))
    seq = -(-r.seq // multiple) * multiple
    fwd, bwd = exchange(a, b, r.stage_rank, r.b, seq), exchange(b, a, r.stage_rank, r.b, seq)
    unit = r.plan.model.layers[i].hidden * r.ab
    name = r.plan.model.layers[i].name
    for ex, layouts, way in ((fwd, (a, b), "forward"), (bwd, (b, a), "backward")):
        if ex.active and ex.size > 1:
            add("all_to_all", ex.size, sent_by(*layouts, r.stage_rank, r.b, seq) * unit, r.m, name,
                f"re-sharding the activation between layouts, {way}", empty=True)


def _layout(s: LayerStrategy):
    return layout_of(s.dp, s.sp_degree, s.tp, s.sp == SPKind.MEGATRON, s.cp)


def _pipeline_p2p(r: _Rank, chunk: int, add) -> None:
    plan = r.plan
    if plan.pipeline.degree == 1:
        return
    hidden = max(layer.hidden for layer in plan.model.layers)
    n = r.b * r.seq * hidden * r.ab / plan.stage_size
    last = len(plan.pipeline.stages) - 1
    name = plan.model.layers[plan.pipeline.stages[chunk][0]].name
    if chunk > 0:
        add("recv", 2, n, r.m, name, "pipeline: activation from the previous stage")
        add("send", 2, n, r.m, name, "pipeline: its gradient back")
    if chunk < last:
        add("send", 2, n, r.m, name, "pipeline: activation to the next stage")
        add("recv", 2, n, r.m, name, "pipeline: its gradient from the next stage")


def _bookkeeping(r: _Rank, layers: list[int], add) -> None:
    plan = r.plan
    pp = plan.pipeline.degree
    add("all_reduce", plan.world_size, 8 if pp > 1 else 4, 1, "step", "bookkeeping: the step's loss")
    # Gradient norm: one all-reduce per axis of each distinct set of sharding groups.
    keys: list[tuple[tuple[int, ...], ...]] = []
    ddp_path = _uses_ddp(plan)
    for i in layers:
        layer, s = plan.model.layers[i], plan.layers[i]
        shard = () if ddp_path or s.shard_degree == 1 else (r.shard_group(s),)
        # Under TP the embedding table is vocabulary-sharded; only GPT-2's learned positions
        # (and every block's and the head's norms) are sharded by ZeRO alone.
        learned = plan.model.config is not None and plan.model.config.position == "learned"
        plain = s.tp == 1 or layer.kind != LayerKind.EMBEDDING or learned
        candidates = [shard] if plain else []
        # The head's copy of a tied table is left out of the norm (the embedding counts it).
        copy = layer.kind == LayerKind.LM_HEAD and r.copies is not None and pp == 1
        if s.tp > 1 and not copy:
            candidates.append(shard + (r.tp_group(s),))
        if layer.num_experts and s.ep > 1:  # experts: their shard and tp axes, then the ep group (optim.grad_norm)
            candidates.append(r.expert_groups(s))
        for key in candidates:
            if key and key not in keys:
                keys.append(key)
    for key in keys:
        for group in key:
            add("all_reduce", len(group), 4, 1, "step", "bookkeeping: gradient norm")
    if pp > 1:
        add("all_reduce", pp, 4, 1, "step", "bookkeeping: gradient norm over the pipeline")
    for i in layers:
        layer, s = plan.model.layers[i], plan.layers[i]
        if s.tp > 1 and layer.kind == LayerKind.LM_HEAD:
            t = plan.micro_batch_size * plan.dp_of_batch / s.dp * r.seq / (s.sp_degree * s.cp)
            add("all_reduce", s.tp, t * 4, r.m, layer.name, "bookkeeping: loss parallel, per-token maximum")
            add("all_reduce", s.tp, t * 4, 2 * r.m, layer.name,
                "bookkeeping: loss parallel, sum of exponentials and target logit")
        if s.tp > 1 and s.sp == SPKind.MEGATRON and layer.kind != LayerKind.EMBEDDING:
            norms = _norm_params(plan, layer)
            # FSDP2 units that reduce every micro-batch (ZeRO-2/3) reduce the norms' partial
            # gradients with it; elsewhere gradients accumulate and are settled once, in fp32.
            fsdp = s.dp * s.cp * s.sp_degree > 1 or plan.workload.dtype != "fp32" or s.offload_optimizer
            if s.zero <= 1 or not fsdp:
                add("all_reduce", s.tp, layer.hidden * 4, norms, layer.name,
                    "bookkeeping: sequence-parallel norm gradients, once per step")
            else:
                add("all_reduce", s.tp, layer.hidden * r.ab, r.m * norms, layer.name,
                    "bookkeeping: sequence-parallel norm gradients")
    cfg = plan.model.config
    if r.copies is not None and any(r.rank in c.ranks for c in r.copies):
        add("all_to_all", len(group_ranks(r.copies)), sent_rows(r.copies, cfg.vocab_size, r.rank) * cfg.hidden * r.gb,
            1, "step", "bookkeeping: tied embedding gradient, exchanged between the copies' shards", empty=True)
    elif pp > 1 and cfg is not None and cfg.tie_embeddings:
        first, last = 0, len(plan.pipeline.stages) - 1
        if plan.pipeline.rank_of_chunk(first) != plan.pipeline.rank_of_chunk(last):
            if first in r.chunks or last in r.chunks:
                s = plan.layers[0]
                shard = s.shard_degree if s.zero else 1
                add("all_reduce", 2, r.gb * cfg.vocab_size * cfg.hidden / (s.tp * shard), 1, "step",
                    "bookkeeping: tied embedding gradient between first and last stage")


def _norm_params(plan: Plan, layer: LayerSpec) -> int:
    """Norm parameter tensors of a layer: 2 norms per block (1 for the head), each a weight
    and, for LayerNorm, a bias."""
    cfg = plan.model.config
    per_norm = 2 if cfg is not None and cfg.norm == "layernorm" else 1
    return per_norm * (2 if _is_block(layer) else 1)


def _uses_ddp(plan: Plan) -> bool:
    """The runtime's DDP path (`runtime.parallelize.uses_ddp`, restated without torch)."""
    first = plan.layers[0]
    same = all((s.dp, s.cp, s.sp_degree, s.tp, s.zero, s.dp_shard)
               == (first.dp, first.cp, first.sp_degree, first.tp, first.zero, first.dp_shard)
               for s in plan.layers)
    return (same and plan.pipeline.degree == 1 and first.tp == 1 and first.zero == 0
            and not first.dp_shard and not any(s.offload_optimizer for s in plan.layers)
            and all(s.ep == 1 for s in plan.layers))
