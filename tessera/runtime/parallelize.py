"""Apply a Plan's per-layer strategies to a single-device Transformer with PyTorch's machinery.

Order per layer (torchtitan's): tensor parallel (DTensor `parallelize_module`: Colwise/Rowwise,
Megatron sequence parallel, vocabulary-parallel embedding and LM head with loss parallel) ->
Ulysses attention -> activation recompute (`checkpoint_wrapper`, selective via
`create_selective_checkpoint_contexts`) -> optional `torch.compile` -> data parallel.

Data parallel and ZeRO:
- DDP path (the plan is homogeneous, tp = 1, ZeRO 0 or 1, no pipeline): one `DistributedDataParallel`
  over the dp x sp ranks; ZeRO-1 is `ZeroRedundancyOptimizer` (optimizer state sharded, gradients
  all-reduced and kept whole — exactly ZeRO-1's memory).
- FSDP2 path (everything else): `fully_shard` per layer on that layer's mesh: ZeRO-3 reshards after
  forward, ZeRO-2 does not, HSDP shards over `dp_shard` and replicates across, ZeRO-0 is HSDP
  with a shard group of one (pure replication, an all-reduce), `CPUOffloadPolicy` for
  offload_optimizer. ZeRO-1 here runs as FSDP2 without resharding, which also shards gradients:
  the same communication volume and at most the plan's ZeRO-1 memory (FSDP2 has no ZeRO-1 mode,
  and ZeroRedundancyOptimizer cannot broadcast DTensor parameters).

Gradient scale: rank r's loss is the mean over its own (batch, sequence) piece of the LM head's
layout, P = dp_head * sp_head pieces. A layer whose parameters are replicated over g = dp * sp
ranks averages gradients over g; when g != P (layer-wise heterogeneity) its gradients are rescaled
by g / P after backward (`GradScaler`-free: one foreach multiply).
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
from ..plan import LayerStrategy, Plan, Recompute, SPKind
from ..spec.model import LayerKind
from .layout import ActLayout
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
    if plan.pipeline.degree > 1 and not pipeline_available:
        raise TesseraError(f"plan.pipeline.degree={plan.pipeline.degree}: pipeline parallelism is not "
                           "available in this runtime build")
    seq = plan.workload.seq_len
    for i, s in enumerate(plan.layers):
        where = f"plan.layers[{i}] ({plan.model.layers[i].name})"
        if s.ep > 1:
            raise TesseraError(f"{where}.ep={s.ep}: expert parallelism is not supported by the runtime yet")
        if s.offload_optimizer and not s.zero:
            raise TesseraError(f"{where}.offload_optimizer needs zero >= 1 (FSDP2 CPU offload shards the state)")
        act = ActLayout.of(s)
        if seq % act.seq_parts:
            raise TesseraError(f"{where}: seq_len {seq} does not split into {act.seq_parts} sequence shards")
        if s.tp > 1 and kinds[i] in (LayerKind.DECODER, LayerKind.MOE_DECODER):
            if cfg.num_heads % s.tp or cfg.num_kv_heads % s.tp:
                raise TesseraError(f"{where}.tp={s.tp} does not divide the {cfg.num_heads} heads / "
                                   f"{cfg.num_kv_heads} KV heads")
        if s.sp == SPKind.ULYSSES and kinds[i] in (LayerKind.DECODER, LayerKind.MOE_DECODER):
            if (cfg.num_heads // s.tp) % s.sp_degree:
                raise TesseraError(f"{where}.sp_degree={s.sp_degree} does not divide the "
                                   f"{cfg.num_heads // s.tp} heads per tensor-parallel rank")
    dp_min = min(s.dp for s in plan.layers)
    if any(s.dp % dp_min for s in plan.layers):
        raise TesseraError(f"plan.layers: every layer's dp must be a multiple of the smallest dp {dp_min}")
    if cfg.tie_embeddings and LayerLayout.of(plan.layers[0]) != LayerLayout.of(plan.layers[-1]):
        raise TesseraError("plan.layers: a model with tied embeddings needs the same dp/sp/tp/zero on "
                           "its embedding and lm_head layers")


def uses_ddp(plan: Plan) -> bool:
    """The plan is plain data parallelism (optionally ZeRO-1 / Ulysses) on one layout."""
    first = plan.layers[0]
    same = all((s.dp, s.sp_degree, s.tp, s.zero, s.dp_shard) == (first.dp, first.sp_degree, first.tp,
                                                                  first.zero, first.dp_shard)
               for s in plan.layers)
    return (same and plan.pipeline.degree == 1 and first.tp == 1 and first.zero <= 1
            and not first.dp_shard and not any(s.offload_optimizer for s in plan.layers))


# --- strategies -----------------------------------------------------------------------------------


def _tp_block(block: nn.Module, s: LayerStrategy, tp_mesh) -> None:
    """Megatron tensor parallel (+ sequence parallel) on one decoder block."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   PrepareModuleOutput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    sp = s.sp == SPKind.MEGATRON
    out = Shard(1) if sp else Replicate()
    plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=out)}
    if sp:
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
        plan["attention"] = PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                               desired_input_layouts=(Replicate(), None, None),
                                               use_local_output=True)
    if hasattr(block, "moe"):
        for e in range(len(block.moe.experts)):
            plan[f"moe.experts.{e}.w1"] = ColwiseParallel()
            plan[f"moe.experts.{e}.w2"] = RowwiseParallel()
            if hasattr(block.moe.experts[e], "w3"):
                plan[f"moe.experts.{e}.w3"] = ColwiseParallel()
        if sp:
            plan["moe"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                             use_local_output=True)
    else:
        plan["feed_forward.w1"] = ColwiseParallel()
        plan["feed_forward.w2"] = RowwiseParallel(output_layouts=out)
        if hasattr(block.feed_forward, "w3"):
            plan["feed_forward.w3"] = ColwiseParallel()
        if sp:
            plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                      use_local_output=True)
    parallelize_module(block, tp_mesh, plan)
    if sp and hasattr(block, "moe"):
        # Experts return replicated rows; the residual stream is sequence-sharded.
        parallelize_module(block.moe, tp_mesh, PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True))


