"""Sum a tied weight's gradient across its two copies in two layouts, shard to shard.

`cost/tied.py` says which rows each rank holds of each copy and which pieces it sends and
receives; this runs that exchange as one `all_to_all_single` of the local gradient shards (fp32)
and adds what arrives. Every rank of the exchange group calls it, also one that moves nothing.

Each copy ends with g_embedding + g_head on its rows: the same two addends in another order
(IEEE addition commutes), so the copies stay bit-identical through their optimizer steps.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..cost.tied import TableShards, exchange


@torch.no_grad()
def exchange_tied_gradients(grads: dict[int, torch.Tensor], copies: list[TableShards], vocab: int, rank: int,
                            group_ranks: list[int], group=None, device: torch.device | None = None) -> None:
    """Add to each local gradient shard (`grads`: copy index -> this rank's gradient of that copy,
    a DTensor or a tensor) the other copies' gradients of its rows. `group_ranks`: the global ranks
    of `group` in order; `device`: where the all-to-all runs (offloaded gradients live on the host)."""
    local: dict[int, tuple[torch.Tensor, int]] = {}
    for i, g in grads.items():
        if g is None:
            raise RuntimeError("a tied embedding/head weight has no gradient after backward")
        t = g.to_local() if hasattr(g, "to_local") else g
        start, stop = copies[i].rows(rank, vocab)
        if t.shape[0] != stop - start:
            raise RuntimeError(f"tied copy {i} on rank {rank} holds {t.shape[0]} rows of the table, its layout "
                               f"says {stop - start}")
        local[i] = (t, start)
    first = next(iter(local.values()))[0]
    width, dtype = first.shape[1], first.dtype
    device = device if device is not None else first.device
    sends, receives = exchange(copies, vocab, rank)
    index = {r: i for i, r in enumerate(group_ranks)}
    in_splits, out_splits = [0] * len(group_ranks), [0] * len(group_ranks)
    for p in sends:
        in_splits[index[p.peer]] += (p.stop - p.start) * width
    for p in receives:
        out_splits[index[p.peer]] += (p.stop - p.start) * width
    pieces = [local[p.source_copy][0][p.start - local[p.source_copy][1]:p.stop - local[p.source_copy][1]].reshape(-1)
              for p in sends]
    send = torch.cat(pieces).to(device) if pieces else torch.empty(0, dtype=dtype, device=device)
    recv = torch.empty(sum(out_splits), dtype=dtype, device=device)
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)
    offset = 0
    for p in receives:
        n = (p.stop - p.start) * width
        t, start = local[p.dest_copy]
        t[p.start - start:p.stop - start] += recv[offset:offset + n].view(-1, width).to(t.device)
        offset += n
