"""AdamW, the learning-rate schedule (warmup, then cosine or linear decay), and gradient clipping across meshes.

A parallelised model mixes plain tensors and DTensors on several meshes (one per layer layout),
so the optimizer keeps two parameter groups (decay or not: a checkpoint's groups then match any
other plan's), and the global gradient norm adds the squared norms of the gradients of each
(mesh, placements), summed over the mesh axes they are sharded on.

AdamW's implementation (`implementation`): fused (one kernel per device and dtype) where every
parameter is on CUDA and the parameters are all plain tensors or all DTensors on one mesh (the
fused kernel cannot take a list mixing the two; DTensors on several meshes are left to foreach,
which older torch releases support for them); foreach (a few kernels per parameter list) where
the list does not mix plain tensors and DTensors; else one parameter at a time. Clipping never
waits for the device: the norm stays a device tensor and the factor min(1, max / norm) multiplies
every gradient (by 1.0 when the norm is under the bound, which leaves it unchanged).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 10
    total_steps: int = 1000
    min_lr_ratio: float = 0.1
    decay: str = "cosine"  # after warmup, to min_lr_ratio x lr at total_steps: "cosine", "linear", "constant"
    grad_clip: float = 1.0  # 0 disables clipping
    fused: bool | None = None  # None: fused where `implementation` allows it (CUDA); False: never


def _mesh_key(p: torch.Tensor):
    mesh = getattr(p, "device_mesh", None)
    return None if mesh is None else id(mesh)


def param_groups(params, weight_decay: float) -> list[dict]:
    """Two groups whatever the plan (checkpoints then load under any other plan): matrices decay,
    vectors (norms, biases) do not."""
    decay = [p for p in params if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in params if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _foreach_ok(params) -> bool:
    """foreach kernels take all-DTensor or all-plain lists, not a mix (layer-wise plans mix)."""
    return len({hasattr(p, "device_mesh") for p in params}) <= 1


def implementation(params, fused: bool | None = None) -> dict:
    """AdamW's `fused` / `foreach` arguments for `params` (see the module docstring).

    `fused=None` chooses; `False` never fuses; `True` fuses wherever the kernel can take the list
    (also on CPU, whose fused kernel exists as well)."""
    params = list(params)
    meshes = {getattr(p, "device_mesh", None) for p in params}  # equal meshes may be distinct objects
    on_cuda = bool(params) and all(p.device.type == "cuda" for p in params)
    can_fuse = (bool(params) and len(meshes) == 1 and all(torch.is_floating_point(p) for p in params)
                and all(p.device.type in ("cuda", "cpu") for p in params))
    if can_fuse and (fused or (fused is None and on_cuda)):
        return {"fused": True, "foreach": False}
    return {"fused": False, "foreach": _foreach_ok(params)}


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over the (possibly sharded) parameters: ZeRO shards its state with the parameters;
    fused where `implementation` chooses it."""
    params = list(params)
    kwargs = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    return torch.optim.AdamW(param_groups(params, cfg.weight_decay), **kwargs, **implementation(params, cfg.fused))


DECAYS = ("cosine", "linear", "constant")


