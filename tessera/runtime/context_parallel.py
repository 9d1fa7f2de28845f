"""Context parallelism: ring attention over the cp ranks of a layer, exact forward and backward.

The sequence of S tokens is cut into 2 cp chunks of C = S / (2 cp) tokens; cp rank c holds the
chunks c and 2 cp - 1 - c (its "local sequence" of L = 2 C tokens, in that order: the
load-balanced causal split of Megatron-LM and torchtitan, `layout.load_balanced_ranges`). Every
layer outside attention works on the local tokens alone; attention needs every earlier token, so
the K/V blocks travel around the ring (Liu et al. 2023, "Ring Attention with Blockwise
Transformers"): at step j = 0 .. cp-1 rank c holds the K/V of rank (c - j) mod cp and attends its
queries to them, while the next block is already on its way (point-to-point send to c + 1,
receive from c - 1, posted before the step's compute so that it overlaps it).

Which query/key pairs a step computes (causal, load-balanced; the work is the same on every rank):
    j = 0          the local sequence against itself, causal in local order (local order is
                   global order restricted to the rank's tokens)
    j > 0, src < c every local query against the FIRST chunk of src's block (chunk src lies
                   before both of c's chunks; src's second chunk lies after both)
    j > 0, src > c the SECOND local chunk against src's whole block (both of src's chunks lie
                   before chunk 2cp-1-c and after chunk c)
so after step 0 every step is a full (unmasked) rectangle of L x C query-key pairs.

Packed documents (doc ids (B, S) of the full sequence, non-decreasing along a row): a query
attends a key only in the same document. Step 0 is document-causal attention over the local
sequence (documents grouped by length and run as batches of causal attention, as
`models/attention.py` does, never a dense mask); a rectangle of a later step has all its keys
before all its queries, so the only document they can share is the last document of the keys,
if it is the first of the queries: the rectangle shrinks to (queries of that document) x (keys of
that document), a prefix of the query rows and a suffix of the key rows, or is skipped.

Forward: each block gives its output O_j and log-sum-exp l_j per query row; they are merged
exactly (online softmax): l = log(sum_j e^{l_j}), O = sum_j e^{l_j - l} O_j, in fp32.
Backward (a second ring pass): with the final O and l, every block's gradients are those of the
flash-attention backward on that block (P_ij = exp(s_ij - l_i), D_i = rowsum(dO_i O_i)), so each
rank computes its queries' dQ and the dK/dV of the block it holds; the dK/dV accumulators (fp32)
travel with their blocks (sent after each step's compute, received under the next step's) and
after cp hops arrive back at the block's owner with every rank's contribution.
Messages per attention layer and micro-batch: forward cp - 1 K/V blocks (2 B Hkv L D elements),
backward cp - 1 K/V blocks and cp dK/dV blocks (fp32): K/V keep their grouped-query heads on
the wire; the heads are repeated locally for the kernel, and dK/dV summed back over each group.

Kernels (`block_forward` / `block_backward`: attention of a block with its log-sum-exp, and the
backward given the merged output and log-sum-exp): the CPU flash kernels
(`aten._scaled_dot_product_flash_attention_for_cpu` and its backward); on CUDA for fp16/bf16 the
flash kernels (`aten._scaled_dot_product_flash_attention` and its backward, as PyTorch's own
context parallelism calls them); otherwise a reference in plain tensor operations (scores
materialised per block).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..models.attention import Documents, DocumentBuckets
from .attention import heads_to_sequence, kv_repeats, sequence_to_heads
from .layout import load_balanced_ranges

aten = torch.ops.aten
KV_TAG, GRAD_TAG = 11, 12


# --- block kernels ----------------------------------------------------------------------------------


def _acc(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 for fp64 inputs (the tests' exact references)."""
    return torch.promote_types(x.dtype, torch.float32)


def _cuda_flash(q: torch.Tensor) -> bool:
    return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256)


