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
strategies differ: one all-to-all over the consecutive ranks whose blocks overlap (the lcm of the
two layouts' cp * sp * tp), each rank sending each peer only the parts of its block the peer
needs and does not hold (`tessera.cost.reshard`, which the cost model prices); backward, the
gradient goes back the same way. When the target block lies inside the source block on every
rank (e.g. a (dp=2, tp=2) layer feeding a (dp=4, tp=1) layer) the forward is a local slice with
no communication.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..cost import reshard as reshard_math
from ..cost.reshard import Ranges, load_balanced_ranges, sub_ranges  # noqa: F401  (re-exported)
from ..plan import LayerStrategy, SPKind

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
        if seq_over_tp is None:  # Megatron SP splits the sequence over tp (none without tp)
            seq_over_tp = s.sp == SPKind.MEGATRON and s.tp > 1
        return cls(dp=s.dp, sp=s.sp_degree, tp=s.tp, seq_over_tp=seq_over_tp, cp=s.cp)

    @property
    def key(self) -> reshard_math.Layout:
        """The layout as `tessera.cost.reshard` names it."""
        return (self.dp, self.sp, self.tp, self.seq_over_tp, self.cp)

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


def _move(x, src: ActLayout, dst: ActLayout, batch: int, seq: int, stage_rank: int, groups: dict):
    """This rank's `dst` block, from its `src` block `x`: one all-to-all over the re-sharding group
    (`tessera.cost.reshard.exchange`); a local slice when nothing crosses the network."""
    if dst.refines(src, batch, seq):
        return take_block(x, src, dst, stage_rank, batch, seq).contiguous()
    ex = reshard_math.exchange(src.key, dst.key, stage_rank, batch, seq)
    have = reshard_math.block(src.key, stage_rank, batch, seq)
    want = reshard_math.block(dst.key, stage_rank, batch, seq)
    rest = tuple(x.shape[2:])
    rows, cols = dst.local_shape(batch, seq)
    out = torch.empty((rows, cols, *rest), dtype=x.dtype, device=x.device)

    def piece(t, held, rect):
        r0, nr, s0, ns = reshard_math.local_slice(held, rect)
        return t[r0:r0 + nr, s0:s0 + ns]

    for rect in ex.local:
        piece(out, want, rect).copy_(piece(x, have, rect))
    if not ex.active:
        return out
    inner = math.prod(rest)
    size_of = lambda r: (r[1] - r[0]) * (r[3] - r[2]) * inner  # noqa: E731
    send_sizes, recv_sizes = [0] * ex.size, [0] * ex.size
    for peer, r in ex.sends:
        send_sizes[peer] += size_of(r)
    for peer, r in ex.recvs:
        recv_sizes[peer] += size_of(r)
    pieces = [piece(x, have, r).reshape(-1) for _, r in ex.sends]
    send = torch.cat(pieces) if pieces else x.new_empty(0)
    received = torch.empty(sum(recv_sizes), dtype=x.dtype, device=x.device)  # contiguous: gloo needs it
    dist.all_to_all_single(received, send, recv_sizes, send_sizes, group=groups[ex.size])
    offset = 0
    for _, r in ex.recvs:
        target = piece(out, want, r)
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
