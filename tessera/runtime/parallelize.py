"""Apply a Plan's per-layer strategies to a single-device Transformer with PyTorch's machinery.

Order per layer (torchtitan's): tensor parallel (DTensor `parallelize_module`: Colwise/Rowwise,
Megatron sequence parallel, vocabulary-parallel embedding and LM head with loss parallel) ->
Ulysses or context-parallel (ring) attention -> activation recompute (`checkpoint_wrapper`, selective via
`create_selective_checkpoint_contexts`) -> optional `torch.compile` -> data parallel.

Data parallel and ZeRO:
- DDP path (the plan is homogeneous, tp = 1, ZeRO 0, no pipeline): one `DistributedDataParallel`
  over the dp x cp x sp ranks, wrapped after the parameters are materialised (`wrap_ddp`).
- FSDP2 path (everything else): `fully_shard` per layer on that layer's mesh: ZeRO-3 reshards after
  forward, ZeRO-1/2 do not, HSDP shards over `dp_shard` and replicates across (the shard group
  takes in the context-parallel ranks, which hold the same parameters: dp x cp), ZeRO-0 is HSDP
  with a shard group of one (pure replication, an all-reduce), `CPUOffloadPolicy` for
  offload_optimizer. ZeRO-1 is FSDP2 that reduce-scatters once per step (`grad_sync`): the
  priced reduce-scatter + all-gather, sharded optimizer state, and a DTensor state that checkpoints
  and reshards like ZeRO-2/3 (`ZeroRedundancyOptimizer` instead broadcasts every parameter from
  its owner after the step, cannot hold DTensors and does not reshard on load).
  How often each unit reduces and re-gathers over micro-batches: `grad_sync.GradSync`.

Build: `parallelize` works on a meta-device model, allocates nothing and issues no collective
(so a dry run can apply it at any world size); `materialize.materialize(result.chunk, ...)` then
allocates and initialises the local shards, and `result.wrap_ddp()` wraps DDP plans.

Gradient scale: rank r's loss is the mean over its own (batch, sequence) piece of the LM head's
layout, P = dp_head * cp_head * sp_head pieces. A layer whose parameters are replicated over
g = dp * cp * sp ranks averages gradients over g; when g != P (layer-wise heterogeneity) its gradients are rescaled
by g / P after backward (`GradScaler`-free: one foreach multiply).

Tied embeddings: when the embedding and LM head layers shard alike the head uses the embedding's
parameter (the search gives the pair one layout, and the cost model prices the weight once);
otherwise the head holds its own copy (same initial value) and after backward both receive
g_embedding + g_head (`sync_tied_grads`: each shard adds the other copy's rows of it, one
all-to-all of gradient shards, `runtime/tied_sync.py`), so they take identical optimizer steps;
the gradient norm counts the tied weight once.
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from ..errors import TesseraError
from ..models.transformer import Transformer
from ..plan import LayerStrategy, Plan, Recompute, Schedule, SPKind
from ..spec.model import LayerKind
from .expert_parallel import check_moe_layer, dense_modules, parallelize_moe, shard_experts
from .grad_sync import GradSync, ShardedUnit
from .materialize import EMBEDDING_WEIGHT, HEAD_WEIGHT, canonical_name
from .mesh import Axis, LayerLayout, ParallelDims
from .parallel_model import ParallelLoss, ParallelTransformer, StageContext

log = logging.getLogger(__name__)


# --- what the runtime can run ---------------------------------------------------------------------


def check_plan_supported(plan: Plan, world_size: int | None = None, *, pipeline_available: bool = False) -> None:
    """Refuse, in one sentence naming the field, a plan this runtime cannot execute exactly."""
    if world_size is not None:
        plan.check_matches(world_size=world_size)
    cfg = plan.model.config
    if cfg is None:
        raise TesseraError("plan.model.config is missing: the runtime needs the architecture to build the model")
    kinds = [layer.kind for layer in plan.model.layers]
    if kinds[0] != LayerKind.EMBEDDING or kinds[-1] != LayerKind.LM_HEAD:
        raise TesseraError("plan.model.layers must start with the embedding and end with the lm_head")
    if plan.workload.grad_dtype != "fp32":
        raise TesseraError(f"plan.workload.grad_dtype={plan.workload.grad_dtype}: the runtime keeps and reduces "
                           "gradients in fp32 (plan with grad_dtype fp32)")
    if plan.pipeline.degree > 1 and not pipeline_available:
        raise TesseraError(f"plan.pipeline.degree={plan.pipeline.degree}: pipeline parallelism is not "
                           "available in this runtime build")
    for i, layer in enumerate(plan.model.layers):
        for field, what in (("recompute_replays_all", "a reentrant checkpoint replaying the whole forward"),
                            ("grad_sync_after_backward", "a gradient sync after the whole backward")):
            if getattr(layer, field):
                raise TesseraError(f"plan.model.layers[{i}].{field}=true prices another system's execution "
                                   f"({what}); this runtime does not run it (build the model spec with the defaults)")
    pipe = plan.pipeline
    if pipe.degree > 1 and pipe.schedule == Schedule.ONE_F_ONE_B and plan.num_micro_batches < pipe.degree:
        raise TesseraError(f"plan.num_micro_batches={plan.num_micro_batches}: schedule 1f1b needs at least "
                           f"pipeline.degree={pipe.degree} micro-batches (use gpipe or zero_bubble)")
    for i, s in enumerate(plan.layers):
        where = f"plan.layers[{i}] ({plan.model.layers[i].name})"
        check_moe_layer(plan, i, s, where)
        if s.offload_optimizer and not s.zero:
            raise TesseraError(f"{where}.offload_optimizer needs zero >= 1 (FSDP2 CPU offload shards the state)")
        if s.tp > 1 and kinds[i] in (LayerKind.DECODER, LayerKind.MOE_DECODER):
            if cfg.num_heads % s.tp or cfg.num_kv_heads % s.tp:
                raise TesseraError(f"{where}.tp={s.tp} does not divide the {cfg.num_heads} heads / "
                                   f"{cfg.num_kv_heads} KV heads")
        if s.cp > 1 and any(layer.num_experts for layer in plan.model.layers):
            raise TesseraError(f"{where}.cp={s.cp}: context parallelism in a mixture-of-experts model is not "
                               "supported (its router statistics and expert groups count dp x sp pieces)")
        if s.sp == SPKind.ULYSSES and kinds[i] in (LayerKind.DECODER, LayerKind.MOE_DECODER):
            if (cfg.num_heads // s.tp) % s.sp_degree:
                raise TesseraError(f"{where}.sp_degree={s.sp_degree} does not divide the "
                                   f"{cfg.num_heads // s.tp} heads per tensor-parallel rank")


def uses_ddp(plan: Plan) -> bool:
    """The plan is plain data parallelism (optionally with Ulysses) without ZeRO, on one layout."""
    first = plan.layers[0]
    same = all((s.dp, s.cp, s.sp_degree, s.tp, s.zero, s.dp_shard)
               == (first.dp, first.cp, first.sp_degree, first.tp, first.zero, first.dp_shard)
               for s in plan.layers)
    return (same and plan.pipeline.degree == 1 and first.tp == 1 and first.zero == 0
            and not first.dp_shard and not any(s.offload_optimizer for s in plan.layers)
            and all(s.ep == 1 for s in plan.layers))  # experts reduce over their own replicas


# --- strategies -----------------------------------------------------------------------------------


def _tp_block(block: nn.Module, s: LayerStrategy, tp_mesh) -> None:
    """Megatron tensor parallel (+ sequence parallel) on one decoder block.

    The attention and MLP inputs enter as replicated DTensors (`use_local_output=False`): the
    backward then sums the partial input gradients of wq, wk, wv (w1, w3) as DTensors and
    reduces them once (one all-reduce, or one reduce-scatter under sequence parallelism), as
    Megatron does, instead of once per projection."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    sp = s.sp == SPKind.MEGATRON
    out = Shard(1) if sp else Replicate()
    inp = Shard(1) if sp else Replicate()
    plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=out)}
    plan["attention"] = PrepareModuleInput(input_layouts=(inp, None, None),
                                           desired_input_layouts=(Replicate(), None, None),
                                           use_local_output=False)
    if sp:
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
    if hasattr(block, "moe"):  # the MoE layer gathers and reduces over tp itself (runtime/expert_tp.py)
        if sp:
            plan["moe"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                             use_local_output=True)
    else:
        plan["feed_forward.w1"] = ColwiseParallel()
        plan["feed_forward.w2"] = RowwiseParallel(output_layouts=out)
        if hasattr(block.feed_forward, "w3"):
            plan["feed_forward.w3"] = ColwiseParallel()
        plan["feed_forward"] = PrepareModuleInput(input_layouts=(inp,), desired_input_layouts=(Replicate(),),
                                                  use_local_output=False)
    parallelize_module(block, tp_mesh, plan)


