"""A tied weight held twice in two layouts: its gradient summed shard to shard.

An LM head tied to the embedding shares the embedding's weight when both layers have one
parameter layout on one pipeline rank (the search always gives them one). Otherwise (a plan
made by hand, or the head on another pipeline stage in another layout) the head holds its own
copy of the (V x h) table, and after backward each copy needs g = g_embedding + g_head on its
own rows, so that both take the same optimizer step and stay equal.

Where a rank's rows are: tensor parallelism splits the table's rows into tp blocks (torch.chunk:
ceil(V / tp) rows each, the last shorter), FSDP2 splits a tp block into S pieces (S the ZeRO shard
degree, ceil(rows / S) rows each, the last ones shorter or empty). So each rank holds one
contiguous block of rows of each copy it has, and the replicas of a block (the dp x cp x ulysses
ranks outside the shard group) hold equal gradients once the ZeRO sync is done.

The exchange, one all-to-all over the ranks that hold either copy: rank q receives, for every
copy A it holds and every other copy B, B's rows of its A block, each piece from one holder of
it (of B's n replicas of the block, the one at position q mod n, which spreads the sends), and
adds them to its own. A rank sends the pieces it is the chosen holder of; it takes part when it
sends nothing. Bytes: what a rank sends, rows x h x the gradient bytes (4: fp32), about one
shard of the table per copy it holds, where gathering whole gradients moves the whole table.

Pure arithmetic, no torch: the runtime (`runtime/tied_sync.py`) builds its all-to-all from it and
the cost model (`cost/collectives.py`) prices the same bytes.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from ..plan import LayerStrategy


def chunk_rows(n: int, pieces: int, i: int) -> tuple[int, int]:
    """Rows [start, stop) of piece i when torch.chunk cuts n rows into `pieces`."""
    size = -(-n // pieces)
    start = min(i * size, n)
    return start, min(start + size, n)


@dataclass(frozen=True)
class TableShards:
    """Which rows of a (V x h) vocabulary table each rank of a pipeline stage holds (the stage's
    first global rank and size) under a layer's parameter layout: one copy of a tied table, or
    any embedding or LM head table (`evaluate.rank_states`)."""

    base: int
    size: int
    dp: int
    cp: int
    sp: int
    tp: int
    shard: int  # ZeRO shard degree (1 without ZeRO)
    _cache: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    @classmethod
    def of(cls, s: LayerStrategy, base: int, size: int) -> "TableShards":
        return cls(base, size, s.dp, s.cp, s.sp_degree, s.tp, s.shard_degree)

    @property
    def ranks(self) -> range:
        return range(self.base, self.base + self.size)

    @cached_property
    def coordinates(self) -> np.ndarray:
        """(tp index, shard index) of each rank of the stage, as `runtime/mesh.py`'s layer mesh
        places them: ranks (d, c, u, t) with d = d_rep * shard_dp + d_shard; the shard axis runs
        over (d_shard, c) under ZeRO, else over nothing."""
        cp = self.cp
        shard_cp = cp if self.shard % cp == 0 and self.shard > 1 else 1
        shard_dp = self.shard // shard_cp
        ranks = np.arange(self.size).reshape(self.dp // shard_dp, shard_dp, cp, self.sp, self.tp)
        if shard_cp > 1:
            ranks = ranks.transpose(0, 3, 1, 2, 4)
        else:
            ranks = ranks.transpose(0, 2, 3, 1, 4)
        ranks = ranks.reshape(-1, self.shard, self.tp)
        out = np.zeros((self.size, 2), dtype=np.int64)
        _, k, t = np.meshgrid(np.arange(ranks.shape[0]), np.arange(self.shard), np.arange(self.tp), indexing="ij")
        out[ranks.ravel(), 0] = t.ravel()
        out[ranks.ravel(), 1] = k.ravel()
        return out

    def block(self, t: int, k: int, vocab: int) -> tuple[int, int]:
        """Rows of tp index t, shard index k."""
        start, stop = chunk_rows(vocab, self.tp, t)
        a, b = chunk_rows(stop - start, self.shard, k)
        return start + a, start + b

    def rows(self, rank: int, vocab: int) -> tuple[int, int]:
        """Rows [start, stop) of the table that global `rank` (of this copy's stage) holds."""
        t, k = self.coordinates[rank - self.base]
        return self.block(int(t), int(k), vocab)

    def holders(self, vocab: int) -> tuple[list[int], list[tuple[int, int]], list[list[int]]]:
        """The distinct non-empty blocks sorted by start: (starts, [(start, stop)], [holders])."""
        key = ("holders", vocab)
        if key not in self._cache:
            by_block: dict[tuple[int, int], list[int]] = {}
            for i, (t, k) in enumerate(self.coordinates):
                by_block.setdefault((int(t), int(k)), []).append(self.base + i)
            blocks = sorted((self.block(t, k, vocab), ranks) for (t, k), ranks in by_block.items())
            blocks = [(b, r) for b, r in blocks if b[1] > b[0]]
            self._cache[key] = ([b[0] for b, _ in blocks], [b for b, _ in blocks], [r for _, r in blocks])
        return self._cache[key]

    def pieces(self, rows: tuple[int, int], dest: int, vocab: int) -> list[tuple[int, int, int]]:
        """(holder, start, stop): this copy's rows of `rows`, each from the holder that serves `dest`."""
        starts, blocks, holders = self.holders(vocab)
        out = []
        i = max(0, bisect_right(starts, rows[0]) - 1)
        while i < len(blocks) and blocks[i][0] < rows[1]:
            a, b = max(blocks[i][0], rows[0]), min(blocks[i][1], rows[1])
            if b > a:
                out.append((holders[i][dest % len(holders[i])], a, b))
            i += 1
        return out


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of copy `source_copy`'s gradient, added to copy `dest_copy`'s."""

    peer: int  # the other rank: the destination of a send, the source of a receive
    dest_copy: int
    source_copy: int
    start: int
    stop: int


def exchange(copies: list[TableShards], vocab: int, rank: int) -> tuple[list[Piece], list[Piece]]:
    """(sends, receives) of `rank` in the exchange of the module docstring; each list is in the
    order both ends pack it: by peer, then destination copy, source copy and first row."""
    held = [i for i, c in enumerate(copies) if rank in c.ranks]
    receives = []
    for a in held:
        rows = copies[a].rows(rank, vocab)
        for b, other in enumerate(copies):
            if b != a:
                receives += [Piece(src, a, b, s, e) for src, s, e in other.pieces(rows, rank, vocab)]
    sends = []
    for b in held:
        mine = copies[b].rows(rank, vocab)
        if mine[1] <= mine[0]:
            continue
        for a, dest_copy in enumerate(copies):
            if a == b:
                continue
            for q in dest_copy.ranks:
                rows = dest_copy.rows(q, vocab)
                s, e = max(rows[0], mine[0]), min(rows[1], mine[1])
                if e > s and any(h == rank for h, _, _ in copies[b].pieces((s, e), q, vocab)):
                    sends.append(Piece(q, a, b, s, e))
    key = lambda p: (p.peer, p.dest_copy, p.source_copy, p.start)  # noqa: E731
    return sorted(sends, key=key), sorted(receives, key=key)


def group_ranks(copies: list[TableShards]) -> list[int]:
    """The global ranks of the exchange's all-to-all, in order."""
    return sorted({r for c in copies for r in c.ranks})


def sent_rows(copies: list[TableShards], vocab: int, rank: int) -> int:
    """Rows of the table `rank` sends in the exchange (bytes: rows x h x gradient bytes)."""
    return sum(p.stop - p.start for p in exchange(copies, vocab, rank)[0])


def tied_copies(plan) -> list[TableShards] | None:
    """The two copies of a plan whose LM head holds its own copy of the tied embedding in another
    layout (None: the weight is shared, or held alike on two stages and summed by an all-reduce
    of the two shards, or not tied at all)."""
    cfg = plan.model.config
    if cfg is None or not cfg.tie_embeddings or not plan.model.layers[-1].tied_params:
        return None
    first, last = plan.layers[0], plan.layers[-1]
    if same_parameter_layout(first, last):
        return None
    pipe = plan.pipeline
    n = plan.stage_size
    return [TableShards.of(first, pipe.rank_of_chunk(0) * n, n),
            TableShards.of(last, pipe.rank_of_chunk(len(pipe.stages) - 1) * n, n)]


def same_parameter_layout(a: LayerStrategy, b: LayerStrategy) -> bool:
    """The runtime's `LayerLayout.of(a) == LayerLayout.of(b)` without torch."""
    return (a.dp, a.sp_degree, a.tp, a.shard_degree, a.cp) == (b.dp, b.sp_degree, b.tp, b.shard_degree, b.cp)
