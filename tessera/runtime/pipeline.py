"""Pipeline parallelism: cut the model at the plan's stage boundaries and run a
`torch.distributed.pipelining` schedule over the "pp" mesh axis.

Layer indices are those of the plan's `ModelSpec`: 0 is the embedding, 1..N are the decoder
blocks `layers.<i-1>`, N+1 is the LM head (final norm + output projection). Chunk `c` owns the
layer range `plan.pipeline.stages[c]` and runs on pipeline rank `c % pp` (interleaved schedules
place several chunks on a rank). A chunk is a `Transformer` whose modules outside its range are
`None` (blocks outside the range are absent from `layers`), so parameter names stay those of the
full model and a pipeline checkpoint loads into any other plan.

Loss and gradients. Each micro-batch's loss is the mean over its tokens; the schedule divides
gradients by the number of micro-batches m (`scale_grads=True`), so the gradient is that of
    L = (1/m) * sum_j loss_j,
which is the full batch's mean loss when micro-batches hold equally many tokens. `step` returns L
on the ranks that hold the last stage. Packed documents: every rank holds the batch, so the
positions and the document ids (B, S) reach every chunk as keyword arguments of the schedule
(split into micro-batches like the tokens) instead of travelling between stages.

Tied embeddings (GPT-2): when the embedding and the LM head land in different chunks, the head
gets its own copy of the weight (same initial value) and, after each backward, the two copies'
gradients are summed with an all-reduce between the first- and last-stage ranks of each
pipeline column. Since d(loss)/dW_tied = g_embedding + g_head, both copies then receive the
tied gradient and the same optimizer update, so they stay equal. Copies sharded alike sum their
local shards; copies sharded differently (the embedding and head layers' strategies differ)
exchange shards instead: each rank adds the other copy's rows of its own shard, received in one
all-to-all over both stages' ranks (`runtime/tied_sync.py`; the search gives the pair one layout).

Gradient synchronisation. `torch.distributed.pipelining`'s stage keeps FSDP2 from reducing or
resharding during every micro-batch's backward and reduces once at the end of the step.
`PlannedStage` instead follows the plan per FSDP2 unit (`grad_sync`: ZeRO-2/3 reduce-scatter every
micro-batch, ZeRO-3 re-gathers, ZeRO-0/1 reduce once). A zero-bubble schedule splits the backward
into an input-gradient pass, after which the weight pass still needs the gathered parameters
(units hold them, no reduction), and a weight-gradient pass that FSDP2's hooks do not see (it
runs `autograd.grad` from saved intermediates), after which `PlannedStage` reduces by hand.
Multi-chunk schedules also reshard and re-gather whole chunks to keep at most 3 gathered at once;
a chunk holding ZeRO-0/1/2 units instead stays gathered from its first use to the end of the step
(`_gather_once_per_step`), so its parameters are all-gathered once per step, as priced.
"""
from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..errors import TesseraError
from ..models.transformer import Transformer
from ..plan import Plan, Schedule
from .grad_sync import settle_gradients
from .mesh import LayerLayout

logger = logging.getLogger(__name__)

EMBEDDING_WEIGHT = "tok_embeddings.weight"
HEAD_WEIGHT = "output.weight"


def chunks_of_rank(plan: Plan, pp_rank: int) -> list[int]:
    """Indices of the model chunks pipeline rank `pp_rank` runs, in model order."""
    pp = plan.pipeline.degree
    if not 0 <= pp_rank < pp:
        raise TesseraError(f"pipeline rank {pp_rank} is outside the plan's pipeline degree {pp}")
    return [c for c in range(len(plan.pipeline.stages)) if plan.pipeline.rank_of_chunk(c) == pp_rank]


def _check_model_matches(model: Transformer, plan: Plan) -> None:
    n_blocks = len(model.layers)
    if len(plan.model.layers) != n_blocks + 2:
        raise TesseraError(
            f"plan describes {len(plan.model.layers)} layers (embedding + blocks + head) but the "
            f"model has {n_blocks} blocks, i.e. {n_blocks + 2} layers")


def _is_tied(model: Transformer) -> bool:
    return (model.config.tie_embeddings and model.output is not None and model.tok_embeddings is not None
            and model.output.weight is model.tok_embeddings.weight)


