"""Tensor parallelism inside a MoE layer: one reduction of the layer's output per direction.

The tp ranks of a MoE layer route the same tokens (the router is replicated); each runs its slice of
every expert and of the shared expert (w1 and w3 sliced by rows, w2 by columns, as Megatron slices
an MLP; `TensorParallelExperts`, `partial_mlp`), so their outputs are partial sums over the tp
ranks. The layer keeps them partial through the expert-parallel combine and the weighting by the
router, and reduces the layer's output once (`TPMoEIO.leave`): an all-reduce, or under Megatron
sequence parallelism a reduce-scatter to the sequence shards, whose input was all-gathered once on
entry (`TPMoEIO.enter`). The backward mirrors it: the output gradient is whole on every tp rank
(identity, or an all-gather), and the partial input gradients are summed once (an all-reduce, or a
reduce-scatter). This is the Megatron MLP's pattern, as cost/layer.py prices the MoE half of a
block: per micro-batch one all-reduce each way, or one all-gather + reduce-scatter pair each way.

Exact with a replicated router: the gradient of the routing weights w_tj = <g_t, y_tj> (and of the
shared expert's gate) is a partial sum when y is, so it is all-reduced over tp in the backward
(`_PartialMix`: T (k + 1) fp32 values, next to T h for the output); the router then sees whole
gradients on every tp rank (its weight stays replicated) and its input gradient, the same on every
rank, is scaled by 1 / tp (`_ScaleGrad`) so that the sum over tp ranks counts it once.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..models.moe import Experts


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if hasattr(w, "to_local") else w


def partial_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """This tp rank's partial output of an MLP whose weights are sliced over the tp ranks."""
    if mlp.swiglu:
        h = F.silu(F.linear(x, _local(mlp.w1.weight))) * F.linear(x, _local(mlp.w3.weight))
    else:
        h = F.gelu(F.linear(x, _local(mlp.w1.weight)), approximate="tanh")
    return F.linear(h, _local(mlp.w2.weight))


def slice_mlp(mlp: nn.Module, tp_mesh) -> None:
    """Slice an MLP's weights over the tp ranks (DTensor parameters on the tp mesh: FSDP2 and
    checkpoints see whole matrices): w1, w3 by rows, w2 by columns."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for name, dim in (("w1", 0), ("w3", 0), ("w2", 1)):
        lin = getattr(mlp, name, None)
        if lin is not None:
            lin.weight = nn.Parameter(distribute_tensor(lin.weight, tp_mesh, [Shard(dim)], src_data_rank=None),
                                      requires_grad=lin.weight.requires_grad)


class TensorParallelExperts(Experts):
    """Experts sliced over the tp ranks; `forward` returns this rank's partial outputs (the layer
    reduces them once, module docstring)."""

    def __init__(self, experts: dict[int, nn.Module], tp_mesh):
        super().__init__(experts)
        for expert in self:
            slice_mlp(expert, tp_mesh)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outs = [partial_mlp(expert, part) for expert, part in zip(self, x.split(counts))]
        return torch.cat(outs) if outs else x[:0]


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


class ReduceFromTP(torch.autograd.Function):
    """Sum of the tp ranks' partial outputs (one all-reduce); identity backward (the gradient is
    complete on every rank). Also the vocabulary-parallel embedding's reduction (tp_embedding.py)."""

    @staticmethod
    def forward(ctx, y, group):
        y = y.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _gather_seq(x: torch.Tensor, group, tp: int) -> torch.Tensor:
    """(B, S/tp, ...) shards -> (B, S, ...), shard t at positions [t S/tp, (t+1) S/tp)."""
    x = x.contiguous()
    out = torch.empty((tp * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x, group=group)
    return out.view(tp, *x.shape).transpose(0, 1).reshape(x.shape[0], tp * x.shape[1], *x.shape[2:])


def _reduce_scatter_seq(x: torch.Tensor, group, tp: int) -> torch.Tensor:
    """(B, S, ...) partial sums -> this rank's (B, S/tp, ...) shard of their sum."""
    b, s = x.shape[0], x.shape[1]
    pieces = x.reshape(b, tp, s // tp, *x.shape[2:]).transpose(0, 1).contiguous()
    out = torch.empty(pieces.shape[1:], dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, pieces.view(tp * b, *pieces.shape[2:]), group=group)
    return out


class _GatherSeqTP(torch.autograd.Function):
    """All-gather of the sequence shards forward; reduce-scatter of the partial gradients backward."""

    @staticmethod
    def forward(ctx, x, group, tp):
        ctx.args = (group, tp)
        return _gather_seq(x, group, tp)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, *ctx.args), None, None


class _ReduceScatterSeqTP(torch.autograd.Function):
    """Reduce-scatter of partial sums to the sequence shards forward; all-gather backward."""

    @staticmethod
    def forward(ctx, y, group, tp):
        ctx.args = (group, tp)
        return _reduce_scatter_seq(y, group, tp)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, *ctx.args), None, None


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class _PartialMix(torch.autograd.Function):
    """out = sum_j w_j y_j per token (index_add over `token`) [+ gate * shared] with y and shared
    partial over the tp ranks: the backward's weight (and gate) gradients are all-reduced over tp
    in one call (module docstring)."""

    @staticmethod
    def forward(ctx, y, w, token, tokens, shared, gate, group):
        ctx.save_for_backward(y, w, token, shared, gate)
        ctx.group = group
        out = torch.zeros((tokens, y.shape[-1]), dtype=y.dtype, device=y.device)
        out.index_add_(0, token, y * w.to(y.dtype)[:, None])
        return out if shared is None else out + gate.to(y.dtype) * shared

    @staticmethod
    def backward(ctx, grad):
        y, w, token, shared, gate = ctx.saved_tensors
        g = grad[token]
        parts = [(g * y).sum(-1, dtype=torch.float32)]
        if shared is not None:
            parts.append((grad * shared).sum(-1, dtype=torch.float32))
        both = torch.cat(parts)
        dist.all_reduce(both, group=ctx.group)
        grad_w = both[:len(w)].to(w.dtype)
        grad_y = g * w.to(g.dtype)[:, None]
        if shared is None:
            return grad_y, grad_w, None, None, None, None, None
        grad_gate = both[len(w):].to(gate.dtype)[:, None]
        return grad_y, grad_w, None, None, grad * gate.to(grad.dtype), grad_gate, None


