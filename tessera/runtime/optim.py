"""AdamW, the warmup-cosine learning-rate schedule, and gradient clipping across meshes.

A parallelised model mixes plain tensors and DTensors on several meshes (one per layer layout),
so the optimizer keeps two parameter groups (decay or not: a checkpoint's groups then match any
other plan's), and the global gradient norm adds the squared norms of the gradients of each
(mesh, placements), summed over the mesh axes they are sharded on.
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
    grad_clip: float = 1.0  # 0 disables clipping


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


def build_optimizer(params, cfg: OptimConfig, zero1_group=None) -> torch.optim.Optimizer:
    """AdamW; with `zero1_group`, ZeRO-1 (`ZeroRedundancyOptimizer`) shards its state over the group."""
    params = list(params)
    kwargs = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    if zero1_group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        groups = param_groups(params, cfg.weight_decay)
        opt = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW,
                                      process_group=zero1_group, weight_decay=groups[0]["weight_decay"], **kwargs)
        for g in groups[1:]:
            opt.add_param_group(g)
        return opt
    return torch.optim.AdamW(param_groups(params, cfg.weight_decay), foreach=_foreach_ok(params), **kwargs)


def lr_lambda(cfg: OptimConfig):
    """Linear warmup over `warmup_steps`, then cosine decay to `min_lr_ratio` at `total_steps`."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        span = max(1, cfg.total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def grad_norm(params, pp_group=None) -> torch.Tensor:
    """Global L2 norm of the gradients: sqrt(sum over groups of the group's squared norm).

    Gradients are grouped by the process groups they are sharded over (the ranks of every mesh
    axis with a Shard placement, in mesh order; replicated axes hold copies and are not summed):
    each group's squared norm is the sum of its local shards, all-reduced once over each of
    those process groups. Grouping by ranks rather than by mesh object lets the layers of a
    layer-wise plan that shard over the same ranks share one all-reduce. `pp_group` adds the
    other pipeline stages.
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


def _is_shard(placement) -> bool:
    """Shard, or FSDP2's _StridedShard of a TP-sharded dimension (in torch 2.13 not a Shard, and
    its is_shard() is False: both shard the tensor)."""
    from torch.distributed.tensor import Shard

    return isinstance(placement, Shard) or type(placement).__name__ == "_StridedShard"


def _sharded_groups(grad: torch.Tensor) -> list[tuple[tuple[int, ...], object]]:
    """(ranks, process group) of each mesh axis of size > 1 that a DTensor gradient is sharded on."""
    mesh = getattr(grad, "device_mesh", None)
    if mesh is None:
        return []
    out = []
    for axis, placement in enumerate(grad.placements):
        if _is_shard(placement) and mesh.size(axis) > 1:
            group = mesh.get_group(axis)
            out.append((tuple(dist.get_process_group_ranks(group)), group))
    return out


def clip_grad_norm_(params, max_norm: float, pp_group=None, skip_in_norm: set[int] = frozenset()) -> float:
    """Scale gradients so their global norm is at most `max_norm`; return the norm before.

    `skip_in_norm`: ids of parameters that are copies of another stage's (a pipeline's tied head),
    scaled like the rest but counted once in the norm."""
    params = [p for p in params if p.grad is not None]
    norm = float(grad_norm([p for p in params if id(p) not in skip_in_norm], pp_group))
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        by_mesh: dict = {}
        for p in params:
            by_mesh.setdefault((_mesh_key(p.grad), p.grad.device), []).append(p.grad)
        for grads in by_mesh.values():
            torch._foreach_mul_(grads, scale)
    return norm


def reference_clip(model: nn.Module, max_norm: float) -> float:
    """Single-process clipping with the same formula (for equivalence tests)."""
    return clip_grad_norm_(list(model.parameters()), max_norm)
