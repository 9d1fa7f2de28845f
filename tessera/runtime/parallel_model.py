"""The plan-aware model: a Transformer chunk that places every layer's input as its strategy says.

`ParallelTransformer` keeps the submodules (and state-dict names) of `tessera.models.Transformer`
and replaces its forward: each rank receives its block of the batch in the plan's data layout
(the batch split over the gcd of the layers' dp), every layer takes its own (batch, sequence)
block of that (`StageContext.data_block`), and activations move between layers whose layouts
differ with `layout.reshard`. `ParallelLoss` is the cross-entropy of the LM head's block, with
loss parallelism when the head is tensor-parallel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..models.attention import Documents
from ..models.transformer import Transformer
from ..plan import Plan
from .layout import ActLayout, reshard, reshard_sizes, take_block
from .mesh import ParallelDims


def data_parallel_size(plan: Plan) -> int:
    """How many blocks the batch is loaded in: the gcd of the layers' dp, so that every layer's
    batch block on a rank lies inside the block that rank loads (dp 2 and 3 load it whole)."""
    return math.gcd(*(s.dp for s in plan.layers))


@dataclass
class StageContext:
    """What a chunk needs to place data: its layer strategies, its rank and its stage group."""

    plan: Plan
    stage_rank: int
    groups: dict  # re-sharding group size -> this rank's process group (`layout.reshard`)
    data_layout: ActLayout  # the block of the batch each rank loads (`data_parallel_size`)
    layer_acts: list[ActLayout] = field(default_factory=list)

    @classmethod
    def build(cls, plan: Plan, dims: ParallelDims, rank: int) -> "StageContext":
        data_dp = data_parallel_size(plan)
        data = ActLayout(dp=data_dp, sp=1, tp=plan.stage_size // data_dp)
        acts = [ActLayout.of(s) for s in plan.layers]
        groups = {size: dims.reshard_group(size) for size in reshard_sizes(acts)}
        return cls(plan=plan, stage_rank=dims.stage_rank(rank), groups=groups,
                   data_layout=data, layer_acts=acts)

    def data_block(self, x: torch.Tensor | None, want: ActLayout, with_seq: bool = True):
        """This rank's `want` block of a per-rank data tensor (tokens, positions, labels, doc ids).
        `with_seq=False` keeps the whole sequence (doc ids for attention over the full sequence)."""
        if x is None:
            return None
        batch = x.shape[0] * self.data_layout.dp
        seq = x.shape[1] if with_seq else x.shape[-1]
        return take_block(x, self.data_layout, want, self.stage_rank, batch, seq,
                          seq_dim=1 if with_seq else None)


def _seq_only(act: ActLayout) -> ActLayout:
    """Same batch, context-parallel and Ulysses blocks, full sequence across tp (attention gathers
    over tp first)."""
    return ActLayout(dp=act.dp, sp=act.sp, tp=act.tp, seq_over_tp=False, cp=act.cp)


class ParallelTransformer(nn.Module):
    """A chunk of a Transformer (plan layers [start, end)) executing the plan's layouts.

    Keeps the submodule names of `Transformer` (state dicts match a single-device model).
    `forward(x, positions=None, doc_ids=None)`: `x` is this rank's block of tokens (B_d, S) in the
    plan's data layout when the chunk holds the embedding, otherwise the activation in the
    layout of layer `start - 1`; positions and doc ids (B_d, S) are in the data layout. Each
    layer's attention gets the doc ids of its batch rows over the FULL sequence (Ulysses attends
    over all of it), wrapped once per layout and forward in a `Documents` that every layer of that
    layout shares (its block mask or length buckets are built once). Returns the logits (a
    vocabulary-sharded DTensor under tensor parallelism) when the chunk holds the LM head, else the
    activation in the layout of layer `end - 1`.
    """

    def __init__(self, model: Transformer, ctx: StageContext, layers: range):
        super().__init__()
        self.config = model.config
        self.ctx = ctx
        self.start, self.end = layers.start, layers.stop
        num_plan_layers = len(ctx.plan.layers)
        self.has_embedding = self.start == 0
        self.has_head = self.end == num_plan_layers
        # Absent modules are None, as in a pipeline chunk of `Transformer`.
        self.tok_embeddings = model.tok_embeddings if self.has_embedding else None
        self.pos_embeddings = getattr(model, "pos_embeddings", None) if self.has_embedding else None
        self.layers = nn.ModuleDict({str(i - 1): model.layers[str(i - 1)]
                                     for i in range(max(self.start, 1), min(self.end, num_plan_layers - 1))})
        self.norm = model.norm if self.has_head else None
        self.output = model.output if self.has_head else None
        if self.config.position != "learned":
            self.register_buffer("freqs", model.freqs, persistent=False)
        self.placement = None  # NetMoE per-layer placement (runtime/moe_placement.py): rows move in MoE blocks

    def _positions(self, positions, act: ActLayout, seq: int, device) -> torch.Tensor:
        """Position ids of this rank's (batch, seq) block, shape (B_l, S_l) or (S_l,)."""
        act = _seq_only(act)
        if positions is not None:
            return self.ctx.data_block(positions, act)
        return act.seq_index(self.ctx.stage_rank, seq, device)

    def _freqs(self, positions, act: ActLayout, seq: int, device, cache: dict) -> torch.Tensor:
        """RoPE rotations of this rank's block, computed once per layout and forward."""
        key = _seq_only(act)
        if key not in cache:
            ranges = key.seq_ranges(self.ctx.stage_rank, seq)
            if positions is None and len(ranges) == 1:  # a slice of the table, no copy
                cache[key] = self.freqs[ranges[0][0]:ranges[0][1]]
            else:
                cache[key] = self.freqs[self._positions(positions, act, seq, device)]
        return cache[key]

    def _documents(self, doc_ids, act: ActLayout, cache: dict) -> Documents | None:
        """The packed documents of this rank's batch rows (full sequence), once per layout and forward."""
        if doc_ids is None:
            return None
        key = ("docs", ActLayout(dp=act.dp, sp=1, tp=1))  # the rows depend on the batch split only
        if key not in cache:
            rows = self.ctx.data_block(doc_ids, _seq_only(act), with_seq=False)
            cache[key] = Documents(rows).prepare()
        return cache[key]

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        ctx, acts, cache = self.ctx, self.ctx.layer_acts, {}
        seq = x.shape[1] * (1 if self.has_embedding else acts[self.start - 1].seq_parts)
        if self.has_embedding:
            act = acts[0]
            # The whole sequence block over tp: a vocabulary-parallel embedding reduces (or, with
            # sequence parallelism, reduce-scatters) the tp ranks' partial rows itself.
            tokens = ctx.data_block(x, _seq_only(act))
            pos = (self.pos_embeddings(self._positions(positions, act, seq, tokens.device))
                   if self.pos_embeddings is not None else None)
            if ctx.plan.layers[0].tp > 1:
                h = self.tok_embeddings(tokens, pos)
            else:
                h = self.tok_embeddings(tokens)
                h = h if pos is None else h + pos
            prev = act
        else:
            h, prev = x, acts[self.start - 1]
        for key, block in self.layers.items():
            act = acts[int(key) + 1]
            h = reshard(h, prev, act, ctx.stage_rank, ctx.groups)
            freqs = self._freqs(positions, act, seq, h.device, cache) if self.config.position != "learned" else None
            h = block(h, freqs, self._documents(doc_ids, act, cache))
            prev = act
            if self.placement is not None:  # the block moved samples: later layers read their rows
                positions, doc_ids, moved = self.placement.after_block(int(key), positions, doc_ids)
                cache = {} if moved else cache
        if not self.has_head:
            return h
        h = reshard(h, prev, acts[-1], ctx.stage_rank, ctx.groups)
        return self.output(self.norm(h))