class TPMoEIO:
    """The MoE layer's tensor-parallel entry, exit and mixing (module docstring)."""

    def __init__(self, group, tp: int, sequence_parallel: bool):
        self.group, self.tp, self.sequence_parallel = group, tp, sequence_parallel

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return _GatherSeqTP.apply(x, self.group, self.tp)
        return _CopyToTP.apply(x, self.group)

    def router_input(self, x: torch.Tensor) -> torch.Tensor:
        return _ScaleGrad.apply(x, 1.0 / self.tp)

    def mix(self, y, w, token, tokens, shared, gate):
        return _PartialMix.apply(y, w, token, tokens, shared, gate, self.group)

    def block_norm(self, norm: nn.Module):
        """The block's norm on whole-sequence rows: its weight (and bias) used through `_CopyToTP`,
        whose backward sums the tp ranks' partial gradients of it (as Megatron SP's norms)."""
        weight = _CopyToTP.apply(_local(norm.weight), self.group)
        if isinstance(norm, nn.RMSNorm):
            return lambda x: F.rms_norm(x, norm.normalized_shape, weight, norm.eps)
        bias = _CopyToTP.apply(_local(norm.bias), self.group) if norm.bias is not None else None
        return lambda x: F.layer_norm(x, norm.normalized_shape, weight, bias, norm.eps)

    def leave(self, out: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return _ReduceScatterSeqTP.apply(out, self.group, self.tp)
        return ReduceFromTP.apply(out, self.group)


def tp_experts(moe, tp_mesh, dense_tp_mesh) -> None:
    """Slice the experts (on the expert mesh's tp axis) and the shared expert (on the block's)."""
    from ..errors import TesseraError

    if any(m.bias is not None for e in moe.experts for m in e.modules() if isinstance(m, nn.Linear)):
        raise TesseraError("experts with biases do not run tensor parallel (no preset has them): use tp=1 "
                           "for the MoE layers")
    moe.experts = TensorParallelExperts({e: moe.experts[e] for e in moe.experts.indices}, tp_mesh)
    if hasattr(moe, "shared_expert"):
        slice_mlp(moe.shared_expert, dense_tp_mesh)
