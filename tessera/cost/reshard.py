"""Moving an activation between two layers' layouts: which rank sends what to whom (no torch).

A layout (dp, sp, tp, seq_over_tp, cp) gives stage rank r = ((d * cp + c) * sp + s) * tp + t the
batch block d (of dp) of a (batch, seq) activation and a part of its sequence: context
parallelism (cp > 1) gives cp rank c the chunks c and 2 cp - 1 - c of 2 cp equal chunks (the
load-balanced causal split), its "local sequence"; inside it Ulysses takes the s-th of sp equal
pieces and, with Megatron sequence parallelism (`seq_over_tp`), the tp ranks split that piece tp
ways, otherwise they hold the same piece. A rank's block is thus its rows times one or two
ranges of positions (`seq_ranges`, in local order). A layout's blocks belong to groups of
`width = cp * sp * tp` consecutive ranks (one batch block each), and `replicas` consecutive ranks
hold the same block (tp without sequence parallelism, else 1).

Re-sharding from layout a to layout b runs inside groups of G = lcm(width_a, width_b) consecutive
stage ranks: both layouts give such a group the same rows. Rank q needs B(q); of each a block
holding part of it, the replica whose index matches q's (q mod replicas_a) sends that part,
A(s) ∩ B(q) (rectangles: rows x a range of positions); the part q holds itself stays (no copy
crosses the network). One all-to-all over the group moves it, forward; the gradient goes back
the same way with a and b swapped (each replica of a block holds its complete gradient). When
b's blocks lie inside a's on every rank nothing is sent (a slice); the all-to-all is skipped
when no rank of the group sends.

This is what the runtime issues (`runtime/layout.py`) and what the cost model prices
(`cost/layer.py` `transition_time`, `cost/collectives.py`): the all-to-all's bytes are what a
rank sends, the time that of the busiest rank of the group.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

Layout = tuple[int, int, int, bool, int]  # (dp, sp, tp, seq_over_tp, cp)
Ranges = tuple[tuple[int, int], ...]
Rect = tuple[int, int, int, int]  # (b0, b1, s0, s1): rows and positions, end exclusive


def layout_of(dp: int, sp: int, tp: int, megatron: bool, cp: int = 1) -> Layout:
    """A layer's activation layout: Megatron SP splits the sequence over tp (none without tp)."""
    return (dp, sp, tp, bool(megatron and tp > 1), cp)


def width(a: Layout) -> int:
    return a[4] * a[1] * a[2]


def inner_parts(a: Layout) -> int:
    """Pieces a cp rank's local sequence is cut into (Ulysses, and Megatron SP)."""
    return a[1] * (a[2] if a[3] else 1)


def seq_parts(a: Layout) -> int:
    return a[4] * inner_parts(a)


def seq_multiple(a: Layout) -> int:
    """The sequence length must be a multiple of this for equal blocks."""
    return inner_parts(a) if a[4] == 1 else math.lcm(2 * a[4], seq_parts(a))


def replicas(a: Layout) -> int:
    return 1 if a[3] else a[2]


def _merge(ranges) -> Ranges:
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if hi <= lo:
            continue
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


def load_balanced_ranges(seq: int, cp: int, c: int) -> Ranges:
    """Positions of cp rank c's local sequence: chunks c and 2 cp - 1 - c of 2 cp equal chunks
    (one range when they touch, c = cp - 1; the whole sequence when cp = 1)."""
    if cp == 1:
        return ((0, seq),)
    if seq % (2 * cp):
        raise ValueError(f"a sequence of {seq} tokens does not split into 2 x cp = {2 * cp} equal chunks")
    chunk = seq // (2 * cp)
    return _merge(((c * chunk, (c + 1) * chunk), ((2 * cp - 1 - c) * chunk, (2 * cp - c) * chunk)))


def sub_ranges(ranges: Ranges, start: int, stop: int) -> Ranges:
    """The positions at local offsets [start, stop) of a local sequence made of `ranges`."""
    out, offset = [], 0
    for lo, hi in ranges:
        a, b = max(start, offset), min(stop, offset + hi - lo)
        if a < b:
            out.append((lo + a - offset, lo + b - offset))
        offset += hi - lo
    return _merge(out)