def _make_chunk(model: Transformer, start: int, end: int) -> Transformer:
    """A Transformer owning plan layers [start, end) of `model`, sharing its modules (no copy)."""
    n_blocks = len(model.layers)
    head = n_blocks + 1
    chunk = Transformer.__new__(Transformer)
    nn.Module.__init__(chunk)
    chunk.config = model.config
    owns_embedding, owns_head = start == 0, end > head
    chunk.tok_embeddings = model.tok_embeddings if owns_embedding else None
    if hasattr(model, "pos_embeddings"):
        chunk.pos_embeddings = model.pos_embeddings if owns_embedding else None
    if "freqs" in model._buffers:
        chunk.register_buffer("freqs", model.freqs, persistent=False)
    # Blocks are plan layers 1..N, i.e. module keys 0..N-1.
    first_block, last_block = max(start, 1) - 1, min(end, head) - 1
    chunk.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in range(first_block, last_block)})
    chunk.norm = model.norm if owns_head else None
    chunk.output = model.output if owns_head else None
    if owns_head and _is_tied(model) and not owns_embedding:
        # Untie: the head keeps its own copy, kept equal by summing gradients (module docstring).
        weight = model.tok_embeddings.weight
        chunk.output = nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                                 device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            chunk.output.weight = nn.Parameter(weight.detach().clone())
    return chunk


def split_model(model: Transformer, plan: Plan, pp_rank: int) -> list[nn.Module]:
    """The model chunks that pipeline rank `pp_rank` owns, in model order.

    Chunks share modules with `model` (each block belongs to exactly one chunk), so build the
    full model once per rank (on the meta device if weights come from a checkpoint)."""
    _check_model_matches(model, plan)
    return [_make_chunk(model, *plan.pipeline.stages[c]) for c in chunks_of_rank(plan, pp_rank)]


def _pp_mesh_and_rank(mesh, plan: Plan):
    names = mesh.mesh_dim_names or ()
    if "pp" not in names:
        raise TesseraError(f"the device mesh has no 'pp' axis (axes: {', '.join(names) or 'none'})")
    pp_mesh = mesh["pp"]
    if pp_mesh.size() != plan.pipeline.degree:
        raise TesseraError(f"the mesh's pp axis has {pp_mesh.size()} ranks, the plan's pipeline degree is "
                           f"{plan.pipeline.degree}")
    return pp_mesh, pp_mesh.get_local_rank()