def _tp_embedding_and_head(model: ParallelTransformer, first: LayerStrategy | None,
                           last: LayerStrategy | None, dims: ParallelDims, tied: bool) -> None:
    if first is not None and first.tp > 1:
        from .tp_embedding import VocabParallelEmbedding

        mesh = dims.layer_mesh(LayerLayout.of(first))[Axis.TP]
        model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, mesh,
                                                      sequence_parallel=first.sp == SPKind.MEGATRON)
    if last is not None and last.tp > 1:
        tp_head(model.norm, model.output, dims.layer_mesh(LayerLayout.of(last))[Axis.TP],
                sequence_parallel=last.sp == SPKind.MEGATRON)
        if tied:
            model.output.weight = model.tok_embeddings.weight


def tp_head(norm: nn.Module, output: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    """The LM head tensor parallel: the vocabulary projection column-parallel with its logits left
    sharded over the vocabulary (a DTensor, for `loss_parallel`); with Megatron sequence
    parallelism the final norm runs on sequence shards and the projection gathers them."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module

    if sequence_parallel:
        parallelize_module(norm, tp_mesh, SequenceParallel())
    parallelize_module(output, tp_mesh, ColwiseParallel(
        input_layouts=Shard(1) if sequence_parallel else Replicate(), output_layouts=Shard(-1),
        use_local_output=False))


def _selective_policy():
    """Save matmul outputs (and collectives' results); recompute everything else incl. attention."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    save = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default}
    c10d = getattr(torch.ops, "_c10d_functional", None)
    if c10d is not None:
        for name in ("reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce"):
            if hasattr(c10d, name):
                save.add(getattr(c10d, name).default)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _recompute(module: nn.Module, mode: Recompute) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if mode == Recompute.FULL:
        return checkpoint_wrapper(module, preserve_rng_state=False)
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return checkpoint_wrapper(module, preserve_rng_state=False,
                              context_fn=partial(create_selective_checkpoint_contexts, _selective_policy()))


def _fsdp_kwargs(s: LayerStrategy, dims: ParallelDims, mp_policy) -> dict | None:
    """fully_shard arguments of one layer, or None when its parameters live on one rank."""
    layout = LayerLayout.of(s)
    if layout.dp * layout.cp * layout.sp == 1 and mp_policy is None and not s.offload_optimizer:
        return None  # nothing to shard; FSDP2 on one rank still casts (mixed precision) or offloads
    from torch.distributed.fsdp import CPUOffloadPolicy

    mesh = dims.layer_mesh(layout)
    if layout.replicate == 1:
        dp_mesh = mesh[Axis.DP_SHARD]
    else:
        dp_mesh = mesh[(Axis.DP_REPLICATE, Axis.DP_SHARD)]
    kwargs = dict(mesh=dp_mesh, reshard_after_forward=s.zero >= 3)
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if s.offload_optimizer:
        # Pinned host memory only helps (and only exists) with an accelerator.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=dims.device_type == "cuda")
    return kwargs


@dataclass
class Parallelized:
    """The result of `parallelize`: the module to train and what the optimizer step needs."""

    module: nn.Module  # a ParallelTransformer, or DDP around one (after `wrap_ddp`)
    chunk: ParallelTransformer
    loss: ParallelLoss
    # (modules, factor): gradients of the modules' parameters to multiply by factor after backward
    # (heterogeneous plans). Modules, not parameters: sharding and materialising replace parameters.
    grad_rescale: list[tuple[list[nn.Module], float]] = field(default_factory=list)
    sync: GradSync = field(default_factory=GradSync)  # the FSDP2 units and their ZeRO stages
    ddp_group: object = None  # the DDP path's process group (dp x sp ranks), None otherwise
    untied_head: bool = False  # tied embeddings sharded two ways: the head holds a copy
    # The copies' layouts, this rank, the vocabulary and the device of their gradient exchange.
    tied_exchange: tuple | None = None

    @property
    def tied_head_copy(self) -> nn.Parameter | None:
        """The LM head's copy of a tied embedding (None when the weight is truly shared)."""
        return _find_param(self.chunk, HEAD_WEIGHT) if self.untied_head else None

    def sync_tied_grads(self) -> None:
        """Give the embedding and its head copy the tied gradient g_embedding + g_head."""
        if self.untied_head:
            from .tied_sync import exchange_tied_gradients

            copies, vocab, rank, device = self.tied_exchange
            grads = {0: _find_param(self.chunk, EMBEDDING_WEIGHT).grad, 1: _find_param(self.chunk, HEAD_WEIGHT).grad}
            exchange_tied_gradients(grads, copies, vocab, rank, list(range(copies[0].size)), device=device)

    def wrap_ddp(self) -> None:
        """Wrap a DDP plan's materialised chunk in `DistributedDataParallel` (no-op otherwise).

        No broadcast at start (`init_sync=False`): every rank initialised the same values."""
        if self.ddp_group is None or self.module is not self.chunk:
            return
        if any(p.is_meta for p in self.chunk.parameters()):
            raise TesseraError("wrap_ddp needs the materialised model (call materialize first)")
        from torch.nn.parallel import DistributedDataParallel as DDP

        # Gradients as views into DDP's buckets, from the first step on: DDP turns gradients that
        # exist when it is built into bucket views, and the trainer zeroes them in place between
        # steps (`grads_in_buckets`), so micro-batches under `no_sync` accumulate into the buckets
        # and no second gradient copy ever exists (cost/layer.py prices one).
        for p in self.chunk.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        with warnings.catch_warnings():  # the rename of broadcast_buffers is newer than torch 2.11
            warnings.simplefilter("ignore", FutureWarning)
            # Buffers (RoPE tables) are computed identically on every rank: no per-step broadcast.
            self.module = DDP(self.chunk, process_group=self.ddp_group, broadcast_buffers=False,
                              init_sync=False, gradient_as_bucket_view=True)

    @property
    def grads_in_buckets(self) -> bool:
        """The gradients are DDP bucket views: zero them in place, never set them to None."""
        return self.module is not self.chunk
    def rescale_grads(self) -> None:
        for modules, factor in self.grad_rescale:
            by_mesh: dict = {}  # foreach kernels never mix meshes (or DTensors with tensors)
            for p in {id(p): p for m in modules for p in m.parameters()}.values():
                if p.grad is not None:
                    by_mesh.setdefault(id(getattr(p.grad, "device_mesh", None)), []).append(p.grad)
            for grads in by_mesh.values():
                torch._foreach_mul_(grads, factor)


def parallelize(model: Transformer, plan: Plan, dims: ParallelDims, rank: int,
                layers: range | None = None, *, compile: bool = False,
                mp_policy=None) -> Parallelized:
    """Apply the plan to `model` (or to the chunk of plan layers `layers`) on this rank.

    Works on a meta-device model: allocates nothing and issues no collective (it creates the
    plan's process groups, `ParallelDims.build_all`). Then `materialize(result.chunk, ...)` and
    `result.wrap_ddp()`."""
    dims.build_all(plan)
    ctx = StageContext.build(plan, dims, rank)
    layers = layers if layers is not None else range(len(plan.layers))
    chunk = ParallelTransformer(model, ctx, layers)
    strategies = plan.layers
    first = strategies[0] if chunk.has_embedding else None
    last = strategies[-1] if chunk.has_head else None

    # 1. tensor parallel, Ulysses, recompute, compile: per block.
    for key in list(chunk.layers):
        s = strategies[int(key) + 1]
        block = chunk.layers[key]
        if hasattr(block, "moe"):
            parallelize_moe(block.moe, s, plan, dims, rank)
        if s.tp > 1:
            _tp_block(block, s, dims.layer_mesh(LayerLayout.of(s))[Axis.TP])
        if s.cp > 1:
            from .context_parallel import ContextParallelAttention

            layout = LayerLayout.of(s)
            block.attention.core = ContextParallelAttention(
                dims.cp_group(layout), dims.sp_group(layout) if s.sp == SPKind.ULYSSES else None)
        elif s.sp == SPKind.ULYSSES:
            block.attention.core = _ulysses(dims.sp_group(LayerLayout.of(s)))
        if s.recompute != Recompute.NONE:
            block = _recompute(block, s.recompute)
        if compile:
            block = torch.compile(block)
        chunk.layers[key] = block
    # Tied embeddings whose embedding and head layers shard differently: the head gets its own
    # copy (same initial value, `materialize`), and the two gradients are summed after backward.
    tied = model.config.tie_embeddings and first is not None and last is not None
    untie = tied and LayerLayout.of(first) != LayerLayout.of(last)
    if untie:
        chunk.output.weight = nn.Parameter(torch.empty_like(chunk.tok_embeddings.weight))
    _tp_embedding_and_head(chunk, first, last, dims, tied and not untie)
    if first is not None and first.recompute == Recompute.FULL:
        chunk.tok_embeddings = _recompute(chunk.tok_embeddings, Recompute.FULL)
    if last is not None and last.recompute == Recompute.FULL:
        chunk.norm = _recompute(chunk.norm, Recompute.FULL)

    result = Parallelized(module=chunk, chunk=chunk, loss=ParallelLoss(ctx), untied_head=untie)
    if untie:  # one stage (the world): both copies on every rank
        from ..cost.tied import TableShards

        n = plan.stage_size
        device = torch.device("cuda", torch.cuda.current_device()) if dims.device_type == "cuda" else None
        result.tied_exchange = ([TableShards.of(first, 0, n), TableShards.of(last, 0, n)], model.config.vocab_size,
                                rank, device)
    pieces = result.loss.pieces
    if uses_ddp(plan):
        layout = LayerLayout.of(strategies[0])
        if layout.dp * layout.cp * layout.sp > 1:
            result.ddp_group = dims.layer_mesh(LayerLayout(layout.dp, layout.sp, 1, 1, layout.cp)).get_group(
                Axis.DP_REPLICATE)
        return result

    # 2. FSDP2 per unit, then the root (which keeps tied weights).
    from torch.distributed.fsdp import fully_shard

    # One unit per plan layer, each with its own ZeRO stage (the cost model prices each layer's
    # collectives): every block, and the LM head's norm and projection together; the root (the
    # chunk) holds the embedding, and the head's projection when it is the tied embedding itself.
    root = first if first is not None else (last if last is not None else strategies[layers.start])
    units = [([block], strategies[int(key) + 1]) for key, block in chunk.layers.items()]
    if first is not None:
        _note_rescale(result, [m for m in (chunk.tok_embeddings, chunk.pos_embeddings) if m is not None],
                      first, pieces)
    if last is not None:
        units.append(([chunk.norm] if tied and not untie else [chunk.norm, chunk.output], last))
    unsharded: set[nn.Parameter] = set()  # parameters of layers that live on one rank (dp * cp * sp = 1)
    in_order: list[ShardedUnit] = []  # the plan layers' units in forward order
    nested = False  # some block's experts are FSDP units of their own, inside it
    for modules, s in units:
        experts = shard_experts(modules[0], s, plan, dims, mp_policy, result) if len(modules) == 1 else False
        nested = nested or bool(experts)
        kw = _fsdp_kwargs(s, dims, mp_policy)
        if kw is not None:
            fully_shard(modules[0] if len(modules) == 1 else modules, **kw)
            result.sync.units.append(ShardedUnit(modules[0], s.zero))  # a unit's modules share its state
            in_order.append(result.sync.units[-1])
            sharded_kw = kw
        else:
            unsharded.update(p for m in modules for p in m.parameters())
        _note_rescale(result, dense_modules(modules[0]) if experts else modules, s, pieces)
    kw = _fsdp_kwargs(root, dims, mp_policy)
    if kw is not None:
        fully_shard(chunk, **kw, **({"ignored_params": unsharded} if unsharded else {}))
        result.sync.units.append(ShardedUnit(chunk, root.zero))
        # The root's own parameters: the embedding's (first in forward), else a tied head's (last).
        in_order.insert(0 if first is not None else len(in_order), result.sync.units[-1])
    elif in_order:
        # The root's parameters live on one rank, but FSDP2 needs one root over its units (a unit
        # of several modules cannot be a root): a root that shards none of its own.
        in_units = {p for modules, _ in units for m in modules for p in m.parameters()}
        ignored = unsharded | {p for p in chunk.parameters() if p not in in_units}
        fully_shard(chunk, **sharded_kw, ignored_params=ignored)
        result.sync.units.append(ShardedUnit(chunk, in_order[-1].zero))
    if not nested:
        # Not with nested expert units: an explicit prefetch of a block re-gathers inside the
        # recompute of the block after it, which selective checkpointing (which counts every op
        # of the forward and its replay) refuses; FSDP2's own order serves them.
        _backward_prefetch(in_order)
    return result


def _backward_prefetch(order: list[ShardedUnit]) -> None:
    """Each unit's backward prefetches the unit before it in forward order when that one is
    ZeRO-3 (the gather the contract prices), else nothing (the unit prefetches itself: a no-op).

    FSDP2's default walks its post-forward order, which spans the micro-batches of a step: the
    first unit of a micro-batch's backward would gather the previous micro-batch's last unit
    again after the step's last backward resharded it (one all-gather and an unsharded copy the
    contract does not have)."""
    for prev, unit in zip([None] + order[:-1], order):
        target = prev if prev is not None and prev.zero >= 3 else unit
        unit.module.set_modules_to_backward_prefetch([target.module])


def _note_rescale(result: Parallelized, modules: list[nn.Module], s: LayerStrategy, pieces: int) -> None:
    replicas = s.dp * s.cp * s.sp_degree
    if replicas != pieces:
        result.grad_rescale.append((modules, replicas / pieces))


def _ulysses(group) -> nn.Module:
    try:
        from .attention import UlyssesAttention
    except ImportError:
        raise TesseraError("sp=ulysses needs tessera.runtime.attention.UlyssesAttention, "
                           "which this build does not have") from None
    return UlyssesAttention(group)


def _find_param(module: nn.Module, name: str) -> nn.Parameter | None:
    """The parameter of `module` named `name` in the one-process model (through wrappers)."""
    for n, p in module.named_parameters():
        if canonical_name(n) == name:
            return p
    return None