def _tp_embedding_and_head(model: ParallelTransformer, first: LayerStrategy | None,
                           last: LayerStrategy | None, dims: ParallelDims) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    if first is not None and first.tp > 1:
        mesh = dims.layer_mesh(LayerLayout.of(first))[Axis.TP]
        parallelize_module(model.tok_embeddings, mesh,
                           RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    if last is not None and last.tp > 1:
        tp_head(model.norm, model.output, dims.layer_mesh(LayerLayout.of(last))[Axis.TP],
                sequence_parallel=last.sp == SPKind.MEGATRON)
        if model.config.tie_embeddings and first is not None:
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
    if layout.dp * layout.sp == 1 and mp_policy is None:
        return None  # nothing to shard; with mixed precision FSDP2 on one rank still casts
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

    module: nn.Module  # a ParallelTransformer, or DDP around one
    chunk: ParallelTransformer
    loss: ParallelLoss
    # (parameters, factor): gradients to multiply by factor after backward (heterogeneous plans).
    grad_rescale: list[tuple[list[nn.Parameter], float]] = field(default_factory=list)
    ddp_group: object = None  # process group of ZeRO-1 (ZeroRedundancyOptimizer) on the DDP path
    zero1: bool = False

    def rescale_grads(self) -> None:
        for params, factor in self.grad_rescale:
            by_mesh: dict = {}  # foreach kernels never mix meshes (or DTensors with tensors)
            for p in params:
                if p.grad is not None:
                    by_mesh.setdefault(id(getattr(p.grad, "device_mesh", None)), []).append(p.grad)
            for grads in by_mesh.values():
                torch._foreach_mul_(grads, factor)


def parallelize(model: Transformer, plan: Plan, dims: ParallelDims, rank: int,
                layers: range | None = None, *, compile: bool = False,
                mp_policy=None, root_only: bool = False) -> Parallelized:
    """Apply the plan to `model` (or to the chunk of plan layers `layers`) on this rank.

    `root_only`: one `fully_shard` for the whole chunk (zero-bubble pipelines need it); the
    chunk's layers must then share one sharding layout."""
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
        if s.tp > 1:
            _tp_block(block, s, dims.layer_mesh(LayerLayout.of(s))[Axis.TP])
        if s.sp == SPKind.ULYSSES:
            block.attention.core = _ulysses(dims.sp_group(LayerLayout.of(s)))
        if s.recompute != Recompute.NONE:
            block = _recompute(block, s.recompute)
        if compile:
            block = torch.compile(block)
        chunk.layers[key] = block
    _tp_embedding_and_head(chunk, first, last, dims)
    if first is not None and first.recompute == Recompute.FULL:
        chunk.tok_embeddings = _recompute(chunk.tok_embeddings, Recompute.FULL)
    if last is not None and last.recompute == Recompute.FULL:
        chunk.norm = _recompute(chunk.norm, Recompute.FULL)

    result = Parallelized(module=chunk, chunk=chunk, loss=ParallelLoss(ctx))
    pieces = result.loss.pieces
    if uses_ddp(plan):
        layout = LayerLayout.of(strategies[0])
        if layout.dp * layout.sp > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            group = dims.layer_mesh(LayerLayout(layout.dp, layout.sp, 1, 1)).get_group(Axis.DP_REPLICATE)
            with warnings.catch_warnings():  # the rename of broadcast_buffers is newer than torch 2.11
                warnings.simplefilter("ignore", FutureWarning)
                # Buffers (RoPE tables) are computed identically on every rank: no per-step broadcast.
                # Gradients as views into DDP's buckets: no copy beside them once reduced (cost/layer.py).
                result.module = DDP(chunk, process_group=group, broadcast_buffers=False,
                                    gradient_as_bucket_view=True)
            if strategies[0].zero == 1:
                result.zero1 = True
                result.ddp_group = dims.layer_mesh(layout).get_group(Axis.DP_SHARD)
        return result

    # 2. FSDP2 per unit, then the root (which keeps tied weights).
    from torch.distributed.fsdp import fully_shard

    tied = model.config.tie_embeddings
    if root_only:
        _fsdp_root_only(chunk, [strategies[i] for i in layers], dims, mp_policy, result)
        return result
    # The root (the chunk) holds the embedding and, when it shards the same way (always with tied
    # weights), the head: as in a hand-written FSDP2 model; other layers are units of their own.
    root = first if first is not None else (last if last is not None else strategies[layers.start])
    units = [(block, strategies[int(key) + 1]) for key, block in chunk.layers.items()]
    if first is not None:
        _note_rescale(result, [p for m in (chunk.tok_embeddings, chunk.pos_embeddings) if m is not None
                               for p in m.parameters()], first, pieces)
    if last is not None:
        if tied or _shards_alike(last, root):
            _note_rescale(result, [*chunk.norm.parameters(), *chunk.output.parameters()], last, pieces)
        else:
            units += [(chunk.norm, last), (chunk.output, last)]
    unsharded: set[nn.Parameter] = set()  # parameters of layers that live on one rank (dp * sp = 1)
    for module, s in units:
        kw = _fsdp_kwargs(s, dims, mp_policy)
        if kw is not None:
            fully_shard(module, **kw)
        else:
            unsharded.update(module.parameters())
        _note_rescale(result, module.parameters(), s, pieces)
    kw = _fsdp_kwargs(root, dims, mp_policy)
    if kw is not None:
        fully_shard(chunk, **kw, **({"ignored_params": unsharded} if unsharded else {}))
    return result


def _shards_alike(a: LayerStrategy, b: LayerStrategy) -> bool:
    return (LayerLayout.of(a), a.zero >= 3, a.offload_optimizer) == (LayerLayout.of(b), b.zero >= 3, b.offload_optimizer)


def _fsdp_root_only(chunk, strategies, dims, mp_policy, result: Parallelized) -> None:
    from torch.distributed.fsdp import fully_shard

    if not all(_shards_alike(s, strategies[0]) for s in strategies):
        raise TesseraError("plan.layers: a zero-bubble pipeline stage shards with one fully_shard, so its "
                           "layers need the same dp/sp/tp/zero/offload")
    kw = _fsdp_kwargs(strategies[0], dims, mp_policy)
    if kw is not None:
        fully_shard(chunk, **kw)
    _note_rescale(result, chunk.parameters(), strategies[0], result.loss.pieces)


def _note_rescale(result: Parallelized, params, s: LayerStrategy, pieces: int) -> None:
    replicas = s.dp * s.sp_degree
    if replicas != pieces:
        result.grad_rescale.append((list(params), replicas / pieces))


def _ulysses(group) -> nn.Module:
    try:
        from .attention import UlyssesAttention
    except ImportError:
        raise TesseraError("sp=ulysses needs tessera.runtime.attention.UlyssesAttention, "
                           "which this build does not have") from None
    return UlyssesAttention(group)
