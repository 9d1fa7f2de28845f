"""Activation layouts between layers, and the autograd-aware move from one layout to the next.

A layer with degrees (dp, cp, sp, tp) holds, on stage rank r = ((d * cp + c) * sp + s) * tp + t,
the batch block d (of dp) of its input activation (B, S, H) and a part of its sequence:
- context parallelism (cp > 1) cuts the sequence into 2 cp equal chunks and gives cp rank c the
  chunks c and 2 cp - 1 - c, in that order (the load-balanced causal split of Megatron-LM and
  torchtitan: every cp rank then has the same causal attention work); with cp = 1 the rank's
  part is the whole sequence;
- inside that part (its "local sequence", in local order), Ulysses splits it sp ways by s and,
  with Megatron-style sequence parallelism, further tp ways by t (the residual stream between
  blocks stays sharded, as in Korthikanti et al. 2022); otherwise the tp ranks hold the same
  block (replicas).
A rank's sequence block is therefore one or two ranges of positions (`seq_ranges`, in local
order); positions, labels and document ids follow the same ranges.

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
import math
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..plan import LayerStrategy, SPKind

Ranges = tuple[tuple[int, int], ...]


def load_balanced_ranges(seq: int, cp: int, c: int) -> Ranges:
    """Positions of cp rank c's local sequence: chunks c and 2 cp - 1 - c of 2 cp equal chunks
    (one range when they touch, c = cp - 1; the whole sequence when cp = 1)."""
    if cp == 1:
        return ((0, seq),)
    if seq % (2 * cp):
        raise ValueError(f"a sequence of {seq} tokens does not split into 2 x cp = {2 * cp} equal chunks")
    chunk = seq // (2 * cp)
    return _merge(((c * chunk, (c + 1) * chunk), ((2 * cp - 1 - c) * chunk, (2 * cp - c) * chunk)))


def _merge(ranges) -> Ranges:
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if b <= a:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


def sub_ranges(ranges: Ranges, start: int, stop: int) -> Ranges:
    """The positions at local offsets [start, stop) of a local sequence made of `ranges`."""
    out, offset = [], 0
    for a, b in ranges:
        lo, hi = max(start, offset), min(stop, offset + b - a)
        if lo < hi:
            out.append((a + lo - offset, a + hi - offset))
        offset += b - a
    return _merge(out)


@dataclass(frozen=True)
class ActLayout:
    """Which (batch, sequence) block of a stage-wide activation each stage rank holds."""

    dp: int
    sp: int
    tp: int
    seq_over_tp: bool = False  # Megatron SP: the sequence block is split tp ways too
    cp: int = 1  # context parallel: the load-balanced split of the sequence over cp ranks

    @classmethod
    def of(cls, s: LayerStrategy, seq_over_tp: bool | None = None) -> "ActLayout":
        if seq_over_tp is None:
            seq_over_tp = s.sp == SPKind.MEGATRON
        return cls(dp=s.dp, sp=s.sp_degree, tp=s.tp, seq_over_tp=seq_over_tp, cp=s.cp)

    @property
    def stage_size(self) -> int:
        return self.dp * self.cp * self.sp * self.tp

    @property
    def inner_parts(self) -> int:
        """Pieces a cp rank's local sequence is cut into (Ulysses, and Megatron SP)."""
        return self.sp * (self.tp if self.seq_over_tp else 1)

    @property
    def seq_parts(self) -> int:
        return self.cp * self.inner_parts

    @property
    def seq_multiple(self) -> int:
        """The sequence length must be a multiple of this for equal blocks: 2 cp chunks, each
        cp rank's local sequence cut into `inner_parts`."""
        if self.cp == 1:
            return self.inner_parts
        return math.lcm(2 * self.cp, self.seq_parts)

    def coords(self, stage_rank: int) -> tuple[int, int, int, int]:
        """(d, c, s, t) of a stage rank."""
        d, rest = divmod(stage_rank, self.cp * self.sp * self.tp)
        c, rest = divmod(rest, self.sp * self.tp)
        s, t = divmod(rest, self.tp)
        return d, c, s, t

    def rows(self, stage_rank: int, batch: int) -> tuple[int, int]:
        d = self.coords(stage_rank)[0]
        bb = batch // self.dp
        return d * bb, (d + 1) * bb

    def seq_ranges(self, stage_rank: int, seq: int) -> Ranges:
        """The positions of this rank's sequence block, in local order (one or two ranges)."""
        _, c, s, t = self.coords(stage_rank)
        local = load_balanced_ranges(seq, self.cp, c)
        part = s * self.tp + t if self.seq_over_tp else s
        size = (seq // self.cp) // self.inner_parts
        return sub_ranges(local, part * size, (part + 1) * size)

    def seq_index(self, stage_rank: int, seq: int, device=None) -> torch.Tensor:
        """The positions of `seq_ranges` as one index tensor."""
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.seq_ranges(stage_rank, seq)])

    def block(self, stage_rank: int, batch: int, seq: int) -> tuple[int, int, int, int]:
        """(b0, b1, s0, s1): the rows and positions of a (batch, seq) activation this rank holds,
        for a layout whose sequence block is one range (`seq_ranges` in general)."""
        ranges = self.seq_ranges(stage_rank, seq)
        if len(ranges) != 1:
            raise ValueError(f"the sequence block of {self} is {len(ranges)} ranges: use seq_ranges")
        return (*self.rows(stage_rank, batch), *ranges[0])

    def local_shape(self, batch: int, seq: int) -> tuple[int, int]:
        return batch // self.dp, seq // self.seq_parts

    def refines(self, other: "ActLayout", batch: int, seq: int) -> bool:
        """True when, on every stage rank, this layout's block lies inside `other`'s block
        (a loop over the stage's ranks, cached: forward asks it at every layout change)."""
        return _refines(self, other, batch, seq)


