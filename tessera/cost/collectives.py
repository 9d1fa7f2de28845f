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
parameter bytes; P = the layer's parameters / tp; S the ZeRO shard degree (dp, or the HSDP
group, times cp); R = dp * cp * u / S replicas.

Per micro-batch (count m):
    TP (tp > 1)        blocks: 2 all-reduces of t*h*ab forward and 2 backward over tp; with
                       Megatron sequence parallelism an all-gather + reduce-scatter pair each
                       instead; embedding 1 forward; LM head 1 forward and 1 backward. Full
                       recompute replays the forward's in the backward.
    Ulysses (u > 1)    4 all-to-alls forward (q, k, v, output) and 4 backward over u, q and
                       output t*h*ab/tp, k and v scaled by kv_heads r/heads (r: the repeats of
                       a tensor-parallel rank's KV heads for the group); replayed by full
                       and selective recompute (selective saves only matmul outputs).
    ring attention (cp > 1, attention layers): the K/V block, kv = 2 (b / dp) (seq / cp)
                       (kv_heads r / (tp u)) head_dim ab bytes (r: Ulysses KV repeats), sent to
                       the next cp rank and received from the previous one cp - 1 times forward
                       and cp - 1 times backward, and the fp32 dK/dV accumulator (kv * 4 / ab)
                       cp times backward; full or selective recompute replays the forward's.
    ZeRO-3             all-gather pb*P forward and backward, reduce-scatter pb*P backward, over S.
    ZeRO-2             reduce-scatter pb*P over S.
    re-sharding        two adjacent layers of a chunk with different (dp, tp, u, SP, cp) layouts:
                       one all-gather forward and one backward of the larger per-device share,
                       over max(tp*u*cp) of the two (`layer.transition_time`).
    pipeline           each chunk boundary: the activation forward and its gradient backward,
                       micro_batch_seqs * seq_len * h * ab / stage_size bytes (send + recv).
Per step (count 1):
    ZeRO-0             all-reduce pb*P over dp*cp*u.
    ZeRO-1             reduce-scatter + all-gather pb*P over S.
    ZeRO-2             all-gather pb*P over S (parameters kept unsharded across micro-batches).
    HSDP (R > 1)       replica all-reduce of the shard pb*P/S over R (ZeRO >= 1).
Bookkeeping the runtime issues and the cost model does not price (tiny, listed so that the counts
can match exactly; `why` starts with "bookkeeping"):
    the step's loss       one all-reduce over the world (4 bytes; 8 with a pipeline);
    gradient norm         one 4-byte all-reduce per mesh axis of each distinct set of groups over
                          which a rank's gradients are sharded (ZeRO shard group, and the TP group
                          for the TP-sharded weights), and one over pp;
    loss parallel         LM head with tp > 1: per micro-batch, all-reduces over tp of the
                          per-token maximum (ab bytes per token) and of the sum of exponentials
                          and the target logit (4 bytes per token each);
    sequence-parallel norms  an all-reduce over tp of each norm parameter's gradient, which
                          Megatron SP leaves partial per rank: per micro-batch (h*ab bytes), or
                          with a pipeline, whose stages accumulate gradients, once (h*4 bytes);
    tied embeddings       with a pipeline, one all-reduce (first and last stage) of the tied
                          weight's gradient shard (4 bytes per element).
Collectives over one rank move nothing and are left out. No torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..plan import LayerStrategy, Plan, Recompute, SPKind
from ..spec.model import LayerKind, LayerSpec
from .layer import kv_repeats

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
        self.seq, self.ab, self.pb = wl.seq_len, (4 if wl.dtype == "fp32" else 2), wl.param_bytes

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

    def tp_group(self, s: LayerStrategy) -> tuple[int, ...]:
        first = self.rank - self.stage_rank % s.tp
        return tuple(range(first, first + s.tp))


def step_collectives(plan: Plan, rank: int) -> list[Collective]:
    """Every collective of one step on `rank` (see the module docstring), in layer order."""
    r = _Rank(plan, rank)
    out: list[Collective] = []

    def add(kind, group, nbytes, count, layer, why):
        if group > 1 and count > 0 and nbytes > 0:
            out.append(Collective(kind, int(group), float(nbytes), int(count), layer, why))

    layers = [i for c in r.chunks for i in range(*plan.pipeline.stages[c])]
    for i in layers:
        _layer_collectives(r, i, add)
    for c in r.chunks:
        start, end = plan.pipeline.stages[c]
        for i in range(start + 1, end):
            _transition(r, i, add)
        _pipeline_p2p(r, c, add)
    _bookkeeping(r, layers, add)
    return out


