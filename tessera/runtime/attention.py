"""Ulysses sequence-parallel attention (Jacobs et al. 2023, "DeepSpeed Ulysses").

Each of the P ranks of a sequence-parallel group holds a contiguous 1/P slice of the sequence
(rank i of the group holds tokens [i*S/P, (i+1)*S/P)) for all H heads. Attention needs the whole
sequence, so one all-to-all trades the sequence split for a head split:

    (B, H, S/P, D) on each rank  --all-to-all-->  (B, H/P, S, D) on each rank
    attention on H/P heads over the full sequence (causal, or document-causal from the doc ids
    of the FULL sequence: `tessera.models.attention.attend`, no dense mask)
    (B, H/P, S, D)               --all-to-all-->  (B, H, S/P, D)

Grouped-query attention: when the key/value heads do not divide over the group, each kv head is
repeated (as `enable_gqa` would) the fewest times that makes them divide, so that every rank
receives the kv heads its query heads use.

An all-to-all with equal splits is its own adjoint, so the backward of each exchange is the same
exchange applied to the gradient. `group` may be swapped between steps (adaptive parallelism);
a group of one rank runs plain attention with no communication.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..models.attention import Documents, attend


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    # gloo writes a non-contiguous output in the wrong order without complaint: allocate contiguous.
    x = x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Even all-to-all over the leading dimension (one chunk per rank), differentiable."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group), None


def sequence_to_heads(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """(B, H, S/P, D) sequence-sharded -> (B, H/P, S, D) head-sharded over the P ranks of `group`."""
    b, h, s, d = x.shape
    chunks = x.reshape(b, size, h // size, s, d).permute(1, 0, 2, 3, 4)  # (P, B, H/P, S/P, D)
    received = _AllToAll.apply(chunks, group)  # chunk j: my heads, sequence slice of rank j
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)


def heads_to_sequence(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """(B, H/P, S, D) head-sharded -> (B, H, S/P, D) sequence-sharded (inverse of the above)."""
    b, hl, s, d = x.shape
    chunks = x.reshape(b, hl, size, s // size, d).permute(2, 0, 1, 3, 4)  # (P, B, H/P, S/P, D)
    received = _AllToAll.apply(chunks, group)  # chunk j: head slice of rank j, my sequence slice
    return received.permute(1, 0, 2, 3, 4).reshape(b, size * hl, s // size, d)


def kv_repeats(num_heads: int, num_kv_heads: int, size: int) -> int:
    """Fewest repeats r of each kv head such that the kv heads split over `size` ranks
    (num_kv_heads * r divisible by size) and still group the query heads evenly."""
    if num_heads % size:
        raise ValueError(f"Ulysses needs the {num_heads} attention heads to divide over the group of {size} ranks")
    group_size = num_heads // num_kv_heads
    for r in range(1, group_size + 1):
        if group_size % r == 0 and (num_kv_heads * r) % size == 0:
            return r
    return group_size  # unreachable: r = group_size gives num_heads kv heads


class UlyssesAttention(nn.Module):
    """Drop-in replacement of `tessera.models.transformer.CoreAttention` for a sequence sharded
    over `group`.

    forward(q, k, v, docs=None): q (B, H, S/P, D), k and v (B, Hkv, S/P, D), holding this rank's
    contiguous slice of the sequence; `docs` is None (causal) or the packed documents over the
    FULL sequence: doc ids (B, S) or a `Documents` (built once per batch and shared by every layer,
    so the block mask or length buckets are not rebuilt per layer). Returns (B, H, S/P, D).

    `group`: the sequence-parallel process group, in sequence-slice order (group rank i holds
    slice i). None means the default (world) group when torch.distributed is initialised, and a
    single process otherwise. Assign `module.group = other_group` to change it between steps.
    """

    def __init__(self, group=None):
        super().__init__()
        self.group = group

    def group_size(self) -> int:
        if self.group is None and not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.group)

    def forward(self, q, k, v, docs: Documents | torch.Tensor | None = None) -> torch.Tensor:
        size = self.group_size()
        if size == 1:
            return attend(q, k, v, docs)
        if docs is not None and docs.shape[-1] != q.shape[2] * size:
            raise ValueError(f"Ulysses attention needs the doc ids of the full sequence of {q.shape[2] * size} "
                             f"tokens, got ids of {docs.shape[-1]}")
        repeats = kv_repeats(q.shape[1], k.shape[1], size)
        if repeats > 1:
            k = k.repeat_interleave(repeats, dim=1)
            v = v.repeat_interleave(repeats, dim=1)
        q, k, v = (sequence_to_heads(t, self.group, size) for t in (q, k, v))
        out = attend(q, k, v, docs)
        return heads_to_sequence(out, self.group, size)
