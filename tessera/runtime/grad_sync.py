"""Gradient synchronisation over micro-batches as the cost model prices it, per FSDP2 unit.

For a unit with ZeRO stage z and m micro-batches per step (the contract the cost model prices):

    z   per micro-batch i < m-1                     last micro-batch i = m-1
    0   no reduction, params kept                    all-reduce (replicas)
    1   no reduction, params kept unsharded          reduce-scatter (+ HSDP all-reduce), reshard
    2   reduce-scatter, params kept unsharded        reduce-scatter (+ HSDP all-reduce), reshard
    3   reduce-scatter, reshard (re-gathered)        reduce-scatter (+ HSDP all-reduce), reshard

z = 0 on FSDP2 is a shard group of one (no reduce-scatter) and a replica all-reduce; z >= 1 with
hybrid sharding all-reduces the accumulated gradient shard across replicas once per step. ZeRO-3
units reshard after forward (`reshard_after_forward=True`, set at `fully_shard`), so they
all-gather in forward and in backward of every micro-batch; the others all-gather once per step.

FSDP2 knobs (`FSDPModule`): `set_requires_gradient_sync` (reduce at all), `set_requires_all_reduce`
(the HSDP replica all-reduce), `set_reshard_after_backward`, `set_is_last_backward`; each set per
unit (`recurse=False`), before the micro-batch's backward.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class ShardedUnit:
    """One `fully_shard`ed module and the ZeRO stage of the layers it holds."""

    module: nn.Module  # an FSDPModule
    zero: int


@dataclass
class GradSync:
    """The units of one model part; `before_backward(last)` before each micro-batch's backward."""

    units: list[ShardedUnit] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.units)

    def before_backward(self, last: bool) -> None:
        """Flags for the coming backward pass, read by FSDP2's post-backward hooks."""
        for u in self.units:
            reduce_now = last or u.zero >= 2
            u.module.set_requires_gradient_sync(reduce_now, recurse=False)
            if reduce_now:
                u.module.set_requires_all_reduce(last, recurse=False)
            u.module.set_reshard_after_backward(last or u.zero >= 3, recurse=False)
            u.module.set_is_last_backward(last)

    def hold(self) -> None:
        """No reduction and no resharding: a split backward's weight pass still needs the parameters."""
        for u in self.units:
            u.module.set_requires_gradient_sync(False, recurse=False)
            u.module.set_reshard_after_backward(False, recurse=False)
            u.module.set_is_last_backward(False)

    def unshard(self) -> None:
        """Gather every unit's parameters now (a no-op for units that hold them gathered)."""
        for u in self.units:
            u.module.unshard()

    def reduce_now(self, last: bool) -> None:
        """Run the post-backward of every unit by hand, as the plan says for this micro-batch.

        For backward passes FSDP2's hooks do not see (a pipeline's weight-gradient pass runs
        `autograd.grad` from saved intermediates)."""
        self.before_backward(last)
        for u in self.units:
            for group in _param_groups(u.module):
                group.post_backward()


    def finish(self) -> None:
        """End of a pipeline step: reduce whatever is left (a no-op for units already reduced),
        reshard, and let each FSDP2 root wait for its reductions (its end-of-backward callback)."""
        self.before_backward(last=True)
        for u in self.units:
            for group in _param_groups(u.module):
                group.post_backward()
        for u in self.units:
            state = u.module._get_fsdp_state()
            if state._is_root:
                state._root_post_backward_final_callback()


def _param_groups(module: nn.Module) -> list:
    state = module._get_fsdp_state()
    return list(state._fsdp_param_groups)


@torch.no_grad()
def settle_gradients(params) -> None:
    """Lay every tensor-parallel gradient out like its parameter, once per step.

    DTensor leaves some gradients in another layout than their parameter: the weights of norms
    that run on sequence shards (Megatron sequence parallelism) get partial sums over the
    tensor-parallel ranks (Megatron all-reduces them once per step, so does this: one all-reduce
    per mesh for all of them), and a vocabulary-parallel embedding gets a replicated gradient
    (sliced here to the parameter's shard, no communication). FSDP2 settles its own units."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    partial: dict = {}
    for p in params:
        g = p.grad
        if not isinstance(g, DTensor) or g.placements == p.placements:
            continue
        sums = [isinstance(pl, Partial) and pl.reduce_op == "sum" for pl in g.placements]
        if any(sums) and all(isinstance(want, Replicate) for want, s in zip(p.placements, sums) if s):
            partial.setdefault((id(g.device_mesh), g.placements), []).append(p)
        else:
            p.grad = g.redistribute(p.device_mesh, p.placements)
    for group in partial.values():
        mesh, placements = group[0].grad.device_mesh, group[0].grad.placements
        locals_ = [p.grad.to_local() for p in group]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        for axis, pl in enumerate(placements):
            if isinstance(pl, Partial):
                dist.all_reduce(flat, group=mesh.get_group(axis))
        done = [Replicate() if isinstance(pl, Partial) else pl for pl in placements]
        for p, piece in zip(group, flat.split([t.numel() for t in locals_])):
            g = DTensor.from_local(piece.view_as(p.grad.to_local()), mesh, done, run_check=False)
            p.grad = g if tuple(done) == tuple(p.placements) else g.redistribute(mesh, p.placements)