def block_forward(q, k, v, causal: bool, scale: float):
    """(out, lse, aux) of softmax(q k^T scale) v on (N, H, Lq, D) queries and (N, H, Lk, D) keys
    and values (causal: Lq == Lk, query i sees keys <= i). lse (N, H, Lq) fp32 natural log; aux
    is what the CUDA backward wants back (None elsewhere)."""
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse.to(_acc(q)), None
    if _cuda_flash(q):
        res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1].float(), (res[2], res[3], res[6], res[7])
    return _math_forward(q, k, v, causal, scale)


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, aux=None):
    """(dq, dk, dv) of the block given the MERGED output and log-sum-exp of its query rows."""
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.to(_acc(q)), 0.0, causal, scale=scale)
    if _cuda_flash(q) and aux is not None:
        cum_q, cum_k, seed, offset = aux
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale)[:3]
    return _math_backward(dout, q, k, v, out, lse, causal, scale)


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    s = (q.to(_acc(q)) @ k.to(_acc(q)).transpose(-1, -2)) * scale
    if causal:
        lq, lk = s.shape[-2:]
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _math_forward(q, k, v, causal: bool, scale: float):
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = (torch.exp(s - lse[..., None]) @ v.to(s.dtype)).to(q.dtype)
    return out, lse, None


def _math_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    s = _scores(q, k, causal, scale)
    p = torch.exp(s - lse[..., None].to(s.dtype))
    do = dout.to(s.dtype)
    dv = p.transpose(-1, -2) @ do
    dp = do @ v.to(s.dtype).transpose(-1, -2)
    ds = p * (dp - (do * out.to(s.dtype)).sum(-1, keepdim=True))
    dq = (ds @ k.to(s.dtype)) * scale
    dk = (ds.transpose(-1, -2) @ q.to(s.dtype)) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    """K/V heads repeated for the query heads of each group (what `enable_gqa` does)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold(dx: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `_expand`: sum over the query heads that shared a K/V head."""
    if groups == 1:
        return dx
    n, h, length, d = dx.shape
    return dx.view(n, h // groups, groups, length, d).sum(2)


# --- what each ring step computes ------------------------------------------------------------------


@dataclass(frozen=True)
class Rectangle:
    """Queries [q0, q0 + nq) of the local sequence against keys [k0, k0 + nk) of the held block,
    unmasked, for the batch rows `rows` (a slice when every row has the same rectangle)."""

    rows: slice | tuple[int, ...]
    q0: int
    nq: int
    k0: int
    nk: int


@dataclass
class RingSchedule:
    """Everything a rank's ring pass needs besides the tensors, built once per (documents, layout)
    and shared by every layer, forward and backward.

    `steps[j]`: the rectangles of ring step j >= 1 (step 0 is the local causal attention);
    `buckets`: the documents of the local sequence grouped by length (None: one causal block)."""

    cp: int
    rank: int
    local_len: int
    steps: list[list[Rectangle]] = field(default_factory=list)
    buckets: DocumentBuckets | None = None
    valid: list[torch.Tensor] | None = None  # per bucket, (n, L_i): real (not padding) positions


def _document_rectangle(q_docs: torch.Tensor, k_docs: torch.Tensor) -> tuple[int, int] | None:
    """(nq, nk) of the one document keys that all precede the queries can share with them: the
    keys' last document when it is the queries' first (module docstring), else None."""
    d = int(q_docs[0])
    if int(k_docs[-1]) != d:
        return None
    return int((q_docs == d).sum()), int((k_docs == d).sum())


def ring_schedule(cp: int, rank: int, seq: int, doc_ids: torch.Tensor | None = None) -> RingSchedule:
    """The blocks rank `rank` of `cp` computes at each ring step for a sequence of `seq` tokens
    (module docstring), with packed documents when `doc_ids` (B, seq) are given."""
    ranges = [load_balanced_ranges(seq, cp, c) for c in range(cp)]
    local = seq // cp
    chunk = local // 2
    sched = RingSchedule(cp=cp, rank=rank, local_len=local, steps=[[]])
    index = None
    if doc_ids is not None:
        ids = doc_ids.detach().to("cpu", torch.int64)
        index = [torch.cat([torch.arange(a, b) for a, b in r]) for r in ranges]
        mine = ids[:, index[rank]]
        if int(torch.unique_consecutive(mine.flatten()).numel()) > mine.shape[0]:  # rows hold > 1 document
            sched.buckets = DocumentBuckets.build(mine)
            sched.valid = [torch.cat([torch.ones(i.shape[0], 1, dtype=torch.bool), i[:, 1:] != i[:, :-1]], dim=1)
                           for i in sched.buckets.index]
    for j in range(1, cp):
        src = (rank - j) % cp
        q0, nq, k0, nk = (0, local, 0, chunk) if src < rank else (chunk, chunk, 0, local)
        if index is None:
            sched.steps.append([Rectangle(slice(None), q0, nq, k0, nk)])
            continue
        q_docs = ids[:, index[rank][q0:q0 + nq]]
        k_docs = ids[:, index[src][k0:k0 + nk]]
        by_shape: dict[tuple[int, int], list[int]] = {}
        for b in range(ids.shape[0]):
            hit = _document_rectangle(q_docs[b], k_docs[b])
            if hit is not None:
                by_shape.setdefault(hit, []).append(b)
        rects = []
        for (n_q, n_k), rows in by_shape.items():
            sel = slice(None) if len(rows) == ids.shape[0] else tuple(rows)
            rects.append(Rectangle(sel, q0, n_q, k0 + nk - n_k, n_k))
        sched.steps.append(rects)
    return sched


def _rows(x: torch.Tensor, rows) -> torch.Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, torch.tensor(rows, device=x.device))


