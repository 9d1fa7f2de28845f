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
strategies differ: one all-to-all over the consecutive ranks whose blocks overlap (the lcm of the
two layouts' sp * tp), each rank sending each peer only the part of its block the peer needs and
does not hold (`tessera.cost.reshard`, which the cost model prices); backward, the gradient goes
back the same way. When the target block lies inside the source block on every rank (e.g. a
(dp=2, tp=2) layer feeding a (dp=4, tp=1) layer) the forward is a local slice with no
communication.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..cost import reshard as reshard_math
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
        if seq_over_tp is None:  # Megatron SP splits the sequence over tp (none without tp)
            seq_over_tp = s.sp == SPKind.MEGATRON and s.tp > 1
        return cls(dp=s.dp, sp=s.sp_degree, tp=s.tp, seq_over_tp=seq_over_tp)

    @property
    def stage_size(self) -> int:
        return self.dp * self.sp * self.tp

    @property
    def seq_parts(self) -> int:
        return self.sp * (self.tp if self.seq_over_tp else 1)

    @property
    def key(self) -> tuple[int, int, int, bool]:
        """The layout as `tessera.cost.reshard` names it."""
        return (self.dp, self.sp, self.tp, self.seq_over_tp)

    def block(self, stage_rank: int, batch: int, seq: int) -> tuple[int, int, int, int]:
        """(b0, b1, s0, s1): the rows and positions of a (batch, seq) activation this rank holds."""
        return reshard_math.block(self.key, stage_rank, batch, seq)

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


def _pieces(x: torch.Tensor, base: tuple[int, int, int, int], rects) -> list[torch.Tensor]:
    """The rectangles `rects` (activation coordinates) of `x`, which holds block `base`."""
    b0, _, s0, _ = base
    return [x[r[0] - b0:r[1] - b0, r[2] - s0:r[3] - s0] for r in rects]


def _move(x, src: ActLayout, dst: ActLayout, batch: int, seq: int, stage_rank: int, groups: dict):
    """This rank's `dst` block, from its `src` block `x`: one all-to-all over the re-sharding group
    (`tessera.cost.reshard.exchange`); a local slice when nothing crosses the network."""
    if dst.refines(src, batch, seq):
        return take_block(x, src, dst, stage_rank, batch, seq).contiguous()
    ex = reshard_math.exchange(src.key, dst.key, stage_rank, batch, seq)
    have, want = src.block(stage_rank, batch, seq), dst.block(stage_rank, batch, seq)
    rest = tuple(x.shape[2:])
    out = torch.empty((want[1] - want[0], want[3] - want[2], *rest), dtype=x.dtype, device=x.device)
    if ex.local is not None:
        _pieces(out, want, [ex.local])[0].copy_(_pieces(x, have, [ex.local])[0])
    if not ex.active:
        return out
    inner = math.prod(rest)
    size_of = lambda r: (r[1] - r[0]) * (r[3] - r[2]) * inner  # noqa: E731
    send_sizes, recv_sizes = [0] * ex.size, [0] * ex.size
    for peer, r in ex.sends:
        send_sizes[peer] = size_of(r)
    for peer, r in ex.recvs:
        recv_sizes[peer] = size_of(r)
    pieces = _pieces(x, have, [r for _, r in ex.sends])
    send = torch.cat([p.reshape(-1) for p in pieces]) if pieces else x.new_empty(0)
    received = torch.empty(sum(recv_sizes), dtype=x.dtype, device=x.device)  # contiguous: gloo needs it
    dist.all_to_all_single(received, send, recv_sizes, send_sizes, group=groups[ex.size])
    offset = 0
    for (_, r), target in zip(ex.recvs, _pieces(out, want, [r for _, r in ex.recvs])):
        n = size_of(r)
        target.copy_(received[offset:offset + n].view(target.shape))
        offset += n
    return out


class _Reshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, dst, batch, seq, stage_rank, groups):
        ctx.args = (src, dst, batch, seq, stage_rank, groups)
        return _move(x, src, dst, batch, seq, stage_rank, groups)

    @staticmethod
    def backward(ctx, grad):
        src, dst, batch, seq, stage_rank, groups = ctx.args
        return _move(grad.contiguous(), dst, src, batch, seq, stage_rank, groups), None, None, None, None, None, None


def same_blocks(a: ActLayout, b: ActLayout) -> bool:
    """Every rank holds the same block under both layouts (e.g. Ulysses sp=2 and Megatron tp=2)."""
    return reshard_math.same_blocks(a.key, b.key)


def reshard(x: torch.Tensor, src: ActLayout, dst: ActLayout, stage_rank: int, groups: dict) -> torch.Tensor:
    """Move activation `x` (this rank's `src` block, dims (B, S, ...)) to its `dst` block;
    `groups` maps a re-sharding group size to this rank's process group of that size
    (`ParallelDims.reshard_group`)."""
    if same_blocks(src, dst):
        return x
    batch, seq = x.shape[0] * src.dp, x.shape[1] * src.seq_parts
    return _Reshard.apply(x.contiguous(), src, dst, batch, seq, stage_rank, groups)


def reshard_sizes(acts: list[ActLayout]) -> list[int]:
    """The re-sharding group sizes (> 1) between adjacent layouts of a plan's layers, sorted."""
    sizes = {reshard_math.group_size(a.key, b.key) for a, b in zip(acts, acts[1:]) if not same_blocks(a, b)}
    return sorted(g for g in sizes if g > 1)