class ParallelLoss:
    """Mean cross-entropy of this rank's piece of the LM head's layout (loss parallel under TP).

    Called as `loss(logits, labels)` with labels (B_d, S) in the data layout; the caller runs
    forward and backward inside `context()` (loss parallel needs both under it). When the
    sequence was padded to split evenly (`pad_sequences`: padded labels are `IGNORE`),
    `real_seq_len` is the unpadded length and each piece divides its sum by the real tokens of an
    even share, rows * real_seq_len / pieces, so that the pieces' mean is the batch mean.
    """

    def __init__(self, ctx: StageContext):
        self.ctx = ctx
        head = ctx.plan.layers[-1]
        self.vocab_parallel = head.tp > 1
        self.act = _seq_only(ctx.layer_acts[-1])
        self.pieces = head.dp * head.cp * head.sp_degree
        # Batches with masked labels (-100): the trainer sets, per step, pieces x micro-batches /
        # (targets in the global batch), and the loss is the sum over this piece's targets times
        # that, so that the averaged gradients are those of the global batch's mean over targets
        # (a piece without targets then adds 0, not NaN). None: the mean over the piece.
        self.target_scale: float | None = None
        self.real_seq_len: int | None = None
        self.labels_hook = None  # the labels of the rows the head holds (NetMoE per-layer placement)

    def context(self):
        if self.vocab_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        from contextlib import nullcontext

        return nullcontext()

    def __call__(self, logits, labels: torch.Tensor) -> torch.Tensor:
        seq = labels.shape[1]
        if self.labels_hook is not None:
            labels = self.labels_hook(labels)
        labels = self.ctx.data_block(labels, self.act)
        # fp32 logits (bf16 runs): the log-softmax over the vocabulary loses too much in bf16. The
        # vocabulary-sharded DTensor of loss parallelism casts its shards alike.
        logits, targets = logits.flatten(0, 1).float(), labels.flatten()
        if self.target_scale is not None:
            return F.cross_entropy(logits, targets, reduction="sum", ignore_index=IGNORE) * self.target_scale
        real = self.real_seq_len
        if real is None or real == seq:
            return F.cross_entropy(logits, targets)
        total = F.cross_entropy(logits, targets, reduction="sum", ignore_index=IGNORE)
        return total / (labels.shape[0] * real / self.act.seq_parts)