# --- step 0: causal (or document-causal) attention over the local sequence -------------------------------


def _flat(x: torch.Tensor) -> torch.Tensor:
    """(B, H, L, ...) -> (B * L, H, ...)."""
    return x.transpose(1, 2).reshape(x.shape[0] * x.shape[2], x.shape[1], *x.shape[3:])


def _unflat(x: torch.Tensor, b: int) -> torch.Tensor:
    """(B * L, H, ...) -> (B, H, L, ...)."""
    return x.reshape(b, -1, *x.shape[1:]).transpose(1, 2)


def _gather(flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Bucket layout (n, H, L_i, ...) of the tokens `index` (n, L_i) of a flat (B * L, H, ...)."""
    n, length = index.shape
    return flat.index_select(0, index.flatten()).view(n, length, *flat.shape[1:]).transpose(1, 2)


def local_forward(q, k, v, sched: RingSchedule, scale: float):
    """(out, lse, aux) of the local step: one causal block, or the documents' buckets."""
    if sched.buckets is None:
        return block_forward(q, k, v, True, scale)
    b = q.shape[0]
    fq, fk, fv = (_flat(t) for t in (q, k, v))
    outs, lses = [], []
    for index in sched.buckets.index:
        o, lse, _ = block_forward(_gather(fq, index), _gather(fk, index), _gather(fv, index), True, scale)
        outs.append(_flat(o))
        lses.append(_flat(lse))
    out = torch.cat(outs).index_select(0, sched.buckets.inverse.to(q.device))
    lse = torch.cat(lses).index_select(0, sched.buckets.inverse.to(q.device))
    return _unflat(out, b), _unflat(lse, b), None


def local_backward(dout, q, k, v, out, lse, sched: RingSchedule, scale: float, aux=None):
    if sched.buckets is None:
        return block_backward(dout, q, k, v, out, lse, True, scale, aux)
    b = q.shape[0]
    flat = [_flat(t) for t in (dout, q, k, v, out, lse)]
    grads = [torch.zeros_like(flat[i]) for i in (1, 2, 3)]
    for index, valid in zip(sched.buckets.index, sched.valid):
        do, qb, kb, vb, ob, lb = (_gather(t, index) for t in flat)
        do = do * valid.to(do.device)[:, None, :, None]  # padded queries contribute nothing
        for acc, g in zip(grads, block_backward(do, qb, kb, vb, ob, lb.contiguous(), True, scale)):
            acc.index_add_(0, index.flatten(), _flat(g).to(acc.dtype))
    return tuple(_unflat(g, b) for g in grads)


# --- the ring ----------------------------------------------------------------------------------------


def _merge(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
           rows, q0: int, nq: int) -> None:
    """Online-softmax merge of a block's (out, lse) into the fp32 accumulators, in place."""
    if isinstance(rows, slice):
        ao, al = acc_out[:, :, q0:q0 + nq], acc_lse[:, :, q0:q0 + nq]
        new = torch.logaddexp(al, lse)
        ao.mul_(torch.exp(al - new)[..., None]).add_(out.to(ao.dtype) * torch.exp(lse - new)[..., None])
        al.copy_(new)
        return
    for i, b in enumerate(rows):
        ao, al = acc_out[b, :, q0:q0 + nq], acc_lse[b, :, q0:q0 + nq]
        new = torch.logaddexp(al, lse[i])
        ao.mul_(torch.exp(al - new)[..., None]).add_(out[i].to(ao.dtype) * torch.exp(lse[i] - new)[..., None])
        al.copy_(new)


class _Ring:
    """Point-to-point exchange with the ring neighbours of a process group (send to c + 1,
    receive from c - 1), asynchronous: `start` posts it, `wait` returns the received tensor."""

    def __init__(self, group, cp: int, rank: int):
        self.group = group
        self.next = dist.get_global_rank(group, (rank + 1) % cp)
        self.prev = dist.get_global_rank(group, (rank - 1) % cp)

    def start(self, send: torch.Tensor, tag: int):
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return dist.batch_isend_irecv(ops), recv

    @staticmethod
    def wait(pending) -> torch.Tensor:
        works, recv = pending
        for w in works:
            w.wait()
        return recv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, sched: RingSchedule, scale: float):
        ring = _Ring(group, sched.cp, sched.rank)
        groups = q.shape[1] // k.shape[1]
        held = torch.stack([k, v]).contiguous()  # K and V travel together, with their own heads
        pending = ring.start(held, KV_TAG) if sched.cp > 1 else None  # travels under step 0
        out, lse, aux = local_forward(q, _expand(k, groups), _expand(v, groups), sched, scale)
        acc_out, acc_lse = out.to(_acc(q)), lse.to(_acc(q)).clone()
        for j in range(1, sched.cp):
            held = ring.wait(pending)
            if j + 1 < sched.cp:
                pending = ring.start(held, KV_TAG)  # the next block travels under this step
            for r in sched.steps[j]:
                kb = _expand(_rows(held[0], r.rows)[:, :, r.k0:r.k0 + r.nk], groups)
                vb = _expand(_rows(held[1], r.rows)[:, :, r.k0:r.k0 + r.nk], groups)
                o, lse_j, _ = block_forward(_rows(q, r.rows)[:, :, r.q0:r.q0 + r.nq].contiguous(),
                                            kb.contiguous(), vb.contiguous(), False, scale)
                _merge(acc_out, acc_lse, o, lse_j, r.rows, r.q0, r.nq)
        out = acc_out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc_lse)
        ctx.group, ctx.sched, ctx.scale, ctx.aux = group, sched, scale, aux
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        sched, scale = ctx.sched, ctx.scale
        ring = _Ring(ctx.group, sched.cp, sched.rank)
        groups = q.shape[1] // k.shape[1]
        dout = dout.contiguous()
        held = torch.stack([k, v]).contiguous()
        pending_kv = ring.start(held, KV_TAG) if sched.cp > 1 else None
        dq, dk, dv = local_backward(dout, q, _expand(k, groups), _expand(v, groups), out, lse, sched, scale, ctx.aux)
        acc = _acc(q)
        dq = dq.to(acc)
        grad = torch.stack([_fold(dk.to(acc), groups), _fold(dv.to(acc), groups)])
        pending_grad = ring.start(grad, GRAD_TAG)
        for j in range(1, sched.cp):
            held = ring.wait(pending_kv)
            if j + 1 < sched.cp:
                pending_kv = ring.start(held, KV_TAG)
            mine = torch.zeros_like(grad)
            for r in sched.steps[j]:
                kb = _expand(_rows(held[0], r.rows)[:, :, r.k0:r.k0 + r.nk], groups).contiguous()
                vb = _expand(_rows(held[1], r.rows)[:, :, r.k0:r.k0 + r.nk], groups).contiguous()
                sl = (lambda t: _rows(t, r.rows)[:, :, r.q0:r.q0 + r.nq].contiguous())  # noqa: E731
                gq, gk, gv = block_backward(sl(dout), sl(q), kb, vb, sl(out), sl(lse), False, scale)
                _add_rows(dq, gq.to(acc), r.rows, r.q0, r.nq)
                _add_rows(mine[0], _fold(gk.to(acc), groups), r.rows, r.k0, r.nk)
                _add_rows(mine[1], _fold(gv.to(acc), groups), r.rows, r.k0, r.nk)
            grad = ring.wait(pending_grad) + mine  # the accumulator of the block held now
            pending_grad = ring.start(grad, GRAD_TAG)
        grad = ring.wait(pending_grad)  # after cp hops: this rank's own block, every rank's share
        return dq.to(q.dtype), grad[0].to(k.dtype), grad[1].to(v.dtype), None, None, None


