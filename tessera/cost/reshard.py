"""Moving an activation between two layers' layouts: which rank sends what to whom (no torch).

A layout (dp, sp, tp, seq_over_tp) gives stage rank r = (d * sp + s) * tp + t the batch block d (of
dp) and the sequence block s (of sp) of a (batch, seq) activation; with Megatron sequence
parallelism (`seq_over_tp`) the sequence block is split tp ways by t, otherwise the tp ranks hold
the same block. A layout's blocks belong to groups of `width = sp * tp` consecutive ranks (one
batch block each), and `replicas` consecutive ranks hold the same block (tp without sequence
parallelism, else 1).

Re-sharding from layout a to layout b runs inside groups of G = lcm(width_a, width_b) consecutive
stage ranks: each b block lies in the a blocks of its group. Rank q needs B(q); of each a block
holding part of it, the replica whose index matches q's (q mod replicas_a) sends that part,
A(s) ∩ B(q), one rectangle; the part q holds itself stays (no copy crosses the network). One
all-to-all over the group moves it, forward; the gradient goes back the same way with a and b
swapped (each replica of a block holds its complete gradient). When b's blocks lie inside a's on
every rank nothing is sent (a slice); the all-to-all is skipped when no rank of the group sends.

This is what the runtime issues (`runtime/layout.py`) and what the cost model prices
(`cost/layer.py` `transition_time`, `cost/collectives.py`): the all-to-all's bytes are what a
rank sends, the time that of the busiest rank of the group.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

Layout = tuple[int, int, int, bool]  # (dp, sp, tp, seq_over_tp)
Rect = tuple[int, int, int, int]  # (b0, b1, s0, s1): rows and positions, end exclusive


def layout_of(dp: int, sp: int, tp: int, megatron: bool) -> Layout:
    """A layer's activation layout: Megatron SP splits the sequence over tp (none without tp)."""
    return (dp, sp, tp, bool(megatron and tp > 1))


def width(a: Layout) -> int:
    return a[1] * a[2]


def seq_parts(a: Layout) -> int:
    return a[1] * (a[2] if a[3] else 1)


def replicas(a: Layout) -> int:
    return 1 if a[3] else a[2]


def block(a: Layout, stage_rank: int, batch: int, seq: int) -> Rect:
    """(b0, b1, s0, s1): the rows and positions of a (batch, seq) activation this rank holds."""
    dp, sp, tp, over_tp = a
    d, rest = divmod(stage_rank, sp * tp)
    s, t = divmod(rest, tp)
    rows, part = batch // dp, (s * tp + t if over_tp else s)
    cols = seq // seq_parts(a)
    return d * rows, (d + 1) * rows, part * cols, (part + 1) * cols


def same_blocks(a: Layout, b: Layout) -> bool:
    """Every rank holds the same block under both layouts (e.g. Ulysses sp=2 and Megatron tp=2):
    blocks follow from (dp, width, replicas)."""
    return a == b or (a[0], width(a), replicas(a)) == (b[0], width(b), replicas(b))


def group_size(a: Layout, b: Layout) -> int:
    """Ranks the re-sharding between `a` and `b` runs over (consecutive stage ranks)."""
    return math.lcm(width(a), width(b))


def _intersect(x: Rect, y: Rect) -> Rect | None:
    b0, b1, s0, s1 = max(x[0], y[0]), min(x[1], y[1]), max(x[2], y[2]), min(x[3], y[3])
    return (b0, b1, s0, s1) if b0 < b1 and s0 < s1 else None


@dataclass(frozen=True)
class Exchange:
    """What one rank does to move its `a` block to its `b` block.

    `first`: the stage rank the group starts at; `size`: the group's ranks; `sends` and `recvs`:
    (group index of the peer, rectangle in the activation's coordinates), in group order;
    `local`: the part of the b block the rank holds already; `active`: some rank of the group
    sends something (all of them then take part in the all-to-all)."""

    first: int
    size: int
    sends: tuple[tuple[int, Rect], ...]
    recvs: tuple[tuple[int, Rect], ...]
    local: Rect | None
    active: bool


@lru_cache(maxsize=4096)
def exchange(a: Layout, b: Layout, stage_rank: int, batch: int, seq: int) -> Exchange:
    """The exchange of `stage_rank` when an activation (batch, seq, ...) moves from `a` to `b`."""
    size = group_size(a, b)
    first = stage_rank - stage_rank % size
    me, rep = stage_rank - first, replicas(a)
    mine_a, mine_b = block(a, stage_rank, batch, seq), block(b, stage_rank, batch, seq)
    sends, recvs = [], []
    for i in range(size):
        if i == me or i % rep != me % rep:
            continue
        out = _intersect(mine_a, block(b, first + i, batch, seq))
        if out is not None:
            sends.append((i, out))
        got = _intersect(block(a, first + i, batch, seq), mine_b)
        if got is not None:
            recvs.append((i, got))
    active = bool(sends or recvs) or _group_active(a, b, batch, seq)
    return Exchange(first, size, tuple(sends), tuple(recvs), _intersect(mine_a, mine_b), active)


@lru_cache(maxsize=1024)
def _group_active(a: Layout, b: Layout, batch: int, seq: int) -> bool:
    sent, _ = exchange_volume(a, b, batch, seq)
    return bool(np.any(sent > 0))


def exchange_volume(a: Layout, b: Layout, batch: float = 1.0, seq: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(sent, received) elements of a (batch, seq) activation per rank of the first group, (G,)
    arrays (per unit hidden width); fractional `batch` and `seq` give shares of the whole."""
    size = group_size(a, b)
    r = np.arange(size)

    def rects(x: Layout):
        dp, sp, tp, over_tp = x
        d, rest = r // (sp * tp), r % (sp * tp)
        part = rest if over_tp else rest // tp
        rows, cols = batch / dp, seq / seq_parts(x)
        return d * rows, (d + 1) * rows, part * cols, (part + 1) * cols

    ab0, ab1, as0, as1 = rects(a)
    bb0, bb1, bs0, bs1 = rects(b)
    rows = np.clip(np.minimum(ab1[:, None], bb1[None, :]) - np.maximum(ab0[:, None], bb0[None, :]), 0, None)
    cols = np.clip(np.minimum(as1[:, None], bs1[None, :]) - np.maximum(as0[:, None], bs0[None, :]), 0, None)
    rep = replicas(a)
    serves = (r[:, None] % rep == r[None, :] % rep) & (r[:, None] != r[None, :])
    moved = np.where(serves, rows * cols, 0.0)  # [sender, receiver]
    return moved.sum(axis=1), moved.sum(axis=0)


@lru_cache(maxsize=65536)
def busiest_share(a: Layout, b: Layout) -> float:
    """The most any rank sends or receives moving from `a` to `b`, as a share of the whole
    activation (the time of an all-to-all is its busiest rank's)."""
    if same_blocks(a, b):
        return 0.0
    sent, received = exchange_volume(a, b)
    return float(max(sent.max(), received.max()))


def sent_by(a: Layout, b: Layout, stage_rank: int, batch: int, seq: int) -> int:
    """(batch, seq) elements `stage_rank` sends moving from `a` to `b` (0: none, or no exchange)."""
    ex = exchange(a, b, stage_rank, batch, seq)
    return sum((r[1] - r[0]) * (r[3] - r[2]) for _, r in ex.sends)