IGNORE = -100  # label of a padding position (cross-entropy's ignore_index)


def sequence_multiple(plan: Plan) -> int:
    """The sequence length must be a multiple of this for every layer's sequence shards to be
    equal (Megatron sequence parallel x tp, Ulysses x sp, 2 cp load-balanced chunks); the
    embedding's output follows its layer's layout."""
    return math.lcm(*(ActLayout.of(s).seq_multiple for s in plan.layers))


def pad_sequences(multiple: int, tokens, labels, positions=None, doc_ids=None):
    """Pad (B, S) batches at the end of every sequence to a multiple of `multiple` tokens:
    padding tokens are 0 with `IGNORE` labels at position 0; causal attention keeps them out of
    every real token's context; packed documents get the padding as one more document of each
    row (ids stay non-decreasing), so no real token attends to it."""
    seq = tokens.shape[1]
    pad = -seq % multiple
    if pad == 0:
        return tokens, labels, positions, doc_ids
    tokens = F.pad(tokens, (0, pad))
    labels = F.pad(labels, (0, pad), value=IGNORE)
    if positions is None:
        positions = torch.arange(seq, device=tokens.device).expand(tokens.shape[0], seq)
    positions = F.pad(positions, (0, pad))
    if doc_ids is not None:
        last = doc_ids[:, -1:] + 1
        doc_ids = torch.cat([doc_ids, last.expand(doc_ids.shape[0], pad)], dim=1)
    return tokens, labels, positions, doc_ids
