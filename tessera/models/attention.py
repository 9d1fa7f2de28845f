"""Causal attention over packed documents, without a dense S x S mask.

A packed row of S tokens holds several documents back to back. `doc_ids` (B, S), integers that
never decrease along a row (0, 0, 0, 1, 1, 2, ...), says which document each token belongs to;
token q attends to token k iff doc_ids[q] == doc_ids[k] and k <= q (document-causal). That is
the dense boolean mask `document_causal_mask(doc_ids)` (B, 1, S, S), which costs S^2 bytes per
row (1 GiB at 32K tokens, 16 GiB at 128K) and keeps SDPA off its flash kernels; it is kept here
only as the reference the tests compare against.

`attend(q, k, v, docs)` picks the kernel by device:

- no documents (`docs` None, or every row one document): SDPA with `is_causal=True`
  (flash kernels on CPU and GPU);
- CUDA: `flex_attention`, compiled once per process, with a block-sparse `BlockMask` of the
  document-causal pattern (`document_block_mask`: tiles of 128 x 128 tokens, the tile map costs
  (S/128)^2 per row, never S^2). Chosen over SDPA's variable-length entry point because it takes
  the (B, H, S, D) layout as it is (no repacking to (total_tokens, H, D)), does grouped-query
  attention natively (`enable_gqa`), exists from torch 2.5 on, and its forward and block mask
  run on CPU, so their exactness is tested without a GPU;
- anything else (CPU): documents grouped by length (`DocumentBuckets`): each document is padded at
  its end to its bucket's length (at most 4 lengths per octave, so padding < 25%), the documents of
  a bucket run as one batch of causal SDPA (CPU flash kernel), and the outputs are gathered back
  to token order. Memory is linear in S. Exact: padding sits after a document's last token, so
  causality hides it from every real query; padded queries are dropped, so padded keys and values
  get zero gradient.

A `Documents` object wraps `doc_ids` and builds what the kernel needs (block mask or buckets)
once; the model builds it once per forward and every layer shares it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FLEX_BLOCK = 128  # tile size of flex_attention's block-sparse mask (tokens)

_compiled_flex = None


def compiled_flex_attention():
    """`torch.compile(flex_attention)`, created once per process (first use: the compile wrapper
    itself costs seconds of imports, so it is not built at import time)."""
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Dense reference: (B, 1, S, S) boolean, True = attend (same document, not in the future).
    Quadratic in S: for tests and small examples only."""
    s = doc_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril()
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]


def check_doc_ids(doc_ids: torch.Tensor) -> None:
    """Refuse ids that are not (B, S) integers non-decreasing along each row (contiguous documents)."""
    if doc_ids.dim() != 2 or doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool:
        raise ValueError(f"doc_ids must be a (batch, seq) integer tensor, got {tuple(doc_ids.shape)} {doc_ids.dtype}")
    if doc_ids.shape[1] > 1 and bool((doc_ids[:, 1:] < doc_ids[:, :-1]).any()):
        raise ValueError("doc_ids must not decrease along a row (each document's tokens are contiguous)")


