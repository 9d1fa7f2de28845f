"""Expert parallelism: MoE layers whose experts are spread over the ranks of their stage.

Layout. A MoE layer with degrees (dp, sp, tp) and expert-parallel degree ep (ep divides dp * sp)
puts stage rank r = q * tp + t, q = d * sp + s (runtime/mesh.py), at expert-parallel rank
i = q mod ep of expert group j = q div ep: the ep consecutive q of a group hold all E experts,
E / ep each (rank i holds experts [i E/ep, (i+1) E/ep)); the R = dp * sp / ep groups replicate
them, and ZeRO shards the expert states over es = gcd(S, R) of the replicas (S the layer's ZeRO
shard degree; cost/memory.py `expert_shard`), j = j_rep * es + j_shard. The mesh is
("pp", "edp_replicate", "edp_shard", "ep", "tp") = arange(world).view(pp, R / es, es, ep, tp): the
ep group has stride tp, as the cost model prices its all-to-alls (tessera/cost/moe.py).

Per forward call (micro-batch) of a layer, on each rank of an ep group (`ExpertParallelContext`):
  1. an all-to-all of the routing counts: E / ep integers to each peer, the token-slots it will
     receive for each of its experts;
  2. dispatch: `all_to_all_single` with uneven splits of the routed token copies (each slot's token
     row, grouped by destination rank and expert; dropless, or what the capacity kept);
  3. the local experts on their rows, regrouped by expert (every expert runs, also on zero rows);
  4. combine: the all-to-all back, splits swapped; the model weighs and sums (models/moe.py).
The backward runs the two token all-to-alls again with the splits swapped. Under tensor
parallelism the tp ranks of an ep group route the same tokens and each runs its slice of the
experts (DTensor column/row parallel on the expert mesh's tp axis).

Gradients. Tokens of every dp * sp piece reach an expert, so on one rank its gradient is the sum
over the pieces of its group; FSDP2 averages it over the R replicas (the "edp" axes) and the
runtime rescales by R / P (P the pieces the loss is split over), giving (1/P) sum over pieces like
every other parameter. Experts are always FSDP2 units (over a mesh of one when R = 1), so their
parameters are DTensors on (a slice of) the expert mesh, and the global gradient norm sums them
over the ep group too (`ep_group_of`, read by `optim.grad_norm`).

Router losses. n_e is all-reduced over the layer's dp * sp ranks ("tokens" group) and T counts
the whole micro-batch, so every rank's share of L_lb and L_z is linear in its own tokens and the
shares add up to the one-process loss of the micro-batch. Its gradient enters at the layer
output (models/moe.py `_InjectAux`, as Megatron's MoEAuxLossAutoScaler) scaled by P — the
runtime's loss is the mean of P pieces' means, so a term of the global loss enters each piece
P times — and by 1/m under gradient accumulation over m micro-batches (the trainer divides each
micro-batch's loss by m; a pipeline schedule divides the gradients by m itself).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from math import gcd

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..errors import TesseraError
from ..models.moe import Experts, MoE, MoEContext, moe_layers
from ..plan import LayerStrategy, Plan
from ..spec.model import LayerKind
from .mesh import Axis, LayerLayout, ParallelDims, layer_coords

log = logging.getLogger(__name__)

EXPERT_AXES = ("pp", "edp_replicate", "edp_shard", "ep", "tp")


# --- pure layout arithmetic ----------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertLayout:
    """Degrees of one MoE layer's expert placement (module docstring)."""

    dp: int
    sp: int
    tp: int
    ep: int
    shard: int  # the layer's ZeRO shard degree S (1 without ZeRO)

    @classmethod
    def of(cls, s: LayerStrategy) -> "ExpertLayout":
        return cls(dp=s.dp, sp=s.sp_degree, tp=s.tp, ep=s.ep, shard=s.shard_degree)

    @property
    def replicas(self) -> int:
        """R: expert groups, each holding every expert once."""
        return self.dp * self.sp // self.ep

    @property
    def expert_shard(self) -> int:
        """es = gcd(S, R): the ZeRO shard degree of expert states."""
        return gcd(self.shard, self.replicas)

    def mesh_shape(self, pp: int) -> tuple[int, ...]:
        return (pp, self.replicas // self.expert_shard, self.expert_shard, self.ep, self.tp)

    def ep_rank(self, stage_rank: int) -> int:
        return (stage_rank // self.tp) % self.ep

    def local_experts(self, num_experts: int, ep_rank: int) -> range:
        per = num_experts // self.ep
        return range(ep_rank * per, (ep_rank + 1) * per)


def check_moe_layer(plan: Plan, i: int, s: LayerStrategy, where: str) -> None:
    """Refuse, naming the field, an expert-parallel layer this runtime cannot run."""
    if s.ep == 1:
        return
    layer = plan.model.layers[i]
    if layer.kind != LayerKind.MOE_DECODER:
        raise TesseraError(f"{where}.ep={s.ep}: expert parallelism applies to MoE layers only")
    if layer.num_experts % s.ep:
        raise TesseraError(f"{where}.ep={s.ep} does not divide the layer's {layer.num_experts} experts")


# --- the all-to-all with uneven splits -----------------------------------------------------------


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    x = x.contiguous()
    # A contiguous output: gloo writes a strided one in the wrong order without complaint.
    out = torch.empty((sum(out_splits), *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows of x go to the ranks of `group` in_splits[i] at a time; out_splits[i] come from rank i.
    The backward sends the gradients back the same way (splits swapped). `counter(rows)` is told
    the rows sent to other ranks, for the reports."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, counter):
        ctx.args = (out_splits, in_splits, group, counter)
        counter(in_splits, x)
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, group, counter = ctx.args
        counter(out_splits, grad)
        return _exchange(grad, in_splits, out_splits, group), None, None, None, None


# --- the context a MoE layer runs with ------------------------------------------------------------


class ExpertParallelContext(MoEContext):
    """A MoE layer on the ranks of its stage (module docstring); ep = 1 keeps the experts local
    and only makes the router statistics global."""

    def __init__(self, moe: MoE, *, token_group=None, token_pieces: int = 1, seq_group=None,
                 seq_pieces: int = 1, seq_rank: int = 0, ep_group=None, ep: int = 1, ep_rank: int = 0,
                 aux_grad_scale: float | None = None, tp: int = 1):
        self.moe_stats = moe.stats
        self.num_experts = moe.num_experts
        self.token_group, self.token_pieces = token_group, token_pieces
        self.seq_group, self.seq_pieces, self.seq_rank = seq_group, seq_pieces, seq_rank
        self.ep_group, self.ep, self.ep_rank = ep_group, ep, ep_rank
        self.aux_grad_scale = aux_grad_scale
        self.tp = tp

    def reduce_counts(self, counts: torch.Tensor) -> torch.Tensor:
        if self.token_pieces == 1:
            return counts
        counts = counts.clone()
        dist.all_reduce(counts, group=self.token_group)
        return counts

    def sequence_counts(self, per_choice: torch.Tensor):
        if self.seq_pieces == 1:
            return 0, per_choice
        pieces = torch.empty((self.seq_pieces * per_choice.shape[0], *per_choice.shape[1:]),
                             dtype=per_choice.dtype, device=per_choice.device)
        dist.all_gather_into_tensor(pieces, per_choice.contiguous(), group=self.seq_group)
        pieces = pieces.view(self.seq_pieces, *per_choice.shape)
        return pieces[:self.seq_rank].sum(0), pieces.sum(0)

    def _count_sent(self, splits: list[int], x: torch.Tensor) -> None:
        others = sum(splits) - splits[self.ep_rank]
        self.moe_stats.a2a_bytes += others * x[0].numel() * x.element_size() if len(x) else 0

    def dispatch(self, x: torch.Tensor, token: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        if self.ep == 1:
            return super().dispatch(x, token, counts, experts)
        per = self.num_experts // self.ep
        send = counts.view(self.ep, per)
        recv = torch.empty(send.shape, dtype=send.dtype, device=send.device)
        dist.all_to_all_single(recv, send.contiguous(), group=self.ep_group)  # recv[src, j]: slots for my j
        send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        rows = _AllToAll.apply(x[token], recv_splits, send_splits, self.ep_group, self._count_sent)
        # Received rows are grouped by source, then expert: regroup them by expert.
        expert_of_row = torch.repeat_interleave(torch.arange(per, device=x.device).repeat(self.ep), recv.flatten())
        order = torch.argsort(expert_of_row, stable=True)
        y = experts(rows[order], recv.sum(0).tolist())
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order), device=order.device)
        return _AllToAll.apply(y[inverse], send_splits, recv_splits, self.ep_group, self._count_sent)


# --- applying a plan ------------------------------------------------------------------------------


def loss_pieces(plan: Plan) -> int:
    head = plan.layers[-1]
    return head.dp * head.sp_degree


def aux_grad_scale(plan: Plan) -> float:
    """P, divided by m without a pipeline (module docstring: Router losses)."""
    pieces = loss_pieces(plan)
    return float(pieces) if plan.pipeline.degree > 1 else pieces / plan.num_micro_batches


def expert_mesh(dims: ParallelDims, layout: ExpertLayout):
    return dims.rank_mesh(layout.mesh_shape(dims.pp), EXPERT_AXES)


def parallelize_moe(moe: MoE, s: LayerStrategy, plan: Plan, dims: ParallelDims, rank: int) -> None:
    """Install the layer's context (global router statistics, expert parallelism), keep this rank's
    experts, and make the experts and the shared expert tensor parallel under tp > 1."""
    layout = ExpertLayout.of(s)
    coords = layer_coords(rank, dims.stage_size, s.dp, s.sp_degree, s.tp)
    stage_rank = dims.stage_rank(rank)
    pieces = s.dp * s.sp_degree
    kwargs: dict = dict(token_pieces=pieces, aux_grad_scale=aux_grad_scale(plan), tp=s.tp)
    if pieces > 1 and plan.model.config.router_aux_loss_coef:
        kwargs["token_group"] = token_mesh(dims, s).get_group("tokens")
    if s.sp_degree > 1 and plan.model.config.capacity_factor is not None:
        kwargs.update(seq_group=dims.sp_group(LayerLayout.of(s)), seq_pieces=s.sp_degree, seq_rank=coords.sp)
    mesh = None
    if s.ep > 1:
        if moe.num_experts % s.ep:
            raise TesseraError(f"ep={s.ep} does not divide the layer's {moe.num_experts} experts")
        mesh = expert_mesh(dims, layout)
        ep_rank = layout.ep_rank(stage_rank)
        moe.experts.keep(layout.local_experts(moe.num_experts, ep_rank))
        kwargs.update(ep_group=mesh.get_group("ep"), ep=s.ep, ep_rank=ep_rank)
    moe.context = ExpertParallelContext(moe, **kwargs)
    if s.tp > 1:
        dense_tp = dims.layer_mesh(LayerLayout.of(s))[Axis.TP]
        _tp_experts(moe, mesh["tp"] if mesh is not None else dense_tp, dense_tp)


def _tp_experts(moe: MoE, tp_mesh, dense_tp_mesh) -> None:
    """The experts sliced over the tp ranks (`TensorParallelExperts`); the shared expert column-
    parallel in, row-parallel out, like a dense MLP (DTensor)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def mlp_plan(mlp: nn.Module) -> dict:
        plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
        if hasattr(mlp, "w3"):
            plan["w3"] = ColwiseParallel()
        return plan

    if any(m.bias is not None for e in moe.experts for m in e.modules() if isinstance(m, nn.Linear)):
        for e in moe.experts.indices:  # biased experts (no preset has them): DTensor per expert
            parallelize_module(moe.experts[e], tp_mesh, mlp_plan(moe.experts[e]))
    else:
        moe.experts = TensorParallelExperts({e: moe.experts[e] for e in moe.experts.indices}, tp_mesh)
    if hasattr(moe, "shared_expert"):
        parallelize_module(moe.shared_expert, dense_tp_mesh, mlp_plan(moe.shared_expert))


class _CopyToTP(torch.autograd.Function):
    """Identity forward; backward sums the tp ranks' partial input gradients (one all-reduce)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Sum of the tp ranks' partial outputs (one all-reduce); identity backward."""

    @staticmethod
    def forward(ctx, y, group):
        y = y.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if hasattr(w, "to_local") else w


class TensorParallelExperts(Experts):
    """Experts sliced over the tp ranks as Megatron slices an MLP: w1 and w3 by rows, w2 by columns
    (DTensor parameters on the tp mesh, so FSDP2 and checkpoints see whole experts). Every tp rank
    routes the same tokens; each runs its slices of all its experts, and the tp ranks exchange once
    each way for all of them: the partial outputs summed by one all-reduce in the forward, the
    partial input gradients by one in the backward."""

    def __init__(self, experts: dict[int, nn.Module], tp_mesh):
        from torch.distributed.tensor import Shard, distribute_tensor

        super().__init__(experts)
        self.group = tp_mesh.get_group()
        for expert in self:
            for name, dim in (("w1", 0), ("w3", 0), ("w2", 1)):
                lin = getattr(expert, name, None)
                if lin is not None:
                    lin.weight = nn.Parameter(distribute_tensor(lin.weight, tp_mesh, [Shard(dim)], src_data_rank=None),
                                              requires_grad=lin.weight.requires_grad)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        x = _CopyToTP.apply(x, self.group)
        outs = []
        for expert, part in zip(self, x.split(counts)):
            if expert.swiglu:
                h = F.silu(F.linear(part, _local(expert.w1.weight))) * F.linear(part, _local(expert.w3.weight))
            else:
                h = F.gelu(F.linear(part, _local(expert.w1.weight)), approximate="tanh")
            outs.append(F.linear(h, _local(expert.w2.weight)))
        y = torch.cat(outs) if outs else x[:0]
        return _ReduceFromTP.apply(y, self.group)


def shard_experts(module: nn.Module, s: LayerStrategy, plan: Plan, dims: ParallelDims, mp_policy, result) -> bool:
    """FSDP2 on the experts of an expert-parallel block over their replicas (the "edp" axes of the
    expert mesh), before the block's own `fully_shard`; registers the units with `result.sync` and
    their gradient rescale R / P in `result.grad_rescale`. Experts held by one rank (R = 1) are
    sharded over a mesh of one too: their parameters are then DTensors on the expert mesh, whose
    "ep" axis the gradient norm sums over (optim.grad_norm). Returns whether it sharded any."""
    if s.ep == 1:
        return False
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from .grad_sync import ShardedUnit

    layout = ExpertLayout.of(s)
    mesh = expert_mesh(dims, layout)
    found = False
    for moe in moe_layers(module):
        axes = ("edp_shard",) if layout.replicas == layout.expert_shard else ("edp_replicate", "edp_shard")
        kwargs = dict(mesh=mesh[axes if len(axes) > 1 else axes[0]], reshard_after_forward=s.zero >= 3)
        if mp_policy is not None:
            kwargs["mp_policy"] = mp_policy
        if s.offload_optimizer:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=dims.device_type == "cuda")
        fully_shard(moe.experts, **kwargs)
        for p in moe.experts.parameters():  # FSDP2's sharded parameters: DTensors on the edp (x tp) mesh
            _EP_GROUPS[id(p.device_mesh)] = (p.device_mesh, mesh.get_group("ep"))
        result.sync.units.append(ShardedUnit(moe.experts, s.zero))
        if layout.replicas != loss_pieces(plan):
            result.grad_rescale.append(([moe.experts], layout.replicas / loss_pieces(plan)))
        found = True
    return found


# id(mesh) -> (mesh, ep group) for the meshes expert parameters live on (their names start with
# "edp"); DeviceMesh hands out one object per (ranks, names), so the latest plan's entry wins.
_EP_GROUPS: dict[int, tuple] = {}


def ep_group_of(mesh):
    """The expert-parallel group whose ranks hold the other experts, for a mesh expert parameters
    live on; None for any other mesh."""
    entry = _EP_GROUPS.get(id(mesh))
    if entry is None or entry[0] is not mesh or not any(n.startswith("edp") for n in (mesh.mesh_dim_names or ())):
        return None
    return entry[1]


def dense_modules(module: nn.Module) -> list[nn.Module]:
    """The modules of `module` holding parameters of their own, experts' excepted (for a rescale
    that the experts get separately)."""
    inside = {id(m) for e in module.modules() if isinstance(e, Experts) for m in e.modules()}
    return [m for m in module.modules() if id(m) not in inside and any(True for _ in m.parameters(recurse=False))]


def build_expert_meshes(plan: Plan, dims: ParallelDims) -> None:
    """Create the MoE layers' meshes (expert mesh, router-statistics group) in plan order on every
    rank (`ParallelDims.build_all`: group creation is collective over the world)."""
    cfg = plan.model.config
    for layer, s in zip(plan.model.layers, plan.layers):
        if layer.kind != LayerKind.MOE_DECODER:
            continue
        if s.ep > 1:
            expert_mesh(dims, ExpertLayout.of(s))
        if cfg is not None and cfg.router_aux_loss_coef and s.dp * s.sp_degree > 1:
            token_mesh(dims, s)


def token_mesh(dims: ParallelDims, s: LayerStrategy):
    return dims.rank_mesh((dims.pp, s.dp * s.sp_degree, s.tp), (Axis.PP, "tokens", Axis.TP))


# --- reports ---------------------------------------------------------------------------------------


def moe_step_stats(parts: list[nn.Module], plan: Plan, device) -> dict | None:
    """Routing per step since the last call, over all ranks (a collective: every rank calls it).

    {"tokens_per_expert": {block index: token-slots routed to each expert per step (before
    capacity drops)}, "a2a_bytes": bytes all ranks sent to other ranks in all-to-alls per step,
    "aux_loss": the layers' router losses per step (mean over micro-batches)}; None without MoE."""
    cfg = plan.model.config
    if cfg is None or not cfg.num_experts or not dist.is_initialized():
        return None
    counts = torch.zeros(cfg.num_layers, cfg.num_experts, dtype=torch.float64, device=device)
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # a2a bytes, aux, forward calls per layer
    for index, moe in _indexed(parts):
        st, tp = moe.stats, getattr(moe.context, "tp", 1)
        if st.routed is not None:  # tp replicas route the same tokens: count them once
            counts[index] += st.routed.to(device=device, dtype=torch.float64) / tp
        totals[0] += st.a2a_bytes
        totals[1] += float(st.aux) / tp
        totals[2] = max(float(totals[2]), st.calls)
        st.reset()
    calls = totals[2].clone()
    dist.all_reduce(counts)
    dist.all_reduce(totals[:2])
    dist.all_reduce(calls, op=dist.ReduceOp.MAX)
    steps = max(1.0, float(calls) / plan.num_micro_batches)
    layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    return {"tokens_per_expert": {str(i): [round(float(c) / steps) for c in counts[i]] for i in layers},
            "a2a_bytes": float(totals[0]) / steps, "aux_loss": float(totals[1]) / steps / plan.num_micro_batches}


def _indexed(parts: list[nn.Module]):
    """(block index, MoE) of every MoE layer in the parts (names look through wrappers)."""
    for part in parts:
        for name, module in part.named_modules():
            if isinstance(module, MoE):
                path = name.split(".")
                yield int(path[path.index("layers") + 1]), module