def _layer_collectives(r: _Rank, i: int, add) -> None:
    layer, s = r.plan.model.layers[i], r.plan.layers[i]
    name, m = layer.name, r.m
    tokens = r.tokens(s)
    # Tensor parallel: per micro-batch.
    if s.tp > 1:
        n_f, n_b = {LayerKind.EMBEDDING: (1, 0), LayerKind.LM_HEAD: (1, 1)}.get(layer.kind, (2, 2))
        if s.recompute == Recompute.FULL and _is_block(layer):
            n_b += n_f  # the replayed forward's
        msg = tokens * layer.hidden * r.ab
        if s.sp == SPKind.MEGATRON:
            for kind in ("all_gather", "reduce_scatter"):
                add(kind, s.tp, msg, m * (n_f + n_b), name, "tensor parallel (Megatron SP), activations")
        else:
            add("all_reduce", s.tp, msg, m * (n_f + n_b), name, "tensor parallel, activations")
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
    # Data parallel / ZeRO on the parameters (P = params / tp).
    p = r.pb * layer.params / s.tp
    z, shard = s.zero, s.shard_degree
    replicas = s.dp * s.cp * s.sp_degree // shard
    if z == 0:
        add("all_reduce", s.dp * s.cp * s.sp_degree, p, 1, name, "gradient all-reduce (ZeRO-0), once per step")
    elif z == 1:
        add("reduce_scatter", shard, p, 1, name, "gradient reduce-scatter (ZeRO-1), once per step")
        add("all_gather", shard, p, 1, name, "parameter all-gather (ZeRO-1), once per step")
    elif z == 2:
        add("reduce_scatter", shard, p, m, name, "gradient reduce-scatter (ZeRO-2), every micro-batch")
        add("all_gather", shard, p, 1, name, "parameter all-gather (ZeRO-2), once per step")
    else:
        add("all_gather", shard, p, 2 * m, name, "parameter all-gather (ZeRO-3), forward and backward")
        add("reduce_scatter", shard, p, m, name, "gradient reduce-scatter (ZeRO-3), every micro-batch")
    if z >= 1:
        add("all_reduce", replicas, p / shard, 1, name, "HSDP replica all-reduce of the gradient shard")


def _kv_repeats(layer: LayerSpec, s: LayerStrategy) -> int:
    """Repeats of each KV head of a tensor-parallel rank for its Ulysses group (`layer.kv_repeats`)."""
    return kv_repeats(layer.num_heads // s.tp, layer.num_kv_heads // s.tp, s.sp_degree)


def _ring_kv_heads(layer: LayerSpec, s: LayerStrategy) -> float:
    """K/V heads per rank inside the ring (after tp, and Ulysses with its KV repeats)."""
    return layer.num_kv_heads * _kv_repeats(layer, s) / (s.tp * s.sp_degree)


def _transition(r: _Rank, i: int, add) -> None:
    """Re-sharding between plan layers i-1 and i of one chunk (`layer.transition_time`)."""
    a, b = r.plan.layers[i - 1], r.plan.layers[i]
    key = lambda s: (s.dp, s.tp, s.sp_degree, s.sp == SPKind.MEGATRON, s.cp)  # noqa: E731
    if key(a) == key(b):
        return
    hidden = r.plan.model.layers[i].hidden

    def share(s):
        return (r.b / s.dp * r.seq / (s.sp_degree * s.cp) * hidden * r.ab
                / (s.tp if s.sp == SPKind.MEGATRON else 1))

    group = max(a.tp * a.sp_degree * a.cp, b.tp * b.sp_degree * b.cp)
    add("all_gather", group, max(share(a), share(b)), 2 * r.m, r.plan.model.layers[i].name,
        "re-sharding the activation between layouts, forward and backward")


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
        if s.tp > 1:
            candidates.append(shard + (r.tp_group(s),))
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
            add("all_reduce", s.tp, t * r.ab, r.m, layer.name, "bookkeeping: loss parallel, per-token maximum")
            add("all_reduce", s.tp, t * 4, 2 * r.m, layer.name,
                "bookkeeping: loss parallel, sum of exponentials and target logit")
        if s.tp > 1 and s.sp == SPKind.MEGATRON and layer.kind != LayerKind.EMBEDDING:
            norms = _norm_params(plan, layer)
            if pp > 1:  # gradients accumulate across micro-batches: reduced once, in fp32
                add("all_reduce", s.tp, layer.hidden * 4, norms, layer.name,
                    "bookkeeping: sequence-parallel norm gradients, once per step")
            else:
                add("all_reduce", s.tp, layer.hidden * r.ab, r.m * norms, layer.name,
                    "bookkeeping: sequence-parallel norm gradients")
    cfg = plan.model.config
    if pp > 1 and cfg is not None and cfg.tie_embeddings:
        first, last = 0, len(plan.pipeline.stages) - 1
        if plan.pipeline.rank_of_chunk(first) != plan.pipeline.rank_of_chunk(last):
            if first in r.chunks or last in r.chunks:
                s = plan.layers[0]
                shard = s.shard_degree if s.zero else 1
                add("all_reduce", 2, 4 * cfg.vocab_size * cfg.hidden / (s.tp * shard), 1, "step",
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
    return (same and plan.pipeline.degree == 1 and first.tp == 1 and first.zero <= 1
            and not first.dp_shard and not any(s.offload_optimizer for s in plan.layers))