def _device_of(mesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _tied_sync_group(mesh, plan: Plan):
    """The process group {first-stage rank, last-stage rank} of this rank's pipeline column.

    One `DeviceMesh` of shape (columns, 2) creates the pairs (torch creates the groups of a mesh
    dimension together, with a communicator split where the backend has one); with pp = 2 the
    pair is the column's pipeline group itself."""
    from torch.distributed.device_mesh import DeviceMesh

    if plan.pipeline.degree == 2:
        return mesh["pp"].get_group()
    names = list(mesh.mesh_dim_names)
    ranks = mesh.mesh.movedim(names.index("pp"), 0).reshape(plan.pipeline.degree, -1)
    first = plan.pipeline.rank_of_chunk(0)
    last = plan.pipeline.rank_of_chunk(len(plan.pipeline.stages) - 1)
    pairs = torch.stack([ranks[first], ranks[last]], dim=1)  # (columns, 2)
    pair_mesh = DeviceMesh(mesh.device_type, pairs, mesh_dim_names=("column", "tied"))
    return pair_mesh.get_group("tied") if pair_mesh.get_coordinate() is not None else None


def _tied_exchange_group(ranks: list[int]):
    """The process group of the first and last stages' ranks (every rank creates it; None: the world)."""
    if len(ranks) == dist.get_world_size():
        return None
    return dist.new_group(ranks)


def _planned_stage_class():
    """`PipelineStage` whose FSDP2 units reduce and reshard per micro-batch as the plan says."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._backward import (stage_backward, stage_backward_input,
                                                         stage_backward_weight)

    class PlannedStage(PipelineStage):
        def __init__(self, *args, sync=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.sync = sync
            self.fsdp_modules = [m for m in self.submod.modules() if isinstance(m, FSDPModule)]

        def _backward(self, backward_type, bwd_kwargs):
            if backward_type == "full":
                return stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                      bwd_kwargs["input_values"]), None
            if backward_type == "input":
                return stage_backward_input(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                            bwd_kwargs["input_values"], self.submod.parameters())
            return stage_backward_weight(self.submod.parameters(), bwd_kwargs["param_groups"]), None

        def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
            if not self.sync:  # no plan for the units: pipelining's own handling (DDP, plain, FSDP2)
                if backward_type != "full":  # but a split pass must see the gathered parameters
                    for module in self.fsdp_modules:
                        module.unshard()
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
            if backward_type == "full":  # FSDP2's hooks reduce as the flags say, overlapped with backward
                self.sync.before_backward(last_backward)
                return self._backward("full", bwd_kwargs)
            # The split passes find the weights by the stage's registered parameters: those must be
            # the gathered ones of the forward graph (ZeRO-3 units resharded after forward).
            self.sync.unshard()
            if backward_type == "input":  # the weight pass still needs the gathered parameters
                self.sync.hold()
                return self._backward("input", bwd_kwargs)
            result = self._backward("weight", bwd_kwargs)
            self.sync.reduce_now(last_backward)
            return result

        def perform_reduce_grad(self, grad_scale_factor: int):
            if not self.sync:
                return super().perform_reduce_grad(grad_scale_factor)
            self.sync.finish()
            if grad_scale_factor != 1:
                self.scale_grads(grad_scale_factor)

    return PlannedStage


_SCHEDULES = {
    Schedule.GPIPE: "ScheduleGPipe",
    Schedule.ONE_F_ONE_B: "Schedule1F1B",
    Schedule.INTERLEAVED_1F1B: "ScheduleInterleaved1F1B",
    Schedule.ZERO_BUBBLE: "ScheduleInterleavedZeroBubble",
}


def _make_schedule(plan: Plan, stages: list, loss_fn: Callable):
    from torch.distributed import pipelining

    cls = getattr(pipelining, _SCHEDULES[plan.pipeline.schedule])
    multi = cls.__name__ in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble")
    if not multi and len(stages) != 1:
        raise TesseraError(f"schedule {plan.pipeline.schedule.value} runs one chunk per rank, "
                           f"this rank has {len(stages)}")
    schedule = cls(stages if multi else stages[0], n_microbatches=plan.num_micro_batches,
                   loss_fn=loss_fn, scale_grads=True)
    _gather_once_per_step(schedule, stages)
    return schedule


def _gather_once_per_step(schedule, stages: list) -> None:
    """Keep the chunks that hold ZeRO-1/2 units gathered from their first use to the step's end.

    The multi-chunk schedules (interleaved, zero-bubble) interleave UNSHARD and RESHARD actions
    with the compute: a chunk is all-gathered ahead of its next computation and resharded when it
    falls out of the next three chunks to compute (a prefetch window of 3). With 4 or more chunks
    per rank a chunk leaves and re-enters that window many times a step, and each re-entry
    all-gathers it again. The plan keeps ZeRO-1/2 parameters gathered over the step's micro-batches
    (one all-gather per step, `grad_sync`), so for a chunk with such a unit only its first UNSHARD
    (the prefetch before its first computation) and its last RESHARD (end of step; the units
    themselves reshard after the step's last backward) stay. Chunks of ZeRO-3 units only keep
    torch's prefetching: they re-gather in every forward and backward anyway. Single-chunk
    schedules (GPipe, 1F1B) have no such actions: FSDP2's hooks gather as `grad_sync` says."""
    order = getattr(schedule, "pipeline_order_with_comms", None)
    rank = getattr(schedule, "rank", None)
    if not order or rank not in order:
        return
    held = {s.stage_index for s in stages
            if getattr(s, "sync", None) and any(u.zero <= 2 for u in s.sync.units)}
    kinds = ("UNSHARD", "RESHARD")  # `_ComputationType` is a str enum
    first_unshard: dict[int, int] = {}
    last_reshard: dict[int, int] = {}
    actions = order[rank]
    for i, a in enumerate(actions):
        if a is None or a.stage_index not in held:
            continue
        if a.computation_type == "UNSHARD":
            first_unshard.setdefault(a.stage_index, i)
        elif a.computation_type == "RESHARD":
            last_reshard[a.stage_index] = i
    keep = set(first_unshard.values()) | set(last_reshard.values())
    order[rank] = [a for i, a in enumerate(actions)
                   if a is None or a.computation_type not in kinds or a.stage_index not in held or i in keep]


def _plain(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


@dataclass
class PipelineRunner:
    """This rank's share of a pipeline: its chunks (`model_parts`) and the schedule that runs them."""

    model_parts: list[nn.Module]
    chunk_ids: list[int]
    num_chunks: int
    pp_degree: int
    num_micro_batches: int
    schedule: object
    device: torch.device = torch.device("cpu")
    tied_params: list[nn.Parameter] = field(default_factory=list)
    tied_group: object = None
    tied_same_layout: bool = True  # both copies sharded alike: sum the local shards directly
    tied_exchange: tuple | None = None  # otherwise: (copies, vocab, rank, group ranks, group), cost/tied.py
    _tied_is_copy: list[bool] = field(default_factory=list)

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.chunk_ids

    @property
    def has_last_stage(self) -> bool:
        return self.num_chunks - 1 in self.chunk_ids

    @property
    def tied_copies(self) -> list[nn.Parameter]:
        """Parameters that duplicate another stage's (the untied LM head copy of a tied embedding).

        Leave them out of a global gradient norm: they would count the tied gradient twice."""
        return [p for p, is_copy in zip(self.tied_params, self._tied_is_copy) if is_copy]

    def step(self, tokens: torch.Tensor | None, labels: torch.Tensor | None,
             positions: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
             sync_tied: bool = True) -> torch.Tensor | None:
        """Forward and backward of one batch, split into the plan's micro-batches.

        Every rank of the pipeline calls this; `tokens` are used on the first stage, `labels` on
        the last (pass None elsewhere). Packed documents: `positions` and `doc_ids` (B, S)
        go to every stage's chunks (as keyword arguments, split into
        micro-batches like the tokens), so every rank must pass them. Returns the mean
        micro-batch loss (detached) on ranks with the last stage, None on the others. Gradients
        are left in `.grad` for the optimizer."""
        m = self.num_micro_batches
        extra = {k: v for k, v in (("positions", positions), ("doc_ids", doc_ids)) if v is not None}
        for name, t in (("tokens", tokens), ("labels", labels), *extra.items()):
            if t is not None and t.shape[0] % m:
                raise TesseraError(f"{name} batch of {t.shape[0]} sequences does not split into {m} micro-batches")
        losses: list[torch.Tensor] | None = [] if self.has_last_stage else None
        args = (tokens,) if self.has_first_stage else ()
        target = labels if self.has_last_stage else None
        if _accepts_return_outputs(self.schedule):
            extra["return_outputs"] = False  # the logits are not needed, only the losses
        self.schedule.step(*args, target=target, losses=losses, **extra)
        settle_gradients([p for part in self.model_parts for p in part.parameters()])
        if sync_tied:
            self.sync_tied_gradients()
        if losses is None:
            return None
        return torch.stack([_plain(l).detach().float() for l in losses]).mean()

    def evaluate(self, tokens: torch.Tensor | None, labels: torch.Tensor | None,
                 positions: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Forward only, over the plan's micro-batches (evaluation): the mean micro-batch loss on
        ranks with the last stage, None on the others. Arguments as in `step`."""
        extra = {k: v for k, v in (("positions", positions), ("doc_ids", doc_ids)) if v is not None}
        losses: list[torch.Tensor] | None = [] if self.has_last_stage else None
        args = (tokens,) if self.has_first_stage else ()
        if _accepts_return_outputs(self.schedule):
            extra["return_outputs"] = False
        schedule = self.schedule
        has_backward = schedule._has_backward  # what `eval` of newer torch releases does
        try:
            schedule._has_backward = False
            schedule.step(*args, target=labels if self.has_last_stage else None, losses=losses, **extra)
        finally:
            schedule._has_backward = has_backward
        if losses is None:
            return None
        return torch.stack([_plain(l).detach().double() for l in losses]).mean()

    def global_loss(self, loss: torch.Tensor | None) -> float:
        """The step's loss on every rank: mean over the last stage's ranks (all ranks call this).

        The last stage's ranks hold equal shares of the global batch (dp) or equal copies (tp),
        so their mean is the global batch's mean loss."""
        stage_ranks = dist.get_world_size() // self.pp_degree
        value = torch.zeros(1, dtype=torch.float64, device=self.device)
        if loss is not None:
            value += float(loss) / stage_ranks
        dist.all_reduce(value)
        return float(value)

    @torch.no_grad()
    def sync_tied_gradients(self) -> None:
        """Give both copies of a tied embedding/head the summed gradient (once per step, after
        any per-copy rescaling; `step` does it unless told `sync_tied=False`)."""
        if not self.tied_params:
            return
        if not self.tied_same_layout:
            from .tied_sync import exchange_tied_gradients

            copies, vocab, rank, ranks, group = self.tied_exchange
            copy = 0 if rank in copies[0].ranks else 1
            exchange_tied_gradients({copy: self.tied_params[0].grad}, copies, vocab, rank, ranks, group,
                                    device=self.device)
            return
        grads = [p.grad for p in self.tied_params]
        if any(g is None for g in grads):
            raise RuntimeError("a tied embedding/head weight has no gradient after backward")
        locals_ = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        total = locals_[0].clone()
        for g in locals_[1:]:
            total += g
        if self.tied_group is not None:
            dist.all_reduce(total, group=self.tied_group)
        for g in locals_:
            g.copy_(total)


def _find_param(module: nn.Module, fqn: str) -> nn.Parameter | None:
    """The parameter named `fqn` in the full model, looking through recompute/compile wrappers."""
    for name, p in module.named_parameters():
        if name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "") == fqn:
            return p
    return None


def _accepts_return_outputs(schedule) -> bool:
    return "return_outputs" in inspect.signature(schedule.step).parameters


def build_pipeline(model: Transformer, plan: Plan, mesh, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   parallelize_chunk: Callable[[nn.Module, range], nn.Module] | None = None) -> PipelineRunner:
    """Split `model` by the plan, parallelise each local chunk, and build the plan's schedule.

    `mesh` is the full device mesh with a "pp" axis; `parallelize_chunk(chunk, layer_ids)`
    applies the plan's TP/FSDP to a chunk (`layer_ids` = its plan layer range) and returns it, or
    the `Parallelized` result whose FSDP2 units then reduce per micro-batch as the plan says.
    `loss_fn(logits, labels)` returns the micro-batch mean loss."""
    if plan.pipeline.degree < 2:
        raise TesseraError("build_pipeline needs a plan with pipeline degree >= 2")
    pp_mesh, pp_rank = _pp_mesh_and_rank(mesh, plan)
    # Before parallelising: FSDP replaces the chunks' parameters, which unties `model`'s copies.
    tied = _is_tied(model)
    chunk_ids = chunks_of_rank(plan, pp_rank)
    parts = split_model(model, plan, pp_rank)
    device = _device_of(mesh)
    num_chunks = len(plan.pipeline.stages)
    stages = []
    stage_class = _planned_stage_class()
    for c, chunk in zip(chunk_ids, parts):
        sync = None
        if parallelize_chunk is not None:
            chunk = parallelize_chunk(chunk, range(*plan.pipeline.stages[c]))
            if not isinstance(chunk, nn.Module):  # a `Parallelized`: its units follow the plan
                chunk, sync = chunk.chunk, chunk.sync
        stages.append(stage_class(chunk, stage_index=c, num_stages=num_chunks, device=device,
                                  group=pp_mesh.get_group(), sync=sync))
    parts = [s.submod for s in stages]
    runner = PipelineRunner(model_parts=parts, chunk_ids=chunk_ids, num_chunks=num_chunks,
                            pp_degree=plan.pipeline.degree, num_micro_batches=plan.num_micro_batches,
                            schedule=_make_schedule(plan, stages, loss_fn), device=device)
    if tied:
        # First and last chunk are on different ranks (pp >= 2, chunk c on rank c % pp).
        runner.tied_same_layout = LayerLayout.of(plan.layers[0]) == LayerLayout.of(plan.layers[-1])
        if runner.tied_same_layout:
            runner.tied_group = _tied_sync_group(mesh, plan)
        else:  # shard to shard over the ranks of both copies (cost/tied.py)
            from ..cost.tied import group_ranks, tied_copies

            copies = tied_copies(plan)
            ranks = group_ranks(copies)
            runner.tied_exchange = (copies, plan.model.config.vocab_size, dist.get_rank(), ranks,
                                    _tied_exchange_group(ranks))
        for part in parts:
            for name, is_copy in ((EMBEDDING_WEIGHT, False), (HEAD_WEIGHT, True)):
                param = _find_param(part, name)
                if param is not None:
                    runner.tied_params.append(param)
                    runner._tied_is_copy.append(is_copy)
                    break  # a chunk with the embedding holds the tied weight itself
    logger.info("pipeline rank %d runs chunks %s with %s over %d micro-batches", pp_rank, chunk_ids,
                type(runner.schedule).__name__, plan.num_micro_batches)
    return runner
