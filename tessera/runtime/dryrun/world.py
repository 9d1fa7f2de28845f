"""One rank of a world that does not exist: the fake process group, and execution on fake tensors.

`fake_rank(plan, rank)` initialises PyTorch's fake process-group backend as rank `rank` of the
plan's world (its collectives are no-ops that still go through the dispatcher, so they can be
counted) and tears it down afterwards. A pipeline stage asks its neighbours for the shapes it
will receive (dynamic metadata inference, torch >= 2.13); they exist on no process, so inside
`fake_rank` the answer is computed from the plan's activation layout instead.

`fake_execution(plan)` runs the runtime's own code (FSDP2, DTensor, DDP, pipelining, AdamW) on
fake tensors (`FakeTensorMode`: a shape, a dtype and a device, no data) at the plan's real sizes
and in no memory:
- a scalar read (`float(loss)`, the gradient norm, a pipeline vote) gives 1.0 for a floating
  tensor (AdamW's step count divides by 1 - beta^step) and 0 for an integer one;
- MoE layers route uniformly (`models.moe.uniform_routing`: each of E experts gets
  tokens * top_k / E slots, the splits known without data, the cost model's mean routing), and
  any other row selection by value (`nonzero`) keeps numel / E rows;
- device meshes and process groups are built from real rank tensors (outside the mode);
- the checks that read parameter values are lifted: FSDP2's refusal of meta parameters, DDP's
  cross-rank shape check and initial broadcast.
Values are meaningless; what is exact is what the runtime allocates and which collectives it
issues, with which group and bytes.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from ...errors import TesseraError
from ...plan import Plan


@contextlib.contextmanager
def fake_rank(plan: Plan, rank: int) -> Iterator[None]:
    """Be rank `rank` of the plan's world, on the fake process group, inside the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world_size = plan.world_size
    if dist.is_initialized():
        raise TesseraError("a process group is already initialised: the dry run needs its own fake one")
    if not 0 <= rank < world_size:
        raise TesseraError(f"rank {rank} is outside the plan's world of {world_size} ranks")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with _pipeline_metadata(plan, _DTYPES[plan.workload.dtype]):
            yield
    finally:
        dist.destroy_process_group()


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class FakeWorld(FakeTensorMode):
    """Fake tensors (shapes, dtypes and a device, no data) for everything created inside;
    a scalar read gives 1.0 (floating) or 0 (integer), MoE routing is uniform."""

    def __init__(self):
        super().__init__(allow_non_fake_inputs=True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = getattr(func, "_overloadpacket", None)
        name = packet.__name__ if packet is not None else ""
        if name == "_local_scalar_dense":
            return 1.0 if args[0].is_floating_point() else 0
        if name in ("nonzero", "argwhere"):
            with self:
                return _uniform_routing(args[0])
        return super().__torch_dispatch__(func, types, args, kwargs)


def _uniform_routing(mask: torch.Tensor) -> torch.Tensor:
    """`nonzero` of a (tokens, top_k) routing mask for one expert of E: tokens * top_k / E rows.

    The MoE layer asks which (token, slot) pairs chose expert e; with data unknown, the dry run
    assumes the balanced load a trained router aims at."""
    rows = mask.numel() // _routing["experts"]
    return torch.empty((rows, mask.dim()), dtype=torch.long, device=mask.device)


_routing = {"experts": 1}  # the expert count of the model being dry-run


@contextlib.contextmanager
def _real_device_meshes() -> Iterator[None]:
    """Device meshes and process groups are built from real rank tensors (read back as lists):
    their builders run outside the fake mode."""
    from torch.distributed.device_mesh import DeviceMesh

    from .. import pipeline
    from ..mesh import ParallelDims

    patches = [(DeviceMesh, "__init__"), (ParallelDims, "layer_mesh"), (ParallelDims, "sp_group"),
               (ParallelDims, "rank_mesh"), (ParallelDims, "mesh"), (ParallelDims, "stage_group"),
               (pipeline, "_tied_sync_group"), (pipeline, "_tied_exchange_group")]
    saved = [(owner, name, owner.__dict__[name]) for owner, name in patches]
    for owner, name, original in saved:
        setattr(owner, name, _outside_modes(original))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _outside_modes(original):
    from torch.utils._python_dispatch import _disable_current_modes

    if isinstance(original, property):
        return property(_outside_modes(original.fget))

    def call(*args, **kwargs):
        with _disable_current_modes():
            return original(*args, **kwargs)

    return call


@contextlib.contextmanager
def _no_data_checks() -> Iterator[None]:
    """Lift the checks that read parameter values: FSDP2's refusal of meta parameters, and DDP's
    cross-rank shape check and initial broadcast (there are no other ranks to agree with)."""
    import torch.nn.parallel.distributed as ddp
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    saved = [(FSDPParamGroup, "_validate_no_meta_params"), (ddp, "_verify_param_shape_across_processes"),
             (ddp, "_sync_module_states")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in saved]
    for owner, name, _ in saved:
        setattr(owner, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def allreduce_hook(group, bucket):
    """DDP's default gradient hook (all-reduce the bucket, divide by the group size) with a
    future that holds its result: the fake backend's own futures hold none, which DDP refuses."""
    buffer = bucket.buffer()
    dist.all_reduce(buffer, group=group)
    buffer.div_(dist.get_world_size(group))
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


def activation_meta(plan: Plan, layer: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor (fake inside `fake_execution`) shaped like the activation one rank holds after plan layer `layer`, per
    micro-batch (what a pipeline chunk ending at that layer sends to the next)."""
    from ..layout import ActLayout

    cfg = plan.model.config
    act = ActLayout.of(plan.layers[layer])
    rows = plan.workload.global_batch // plan.num_micro_batches
    batch, seq = act.local_shape(rows, plan.workload.seq_len)
    return torch.empty((batch, seq, cfg.hidden), dtype=dtype)


@contextlib.contextmanager
def _pipeline_metadata(plan: Plan, dtype: torch.dtype) -> Iterator[None]:
    """Answer a stage's metadata requests from the plan (its neighbours exist on no process)."""
    if plan.pipeline.degree == 1:
        yield
        return
    try:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining._utils import (_StageBackwardMeta, _StageForwardMeta,
                                                         _derive_grad_metas, extract_tensor_metas)
    except ImportError:
        raise TesseraError("a dry run of a pipeline needs torch >= 2.13 (its stage metadata protocol)") from None
    if not hasattr(PipelineStage, "_recv_meta"):
        raise TesseraError("a dry run of a pipeline needs torch >= 2.13 (its stage metadata protocol)")

    def recv_meta(stage, src_stage: int):
        if src_stage == stage.stage_index - 1:  # forward: the previous chunk's output
            end = plan.pipeline.stages[src_stage][1]
            act = activation_meta(plan, end - 1, dtype).requires_grad_(True)
            return _StageForwardMeta(forward_metas=extract_tensor_metas((act,)))
        # backward: gradients of this chunk's outputs, shaped as they are
        return _StageBackwardMeta(backward_metas=_derive_grad_metas(stage._stage_meta.outputs))

    saved = PipelineStage._recv_meta
    PipelineStage._recv_meta = recv_meta
    try:
        yield
    finally:
        PipelineStage._recv_meta = saved


@contextlib.contextmanager
def fake_execution(plan: Plan) -> Iterator[FakeWorld]:
    """Run the runtime on fake tensors (see the module docstring) inside the block."""
    cfg = plan.model.config
    _routing["experts"] = max(cfg.num_experts, 1) if cfg is not None else 1
    from ...models.moe import uniform_routing

    with _no_data_checks(), _real_device_meshes(), uniform_routing(), FakeWorld() as mode:
        yield mode
