"""Activation layouts between layers, and the autograd-aware move from one layout to the next.

A layer with degrees (dp, sp, tp) holds, on stage rank r = (d * sp + s) * tp + t, the batch
block d (of dp) and the sequence block s (of sp) of its input activation (B, S, H); with
Megatron-style sequence parallelism the sequence block is further split tp ways by t (the
residual stream between blocks stays sharded, as in Korthikanti et al. 2022); otherwise the
tp ranks hold the same block (replicas).

Gradient convention: every replica of a block receives the complete gradient of that block
(true under DTensor tensor parallelism, whose input redistribution all-reduces gradients), so
moving gradients back takes any one replica's copy.

`reshard(x, src, dst, ...)` moves an activation between the layouts of two adjacent layers whose
strategies differ: an all-gather over the stage, then each rank keeps its block. When the target
block is a sub-block of the source block on every rank (e.g. a (dp=2, tp=2) layer feeding a
(dp=4, tp=1) layer) the forward is a local slice with no communication, and symmetrically for the
backward.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..plan import LayerStrategy, SPKind


@dataclass(frozen=True)
class ActLayout:
    """Which (batch, sequence) block of a stage-wide activation each stage rank holds."""

    dp: int
    sp: int
    tp: int
    seq_over_tp: bool = False  # Megatron SP: the sequence block is split tp ways too

    @classmethod
    def of(cls, s: LayerStrategy, seq_over_tp: bool | None = None) -> "ActLayout":
        if seq_over_tp is None:
            seq_over_tp = s.sp == SPKind.MEGATRON
        return cls(dp=s.dp, sp=s.sp_degree, tp=s.tp, seq_over_tp=seq_over_tp)

    @property
    def stage_size(self) -> int:
        return self.dp * self.sp * self.tp

    @property
    def seq_parts(self) -> int:
        return self.sp * (self.tp if self.seq_over_tp else 1)

    def block(self, stage_rank: int, batch: int, seq: int) -> tuple[int, int, int, int]:
        """(b0, b1, s0, s1): the rows and positions of a (batch, seq) activation this rank holds."""
        d, rest = divmod(stage_rank, self.sp * self.tp)
        s, t = divmod(rest, self.tp)
        bb = batch // self.dp
        part = s * self.tp + t if self.seq_over_tp else s
        sb = seq // self.seq_parts
        return d * bb, (d + 1) * bb, part * sb, (part + 1) * sb

    def local_shape(self, batch: int, seq: int) -> tuple[int, int]:
        return batch // self.dp, seq // self.seq_parts

    def refines(self, other: "ActLayout", batch: int, seq: int) -> bool:
        """True when, on every stage rank, this layout's block lies inside `other`'s block
        (a loop over the stage's ranks, cached: forward asks it at every layout change)."""
        return _refines(self, other, batch, seq)


@functools.lru_cache(maxsize=4096)
def _refines(a: ActLayout, other: ActLayout, batch: int, seq: int) -> bool:
    for r in range(a.stage_size):
        b0, b1, s0, s1 = a.block(r, batch, seq)
        c0, c1, t0, t1 = other.block(r, batch, seq)
        if not (c0 <= b0 and b1 <= c1 and t0 <= s0 and s1 <= t1):
            return False
    return True


def take_block(x: torch.Tensor, have: ActLayout, want: ActLayout, stage_rank: int,
               batch: int, seq: int, seq_dim: int | None = 1) -> torch.Tensor:
    """Slice this rank's `want` block out of its `have` block (no communication).

    `want` must refine `have`; `seq_dim=None` keeps the whole sequence (masks keep all keys).
    """
    b0, b1, s0, s1 = want.block(stage_rank, batch, seq)
    c0, _, t0, _ = have.block(stage_rank, batch, seq)
    x = x.narrow(0, b0 - c0, b1 - b0)
    if seq_dim is not None:
        x = x.narrow(seq_dim, s0 - t0, s1 - s0)
    return x


def _gather_blocks(x: torch.Tensor, layout: ActLayout, batch: int, seq: int, group) -> torch.Tensor:
    """All-gather every rank's block and assemble the full (batch, seq, ...) tensor."""
    x = x.contiguous()
    world = layout.stage_size
    pieces = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    with warnings.catch_warnings():  # renamed in newer torch; the old name works from 2.11 on
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_into_tensor(pieces, x, group=group)
    pieces = pieces.view(world, *x.shape)
    full = torch.empty((batch, seq, *x.shape[2:]), dtype=x.dtype, device=x.device)
    for r in range(world):
        b0, b1, s0, s1 = layout.block(r, batch, seq)
        full[b0:b1, s0:s1] = pieces[r]
    return full


def _move(x, src: ActLayout, dst: ActLayout, batch: int, seq: int, stage_rank: int, group):
    if dst.refines(src, batch, seq):
        return take_block(x, src, dst, stage_rank, batch, seq).contiguous()
    full = _gather_blocks(x, src, batch, seq, group)
    b0, b1, s0, s1 = dst.block(stage_rank, batch, seq)
    return full[b0:b1, s0:s1].contiguous()


class _Reshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, dst, batch, seq, stage_rank, group):
        ctx.args = (src, dst, batch, seq, stage_rank, group)
        return _move(x, src, dst, batch, seq, stage_rank, group)

    @staticmethod
    def backward(ctx, grad):
        src, dst, batch, seq, stage_rank, group = ctx.args
        return _move(grad, dst, src, batch, seq, stage_rank, group), None, None, None, None, None, None


def reshard(x: torch.Tensor, src: ActLayout, dst: ActLayout, stage_rank: int, group) -> torch.Tensor:
    """Move activation `x` (this rank's `src` block, dims (B, S, ...)) to its `dst` block."""
    if src == dst:
        return x
    batch, seq = x.shape[0] * src.dp, x.shape[1] * src.seq_parts
    return _Reshard.apply(x, src, dst, batch, seq, stage_rank, group)