def coords(a: Layout, stage_rank: int) -> tuple[int, int, int, int]:
    """(d, c, s, t) of a stage rank."""
    dp, sp, tp, _, cp = a
    d, rest = divmod(stage_rank, cp * sp * tp)
    c, rest = divmod(rest, sp * tp)
    s, t = divmod(rest, tp)
    return d, c, s, t


def rows(a: Layout, stage_rank: int, batch: int) -> tuple[int, int]:
    d = coords(a, stage_rank)[0]
    n = batch // a[0]
    return d * n, (d + 1) * n


def seq_ranges(a: Layout, stage_rank: int, seq: int) -> Ranges:
    """The positions of this rank's sequence block, in local order (one or two ranges)."""
    _, c, s, t = coords(a, stage_rank)
    local = load_balanced_ranges(seq, a[4], c)
    part = s * a[2] + t if a[3] else s
    size = (seq // a[4]) // inner_parts(a)
    return sub_ranges(local, part * size, (part + 1) * size)


def block(a: Layout, stage_rank: int, batch: int, seq: int) -> tuple[Rect, ...]:
    """The rectangles of a (batch, seq) activation this rank holds, in its local order."""
    b0, b1 = rows(a, stage_rank, batch)
    return tuple((b0, b1, s0, s1) for s0, s1 in seq_ranges(a, stage_rank, seq))


def local_slice(held: tuple[Rect, ...], rect: Rect) -> tuple[int, int, int, int]:
    """(row offset, rows, position offset, positions) of `rect` in the local tensor of a rank
    holding `held` (rect lies inside one of its rectangles)."""
    offset = 0
    for b0, b1, s0, s1 in held:
        if s0 <= rect[2] and rect[3] <= s1 and b0 <= rect[0] and rect[1] <= b1:
            return rect[0] - b0, rect[1] - rect[0], offset + rect[2] - s0, rect[3] - rect[2]
        offset += s1 - s0
    raise ValueError(f"{rect} does not lie inside {held}")


def same_blocks(a: Layout, b: Layout) -> bool:
    """Every rank holds the same block under both layouts (e.g. Ulysses sp=2 and Megatron tp=2)."""
    if a == b:
        return True
    if a[0] != b[0] or width(a) != width(b) or replicas(a) != replicas(b):
        return False
    if a[4] == b[4] == 1:
        return True
    batch, seq = a[0], math.lcm(seq_multiple(a), seq_multiple(b))
    return all(block(a, r, batch, seq) == block(b, r, batch, seq) for r in range(width(a)))


def group_size(a: Layout, b: Layout) -> int:
    """Ranks the re-sharding between `a` and `b` runs over (consecutive stage ranks)."""
    return math.lcm(width(a), width(b))


def _intersect(xs: tuple[Rect, ...], ys: tuple[Rect, ...]) -> list[Rect]:
    out = []
    for x in xs:
        for y in ys:
            b0, b1, s0, s1 = max(x[0], y[0]), min(x[1], y[1]), max(x[2], y[2]), min(x[3], y[3])
            if b0 < b1 and s0 < s1:
                out.append((b0, b1, s0, s1))
    return out


@dataclass(frozen=True)
class Exchange:
    """What one rank does to move its `a` block to its `b` block.

    `first`: the stage rank the group starts at; `size`: the group's ranks; `sends` and `recvs`:
    (group index of the peer, rectangle in the activation's coordinates), in group order (a
    sender and its receiver list their shared rectangles in the same order); `local`: the parts
    of the b block the rank holds already; `active`: some rank of the group sends something (all
    of them then take part in the all-to-all)."""

    first: int
    size: int
    sends: tuple[tuple[int, Rect], ...]
    recvs: tuple[tuple[int, Rect], ...]
    local: tuple[Rect, ...]
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
        sends += [(i, r) for r in _intersect(mine_a, block(b, first + i, batch, seq))]
        recvs += [(i, r) for r in _intersect(block(a, first + i, batch, seq), mine_b)]
    active = bool(sends or recvs) or _group_active(a, b)
    return Exchange(first, size, tuple(sends), tuple(recvs), tuple(_intersect(mine_a, mine_b)), active)


@lru_cache(maxsize=1024)
def _group_active(a: Layout, b: Layout) -> bool:
    sent, _ = exchange_volume(a, b)
    return bool(np.any(sent > 0))


def _unit(a: Layout, b: Layout) -> tuple[int, int]:
    """The smallest (batch, seq) on which both layouts' blocks are whole."""
    return math.lcm(a[0], b[0]), math.lcm(seq_multiple(a), seq_multiple(b))


@lru_cache(maxsize=4096)
def _blocks_array(x: Layout, size: int, batch: int, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows (size, 2) and sequence ranges (size, 2, 2) of the first `size` ranks, `block` for all
    of them at once (a missing second range is empty)."""
    dp, sp, tp, over_tp, cp = x
    r = np.arange(size)
    d, rest = np.divmod(r, cp * sp * tp)
    c, rest = np.divmod(rest, sp * tp)
    s, t = np.divmod(rest, tp)
    n = batch // dp
    rws = np.stack([d * n, (d + 1) * n], axis=1).astype(float)
    part = s * tp + t if over_tp else s
    size_ = (seq // cp) // inner_parts(x)
    lo, hi = part * size_, (part + 1) * size_  # offsets in the local sequence
    rng = np.zeros((size, 2, 2))
    if cp == 1:
        rng[:, 0, 0], rng[:, 0, 1] = lo, hi
    else:
        chunk = seq // (2 * cp)
        # Offsets [0, chunk) lie in chunk c, [chunk, 2 chunk) in chunk 2 cp - 1 - c.
        a0, a1 = np.minimum(lo, chunk), np.minimum(hi, chunk)
        b0, b1 = np.maximum(lo, chunk) - chunk, np.maximum(hi, chunk) - chunk
        rng[:, 0, 0], rng[:, 0, 1] = c * chunk + a0, c * chunk + a1
        rng[:, 1, 0], rng[:, 1, 1] = (2 * cp - 1 - c) * chunk + b0, (2 * cp - 1 - c) * chunk + b1
    rws.flags.writeable = rng.flags.writeable = False
    return rws, rng


def _overlap(ra, qa, rb, qb) -> np.ndarray:
    """Elements in common of the blocks (rows ra, ranges qa) and (rb, qb), broadcast."""
    nrows = np.clip(np.minimum(ra[..., 1], rb[..., 1]) - np.maximum(ra[..., 0], rb[..., 0]), 0, None)
    ncols = 0.0
    for i in range(2):
        for j in range(2):
            ncols = ncols + np.clip(np.minimum(qa[..., i, 1], qb[..., j, 1]) - np.maximum(qa[..., i, 0], qb[..., j, 0]),
                                    0, None)
    return nrows * ncols


EXACT_GROUP = 64  # above this many ranks the senders are not enumerated pair by pair (G^2 memory)


@lru_cache(maxsize=4096)
def exchange_volume(a: Layout, b: Layout) -> tuple[np.ndarray, np.ndarray]:
    """(sent, received) shares of the whole (batch, seq) activation per rank of the first group,
    (G,) arrays (per unit hidden width). A rank receives what its b block holds beyond its a
    block, each element once; above `EXACT_GROUP` ranks the sent volumes are not enumerated (G^2
    pairs) and the received ones stand for them (the all-to-all moves what it delivers)."""
    size = group_size(a, b)
    batch, seq = _unit(a, b)
    ra, qa = _blocks_array(a, size, batch, seq)
    rb, qb = _blocks_array(b, size, batch, seq)
    whole = batch * seq
    received = (_overlap(rb, qb, rb, qb) - _overlap(ra, qa, rb, qb)) / whole
    if size > EXACT_GROUP:
        return received, received
    moved = _overlap(ra[:, None], qa[:, None], rb[None, :], qb[None, :])  # [sender, receiver]
    r = np.arange(size)
    rep = replicas(a)
    serves = (r[:, None] % rep == r[None, :] % rep) & (r[:, None] != r[None, :])
    moved = np.where(serves, moved, 0.0) / whole
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