def lr_lambda(cfg: OptimConfig):
    """The learning rate's factor at a step: linear warmup over `warmup_steps` ((step + 1) / warmup),
    then, with p the share of the remaining steps done, decay to r = `min_lr_ratio` at
    `total_steps`: cosine r + (1 - r)(1 + cos(pi p)) / 2, linear 1 - (1 - r) p, or constant 1."""
    if cfg.decay not in DECAYS:
        raise ValueError(f"learning-rate decay must be one of {', '.join(DECAYS)}, got '{cfg.decay}'")

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        span = max(1, cfg.total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        if cfg.decay == "constant":
            return 1.0
        if cfg.decay == "linear":
            return 1.0 - (1 - cfg.min_lr_ratio) * progress
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def grad_norm(params, pp_group=None) -> torch.Tensor:
    """Global L2 norm of the gradients: sqrt(sum over groups of the group's squared norm).

    Gradients are grouped by the process groups they are sharded over (the ranks of every mesh
    axis with a Shard placement, in mesh order; replicated axes hold copies and are not summed;
    expert parameters, on the meshes runtime/expert_parallel.py shards them over, also over the
    expert-parallel group, whose ranks hold the other experts): each group's squared norm is the
    sum of its local shards, all-reduced once over each of those process groups. Grouping by ranks
    rather than by mesh object lets the layers of a layer-wise plan that shard over the same ranks
    share one all-reduce. `pp_group` adds the other pipeline stages.
    """
    groups: dict = {}  # sharding ranks -> (process groups, gradients); insertion (parameter) order
    for p in params:
        if p.grad is None:
            continue
        axes = _sharded_groups(p.grad)
        key = tuple(ranks for ranks, _ in axes)
        groups.setdefault(key, ([g for _, g in axes], []))[1].append(p.grad)
    total = None
    for process_groups, grads in groups.values():
        local = [_local(g) for g in grads]
        sq = torch.stack([n.float() for n in torch._foreach_norm(local)]).pow(2).sum()
        for group in process_groups:
            dist.all_reduce(sq, group=group)
        total = sq if total is None else total + sq.to(total.device)
    if total is None:
        total = torch.zeros(())
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def _expert_group(mesh):
    """The ranks holding the other experts, for a mesh that expert parameters live on (None else)."""
    from .expert_parallel import ep_group_of

    return ep_group_of(mesh)


def _is_shard(placement) -> bool:
    """Shard, or FSDP2's _StridedShard of a TP-sharded dimension (in torch 2.13 not a Shard, and
    its is_shard() is False: both shard the tensor)."""
    from torch.distributed.tensor import Shard

    return isinstance(placement, Shard) or type(placement).__name__ == "_StridedShard"


def _sharded_groups(grad: torch.Tensor) -> list[tuple[tuple[int, ...], object]]:
    """(ranks, process group) of each mesh axis of size > 1 that a DTensor gradient is sharded on,
    then its expert-parallel group if it is an expert parameter."""
    mesh = getattr(grad, "device_mesh", None)
    if mesh is None:
        return []
    out = []
    for axis, placement in enumerate(grad.placements):
        if _is_shard(placement) and mesh.size(axis) > 1:
            group = mesh.get_group(axis)
            out.append((tuple(dist.get_process_group_ranks(group)), group))
    ep = _expert_group(mesh)
    if ep is not None:
        out.append((tuple(dist.get_process_group_ranks(ep)), ep))
    return out


def clip_grad_norm_(params, max_norm: float, pp_group=None, skip_in_norm: set[int] = frozenset()) -> torch.Tensor:
    """Scale gradients so their global norm is at most `max_norm`; return the norm before, as a
    0-dim tensor on the gradients' device (`float()` of it waits for the backward; the step need not).

    The factor min(1, max_norm / (norm + 1e-6)) multiplies every gradient's local shard, so no
    value comes back to the host. `skip_in_norm`: ids of parameters that are copies of another
    stage's (a pipeline's tied head), scaled like the rest but counted once in the norm."""
    params = [p for p in params if p.grad is not None]
    norm = grad_norm([p for p in params if id(p) not in skip_in_norm], pp_group)
    if max_norm > 0 and params:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        by_device: dict = {}  # foreach kernels take one device and dtype per list
        for p in params:
            g = _local(p.grad)
            by_device.setdefault((g.device, g.dtype), []).append(g)
        for (device, dtype), grads in by_device.items():
            torch._foreach_mul_(grads, scale.to(device=device, dtype=dtype))
    return norm


def reference_clip(model: nn.Module, max_norm: float) -> float:
    """Single-process clipping with the same formula (for equivalence tests)."""
    return float(clip_grad_norm_(list(model.parameters()), max_norm))
