"""The vocabulary-parallel token embedding (Megatron-LM's `VocabParallelEmbedding`).

Each tensor-parallel rank holds rows [start, start + n) of the table (a DTensor `Shard(0)` on the
tp mesh, so FSDP2, checkpoints and initialisation see it as any TP weight), looks up the tokens
that fall in its rows (the others give zeros), and the partial sums are reduced over tp:
    without sequence parallelism   all-reduce forward, nothing backward (the gradient arriving
                                   from the replicated residual stream is already complete);
    Megatron sequence parallelism  reduce-scatter over the sequence forward, all-gather of the
                                   gradient backward (the residual stream is sequence-sharded).
The table's gradient is computed on the local rows only: its size is the shard's, where
DTensor's `RowwiseParallel` embedding produces a full-vocabulary replicated gradient on every
rank first (7.8 GiB for llama3-405b's table in fp32).

Learned positions (GPT-2) join the partial sum before the reduction, their values on tp rank 0
only but their gradient on every rank: each tp rank then holds the complete position gradient
(the reduction's backward hands every rank the whole gradient), as replicas must, with no
collective of their own.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .expert_tp import ReduceFromTP


def _seq_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).contiguous()


class _ReduceScatterSeq(torch.autograd.Function):
    """Sum over the group and keep this rank's block of the sequence (dim 1) forward; all-gather
    the gradient's sequence blocks backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size = dist.get_world_size(group)
        full = _seq_first(x)  # (S, B, H): the scattered dim first, each block contiguous
        out = torch.empty((full.shape[0] // size, *full.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, full, group=group)
        return out.transpose(0, 1).contiguous()

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        size = dist.get_world_size(group)
        piece = _seq_first(grad)
        full = torch.empty((piece.shape[0] * size, *piece.shape[1:]), dtype=grad.dtype, device=grad.device)
        dist.all_gather_into_tensor(full, piece, group=group)
        return full.transpose(0, 1).contiguous(), None


class VocabParallelEmbedding(nn.Module):
    """A token embedding whose table is split over the tensor-parallel ranks by rows (module
    docstring). `weight` keeps the name and the full shape of `nn.Embedding`'s."""

    def __init__(self, embedding: nn.Embedding, tp_mesh, sequence_parallel: bool):
        super().__init__()
        from torch.distributed.tensor import Shard, distribute_tensor

        vocab = embedding.weight.shape[0]
        size, rank = tp_mesh.size(), tp_mesh.get_local_rank()
        rows = -(-vocab // size)  # torch.chunk's split, as DTensor's Shard(0)
        self.start = min(rank * rows, vocab)
        self.rows = max(0, min(rows, vocab - self.start))
        self.first_rank = rank == 0
        self.group = tp_mesh.get_group()
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(distribute_tensor(embedding.weight, tp_mesh, [Shard(0)], src_data_rank=None))

    def forward(self, tokens: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        """Embeddings of `tokens` (B, S), plus `extra` (learned positions, broadcastable to
        (B, S, H)), reduced over tp: (B, S, H), or (B, S / tp, H) with sequence parallelism."""
        table = self.weight.to_local()
        outside = (tokens < self.start) | (tokens >= self.start + self.rows)
        rows = F.embedding((tokens - self.start).masked_fill(outside, 0), table)
        partial = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        if extra is not None:
            # The value once (rank 0), the gradient on every rank (module docstring).
            partial = partial + (extra if self.first_rank else extra - extra.detach())
        if self.sequence_parallel:
            return _ReduceScatterSeq.apply(partial, self.group)
        return ReduceFromTP.apply(partial, self.group)