def _locate(inner: Ranges, outer: Ranges) -> list[tuple[int, int]] | None:
    """(local offset, length) in `outer`'s local order of each range of `inner`, or None when a
    range of `inner` does not lie inside one range of `outer`."""
    out = []
    for a, b in inner:
        offset = 0
        for c, d in outer:
            if c <= a and b <= d:
                out.append((offset + a - c, b - a))
                break
            offset += d - c
        else:
            return None
    return out


@functools.lru_cache(maxsize=4096)
def _refines(a: ActLayout, other: ActLayout, batch: int, seq: int) -> bool:
    for r in range(a.stage_size):
        b0, b1 = a.rows(r, batch)
        c0, c1 = other.rows(r, batch)
        if not (c0 <= b0 and b1 <= c1):
            return False
        if _locate(a.seq_ranges(r, seq), other.seq_ranges(r, seq)) is None:
            return False
    return True


def _select(x: torch.Tensor, pieces: list[tuple[int, int]], dim: int) -> torch.Tensor:
    parts = [x.narrow(dim, offset, length) for offset, length in pieces]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def take_block(x: torch.Tensor, have: ActLayout, want: ActLayout, stage_rank: int,
               batch: int, seq: int, seq_dim: int | None = 1) -> torch.Tensor:
    """Slice this rank's `want` block out of its `have` block (no communication).

    `want` must refine `have`; `seq_dim=None` keeps the whole sequence (masks keep all keys)."""
    b0, b1 = want.rows(stage_rank, batch)
    c0, _ = have.rows(stage_rank, batch)
    x = x.narrow(0, b0 - c0, b1 - b0)
    if seq_dim is not None:
        pieces = _locate(want.seq_ranges(stage_rank, seq), have.seq_ranges(stage_rank, seq))
        if pieces is None:
            raise ValueError(f"the sequence block of {want} does not lie inside that of {have}")
        x = _select(x, pieces, seq_dim)
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
        b0, b1 = layout.rows(r, batch)
        offset = 0
        for s0, s1 in layout.seq_ranges(r, seq):
            full[b0:b1, s0:s1] = pieces[r][:, offset:offset + s1 - s0]
            offset += s1 - s0
    return full


def _move(x, src: ActLayout, dst: ActLayout, batch: int, seq: int, stage_rank: int, group):
    if dst.refines(src, batch, seq):
        return take_block(x, src, dst, stage_rank, batch, seq).contiguous()
    full = _gather_blocks(x, src, batch, seq, group)
    b0, b1 = dst.rows(stage_rank, batch)
    return _select(full[b0:b1], [(a, b - a) for a, b in dst.seq_ranges(stage_rank, seq)], 1).contiguous()


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