def _add_rows(acc: torch.Tensor, x: torch.Tensor, rows, start: int, length: int) -> None:
    if isinstance(rows, slice):
        acc[:, :, start:start + length] += x
        return
    for i, b in enumerate(rows):
        acc[b, :, start:start + length] += x[i]


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, sched: RingSchedule,
                   scale: float | None = None) -> torch.Tensor:
    """Causal (document-causal) attention of this rank's local queries (B, H, L, D) on the whole
    sequence, whose K/V (B, Hkv, L, D) are spread over the cp ranks of `group` (module
    docstring); `sched` from `ring_schedule`."""
    if q.shape[2] != sched.local_len:
        raise ValueError(f"ring attention expects {sched.local_len} local tokens, got {q.shape[2]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{k.shape[1]} key/value heads do not group the {q.shape[1]} query heads")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), group, sched, scale)


class ContextParallelAttention(nn.Module):
    """Drop-in replacement of `tessera.models.transformer.CoreAttention` for a layer whose
    sequence is split over the `cp_group` ranks (and, inside each, over a Ulysses group).

    forward(q, k, v, docs=None): q (B, H, L', D) and k, v (B, Hkv, L', D) hold this rank's block
    of the sequence (its cp rank's local sequence, split `sp` ways by Ulysses); `docs` is None
    (causal) or the documents of the FULL sequence (doc ids (B, S) or a `Documents`, shared by every
    layer, which caches the ring schedule built from them). Ulysses first trades the sequence
    split for a head split inside the cp rank (runtime/attention.py), then the ring runs over the
    cp ranks on H / sp heads, then Ulysses trades back. Returns (B, H, L', D).
    """

    def __init__(self, cp_group, sp_group=None):
        super().__init__()
        self.cp_group = cp_group
        self.sp_group = sp_group
        self._plain: dict = {}

    def forward(self, q, k, v, docs: Documents | torch.Tensor | None = None) -> torch.Tensor:
        sp = dist.get_world_size(self.sp_group) if self.sp_group is not None else 1
        if sp > 1:
            repeats = kv_repeats(q.shape[1], k.shape[1], sp)
            if repeats > 1:
                k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
            q, k, v = (sequence_to_heads(t, self.sp_group, sp) for t in (q, k, v))
        out = ring_attention(q, k, v, self.cp_group, self.schedule(q.shape[2], docs))
        return heads_to_sequence(out, self.sp_group, sp) if sp > 1 else out

    def schedule(self, local_len: int, docs) -> RingSchedule:
        cp, rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        seq = local_len * cp
        if docs is None:
            key = (cp, rank, seq)
            if key not in self._plain:
                self._plain[key] = ring_schedule(cp, rank, seq)
            return self._plain[key]
        docs = Documents.of(docs)
        if docs.shape[-1] != seq:
            raise ValueError(f"context-parallel attention needs the doc ids of the full sequence of {seq} "
                             f"tokens, got ids of {docs.shape[-1]}")
        cache = docs.__dict__.setdefault("_ring_schedules", {})  # one per layout, shared by the layers
        key = (cp, rank, seq)
        if key not in cache:
            cache[key] = ring_schedule(cp, rank, seq, docs.doc_ids)
        return cache[key]