@dataclass
class DocumentBuckets:
    """Documents of a batch grouped by padded length, for the length-bucketed SDPA path.

    `index[i]` (n_i, L_i): flat token indices (row * S + column) of the n_i documents of bucket i,
    each padded to L_i by repeating its last token. `inverse` (B*S,): where token t's output sits
    in the concatenation of all buckets' (n_i * L_i) outputs.
    """

    index: list[torch.Tensor]
    inverse: torch.Tensor
    num_docs: int

    @staticmethod
    def padded_length(n: int) -> int:
        """n rounded up to the next of 4 lengths per octave: 2^k * (1, 1.25, 1.5, 1.75); exact below 8."""
        step = 1 << max(0, n.bit_length() - 3)
        return -(-n // step) * step

    @classmethod
    def build(cls, doc_ids: torch.Tensor) -> "DocumentBuckets":
        ids = doc_ids.detach().to("cpu", torch.int64)
        b, s = ids.shape
        starts = torch.ones(b, s, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        first = starts.flatten().nonzero().squeeze(1)  # flat index of each document's first token
        lengths = torch.diff(first, append=torch.tensor([b * s]))
        padded = torch.tensor([cls.padded_length(n) for n in lengths.tolist()])
        doc_of_token = torch.cumsum(starts.flatten(), 0) - 1
        index, base = [], torch.empty_like(first)
        offset = 0
        for length in torch.unique(padded).tolist():
            docs = (padded == length).nonzero().squeeze(1)
            steps = torch.arange(length)
            index.append(first[docs, None] + torch.minimum(steps[None], lengths[docs, None] - 1))
            base[docs] = offset + length * torch.arange(docs.numel())
            offset += docs.numel() * length
        inverse = base[doc_of_token] + (torch.arange(b * s) - first[doc_of_token])
        dev = doc_ids.device
        return cls([i.to(dev) for i in index], inverse.to(dev), int(first.numel()))


class Documents:
    """Packed documents of a batch (`doc_ids` (B, S), see the module docstring) and the attention
    structures derived from them, each built once and shared by every layer and micro-step.

    `backend`: None picks by device (CUDA: "flex", otherwise "buckets"); "flex", "buckets" or
    "dense" (the quadratic reference) force one.
    """

    BACKENDS = ("flex", "buckets", "dense")

    def __init__(self, doc_ids: torch.Tensor, backend: str | None = None):
        check_doc_ids(doc_ids)
        if backend is not None and backend not in self.BACKENDS:
            raise ValueError(f"unknown document attention backend {backend!r}; choose from {', '.join(self.BACKENDS)}")
        self.doc_ids = doc_ids
        self.backend = backend or ("flex" if doc_ids.device.type == "cuda" else "buckets")
        self._buckets: DocumentBuckets | None = None
        self._block_mask = None
        self._dense: torch.Tensor | None = None

    @classmethod
    def of(cls, docs: "Documents | torch.Tensor | None") -> "Documents | None":
        if docs is None or isinstance(docs, Documents):
            return docs
        return cls(docs)

    def prepare(self) -> "Documents":
        """Build the structure the backend needs now (outside any compiled region)."""
        if self.backend == "buckets":
            self.buckets()
        elif self.backend == "flex":
            self.block_mask()
        return self

    def buckets(self) -> DocumentBuckets:
        if self._buckets is None:
            self._buckets = DocumentBuckets.build(self.doc_ids)
        return self._buckets

    def block_mask(self):
        if self._block_mask is None:
            self._block_mask = document_block_mask(self.doc_ids)
        return self._block_mask

    def dense_mask(self) -> torch.Tensor:
        if self._dense is None:
            self._dense = document_causal_mask(self.doc_ids)
        return self._dense

    @property
    def shape(self) -> torch.Size:
        return self.doc_ids.shape


def document_block_mask(doc_ids: torch.Tensor, block: int = FLEX_BLOCK):
    """flex_attention `BlockMask` of the document-causal pattern of `doc_ids` (B, S), built from
    per-tile document ranges without materialising the S x S mask.

    Tiles are `block` x `block` tokens, n = ceil(S / block) per side. With ids non-decreasing,
    query tile i and key tile j < i share a document iff max id of tile j == min id of tile i;
    the diagonal tile always does (partial: causal inside). A tile is full (no mask_mod needed)
    when j < i and both tiles lie in one document, and the query tile has no padding. The result
    equals `create_block_mask(mask_mod, B, None, S, S, BLOCK_SIZE=block)` (tested), whose eager
    form would build the (B, S, S) mask first.
    """
    from torch.nn.attention.flex_attention import BlockMask

    b, s = doc_ids.shape
    n = -(-s // block)
    pad = n * block - s
    # Pad with the row's last id: padded keys lie after every real query, so causality hides them.
    ids = torch.cat([doc_ids, doc_ids[:, -1:].expand(b, pad)], dim=1) if pad else doc_ids
    tiles = ids.view(b, n, block)
    lo, hi = tiles.amin(-1), tiles.amax(-1)  # (B, n)
    q_tile = torch.arange(n, device=ids.device)
    below = q_tile[None, :] < q_tile[:, None]  # [i, j]: key tile j before query tile i
    shared = below[None] & (hi[:, None, :] == lo[:, :, None])
    one_doc = lo == hi
    real_q = torch.ones(n, dtype=torch.bool, device=ids.device)
    real_q[-1] = pad == 0
    full = shared & one_doc[:, None, :] & (one_doc & real_q)[:, :, None]
    partial = (shared & ~full) | torch.eye(n, dtype=torch.bool, device=ids.device)[None]

    def ordered(dense: torch.Tensor):
        dense = dense[:, None].to(torch.int32)  # (B, 1, n, n): one mask for every head
        return (dense.sum(-1).to(torch.int32),
                torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32))

    def document_causal(batch, head, q_idx, kv_idx):
        return (ids[batch, q_idx] == ids[batch, kv_idx]) & (q_idx >= kv_idx)

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(block, block),
                                    mask_mod=document_causal, seq_lengths=(s, s))


def _bucketed_attention(q, k, v, buckets: DocumentBuckets, gqa: bool) -> torch.Tensor:
    b, h, s, d = q.shape
    # (B, H, S, D) -> (B*S, H, D): a view when the heads came from a (B, S, H, D) projection.
    flat = [t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (q, k, v)]
    outs = []
    for index in buckets.index:
        n, length = index.shape
        qb, kb, vb = (t.index_select(0, index.flatten()).view(n, length, -1, d).transpose(1, 2) for t in flat)
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=gqa)
        outs.append(out.transpose(1, 2).reshape(n * length, h, d))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out.index_select(0, buckets.inverse).view(b, s, h, d).transpose(1, 2)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           docs: Documents | torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
    """Document-causal attention on (B, H, S, D) queries and (B, Hkv, S, D) keys/values
    (Hkv divides H: grouped-query attention); plain causal when `docs` is None. See the module
    docstring for the kernel chosen. `causal=False`: every token sees every token of its row
    (a vision encoder's patches; no documents)."""
    gqa = q.shape[1] != k.shape[1]
    if not causal:
        if docs is not None:
            raise ValueError("bidirectional attention takes no doc_ids (one image or sequence per row)")
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    docs = Documents.of(docs)
    if docs is not None and tuple(docs.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(f"doc_ids {tuple(docs.shape)} do not match the attention's (batch, seq) "
                         f"{(q.shape[0], q.shape[2])}")
    if docs is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if docs.backend == "dense":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=docs.dense_mask(), enable_gqa=gqa)
    if docs.backend == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        kernel = compiled_flex_attention() if q.device.type == "cuda" else flex_attention
        return kernel(q, k, v, block_mask=docs.block_mask(), enable_gqa=gqa)
    buckets = docs.buckets()
    if buckets.num_docs == q.shape[0]:  # one document per row: plain causal rows
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return _bucketed_attention(q, k, v, buckets, gqa)
