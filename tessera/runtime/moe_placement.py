"""NetMoE sample placement in the trainer (`tessera.adapt.moe_placement` chooses, this module moves).

Per step (`SamplePlacer.place`): the data ranks' rows (token ids, labels, positions and document
ids: integers, cheap) are all-gathered, so every rank holds the global batch; rank 0 predicts each
sample's token-slots per expert from the routing table and places the samples of every
micro-batch on the data ranks (`place_samples`; a micro-batch keeps its samples, so its router
losses are those without placement), and broadcasts the order; every rank keeps the rows of its
data rank. Every rank still runs N / D samples and the loss is a mean over the same tokens, so
losses and gradients are those without placement. After the step (`observe`), the MoE layers'
routing of the step (recorded per forward call, in micro-batch order) updates the routing
table on rank 0: each rank sends only the token ids it saw, with their slots per expert
(`RoutingUpdate`: n (E + 2) integers for n distinct ids, not the vocabulary-sized table), or,
for vocabularies above 65536 ids, the counts of a hashed table of 16384 rows.

Per layer (`per_layer=True`, NetMoE's placement between layers; `PlacingContext`): the step's
placement serves the first MoE layer's dispatch (its table learns that layer's routing only); in
every MoE layer, once its routing is known, the layer's data ranks all-gather their rows' slots per
expert, the group's first rank solves where each sample runs the next layer (`place_layer`,
the next layer's routing predicted by `LayerTransition` from this layer's) and broadcasts it.
The dispatch all-to-all carries each slot's row h (the block's residual stream, not yet
normalised), its routing weight and where its token goes next; the expert's rank normalises
the row (the block's `ffn_norm`), runs the expert, weighs the output, and adds the residual h
(and the shared expert's output) to one slot of each token (its "carrier"); the combine
all-to-all sends every output row straight to the token's next rank, which sums them: the
residual rides the combine, so moving a sample costs no extra rows. Tokens whose every slot
was dropped by the capacity move by themselves in the same exchange. The model's later layers
read the positions and document ids of the rows they now hold, and the loss the labels
(`ParallelTransformer.placement`, `ParallelLoss.labels_hook`). Each micro-batch keeps its
samples, so losses and gradients are again those without placement. Under tensor parallelism
(runtime/expert_tp.py) the tp ranks route alike, gather the sequence first under Megatron SP,
exchange their partial sums (the residual counted on the first tp rank) and reduce the block's
output once on arrival. Runs without Ulysses or context parallelism in the MoE layers and
without pipeline parallelism.

The crossing matrix of the step placement averages the MoE layers' (each with its strategy and
its pipeline stage's ranks) over the layers: samples move once for all of them.
"""
from __future__ import annotations

import logging

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..adapt.moe_placement import LayerGeometry, Placement, crossing_matrix, place_layer, place_samples
from ..adapt.moe_routing import (EXACT_UP_TO_IDS, HASHED_BUCKETS, LayerTransition, RoutingTable, RoutingUpdate,
                                 hash_key)
from ..errors import TesseraError
from ..models.moe import MoE, Routing
from ..plan import Plan
from ..spec.model import LayerKind
from .expert_parallel import ExpertParallelContext, _AllToAll, _exchange, token_mesh
from .layout import ActLayout
from .mesh import ParallelDims
from .parallel_model import StageContext, pad_sequences, sequence_multiple

log = logging.getLogger(__name__)


class SamplePlacer:
    def __init__(self, plan: Plan, dims: ParallelDims, rank: int, parts: list[nn.Module], per_layer: bool = False,
                 parallel=None):
        cfg = plan.model.config
        if cfg is None or not cfg.num_experts:
            raise TesseraError("MoE sample placement needs a model with experts")
        self.plan, self.dims, self.rank = plan, dims, rank
        self.data_ranks = min(s.dp for s in plan.layers)
        moe = [i for i, layer in enumerate(plan.model.layers) if layer.kind == LayerKind.MOE_DECODER]
        # Per layer, the step's placement serves the first MoE layer's dispatch only (every later one
        # is re-placed once the layer before has routed): its table predicts that layer's routing,
        # which a token's id predicts best (measured on the traces of benchmarks/moe.py).
        targets = moe[:1] if per_layer else moe
        self.crossing = np.mean([crossing_matrix(plan.layers[i], self.data_ranks, cfg.num_experts,
                                                 plan.cluster.gpus_per_node,
                                                 plan.pipeline.rank_of_chunk(plan.stage_of_layer(i)) * plan.stage_size)
                                 for i in targets], axis=0)
        big = cfg.vocab_size > EXACT_UP_TO_IDS  # hashed: bounded memory and update (adapt/moe_routing.py)
        self.table = RoutingTable(cfg.vocab_size, cfg.num_experts, buckets=HASHED_BUCKETS if big else None)
        self.num_moe_layers = len(moe)
        self.table_layers = len(targets)  # the MoE layers whose routing the table learns (the first ones)
        self.ctx = StageContext.build(plan, dims, rank)
        self.layers = []  # (MoE module, its plan layer's strategy)
        for part in parts:
            for name, module in part.named_modules():
                if isinstance(module, MoE):
                    path = name.split(".")
                    block = int(path[path.index("layers") + 1])
                    module.routing_log = []
                    self.layers.append((module, plan.layers[block + 1], block))
        import scipy.optimize  # noqa: F401  (the solver's import here, not in the first step's solve)

        self.last = None  # the placement of the last step
        self.per_layer = per_layer
        self.mb = -1  # the micro-batch running (per-layer placement)
        if per_layer:
            self._install(parallel)

    # --- the step's placement ---------------------------------------------------------------------

    def _gather(self, rows: torch.Tensor | None) -> torch.Tensor | None:
        """The global batch of a per-data-rank tensor (B/D, S): data rank d's rows from the first rank
        holding them."""
        if rows is None:
            return None
        world = dist.get_world_size()
        out = torch.empty((world * rows.shape[0], *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
        dist.all_gather_into_tensor(out, rows.contiguous())
        per_rank = out.view(world, *rows.shape)
        first = [self.plan.stage_size // self.data_ranks * d for d in range(self.data_ranks)]
        return torch.cat([per_rank[r] for r in first])

    def place(self, *rows: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """This rank's rows of the placed batch, for each per-data-rank tensor in `rows`."""
        full = [self._gather(r) for r in rows]
        n = full[0].shape[0]
        m = self.plan.num_micro_batches
        per = n // self.data_ranks
        if per % m:
            raise TesseraError(f"{per} rows per data rank do not split into {m} micro-batches")
        order = torch.empty(n, dtype=torch.int64, device=full[0].device)
        if self.rank == 0:
            order.copy_(torch.as_tensor(self._solve_step(full[0].cpu().numpy(), per, m)))
        dist.broadcast(order, src=0)
        d = self.dims.stage_rank(self.rank) // (self.plan.stage_size // self.data_ranks)
        mine = order[d * per:(d + 1) * per]
        placed = tuple(None if f is None else f[mine] for f in full)
        self.tokens = placed[0]
        self.order, self.full = order, full
        if self.per_layer:
            self.padded = pad_sequences(sequence_multiple(self.plan), *full)
            self.mb, self.arrangements = -1, {}
        return placed

    def _solve_step(self, tokens: np.ndarray, per: int, m: int) -> np.ndarray:
        """The placed batch's sample order: each micro-batch's samples (block j of every data rank's
        rows) placed on the data ranks, so that every micro-batch keeps its samples."""
        counts = self.table.predict(tokens)
        b = per // m
        order = np.empty(len(tokens), dtype=np.int64)
        parts = []
        for j in range(m):
            ids = np.concatenate([np.arange(d * per + j * b, d * per + (j + 1) * b) for d in range(self.data_ranks)])
            parts.append(place_samples(counts[ids], self.crossing))
            for d, rows in enumerate(parts[-1].ranks):
                order[d * per + j * b:d * per + (j + 1) * b] = ids[rows]
        self.last = Placement(ranks=[[int(i) for i in order[d * per:(d + 1) * per]] for d in range(self.data_ranks)],
                              cost=sum(p.cost for p in parts), baseline=sum(p.baseline for p in parts),
                              bound=sum(p.bound for p in parts), seconds=sum(p.seconds for p in parts),
                              method=parts[-1].method)
        return order

    def observe(self) -> None:
        """Update the routing table (and the per-layer transitions) with the routing of the step just
        run, on rank 0, the only rank that predicts: every rank's (a tp group's first rank for its
        replicas) slots per token id and expert, built on the device; the step's distinct ids
        gathered (`RoutingUpdate` rows), or the hashed table's buckets reduced."""
        cfg = self.plan.model.config
        e = cfg.num_experts
        keys, chosen = [], []
        chunks = self.tokens.chunk(self.plan.num_micro_batches)
        for index, (module, s, _) in enumerate(self.layers):
            log_, module.routing_log = module.routing_log, []
            if self.dims.stage_rank(self.rank) % s.tp or index >= self.table_layers:  # tp replicas route alike
                continue
            want = ActLayout(dp=s.dp, sp=s.sp_degree, tp=s.tp, seq_over_tp=False)
            for j, c in enumerate(log_):
                chunk = chunks[j] if not self.per_layer else self._data_rows(self.full[0], j, index)
                keys.append(self.ctx.data_block(chunk, want).reshape(-1).to(c.device))
                chosen.append(c.reshape(-1, c.shape[-1]))
        device = self.tokens.device
        keys = torch.cat(keys) if keys else torch.zeros(0, dtype=torch.int64, device=device)
        chosen = torch.cat(chosen) if chosen else torch.zeros((0, cfg.top_k), dtype=torch.int64, device=device)
        if self.table.buckets is not None:  # every bucket's counts, reduced
            rows = hash_key(keys, self.table.buckets)
            counts = self._slot_counts(rows, chosen, self.table.buckets, e).to(device)
            dist.reduce(counts, dst=0)
            if self.rank == 0:
                counts = counts.cpu().numpy()
                self.table.apply_dense(counts[:, 1:], counts[:, 0], layers=self.table_layers)
        else:  # the step's distinct ids, gathered
            uniq, inv = torch.unique(keys, return_inverse=True)
            counts = self._slot_counts(inv, chosen, len(uniq), e)
            mine = torch.cat([uniq[:, None].to(counts.dtype), counts], 1).cpu().numpy()
            self.update_rows = len(mine)  # this rank's share of the step's update (rows of E + 2 integers)
            rows = self._gather_to_first(mine)
            if rows is not None:
                self.table.apply(RoutingUpdate.unpack(rows), layers=self.table_layers)
        if self.per_layer:
            k = len(self.contexts) - 1
            both = torch.from_numpy(np.concatenate([c.pairs.ravel() for c in self.contexts[1:]] +
                                                   [c.uses for c in self.contexts[1:]] + [np.zeros(1)]))
            both = both.to(device)
            dist.reduce(both, dst=0)  # every MoE layer solves on global rank 0 (pp = 1)
            if self.rank == 0:
                both = both.cpu().numpy()
                pairs, uses = both[:k * e * e].reshape(k, e, e), both[k * e * e:k * e * e + k * e].reshape(k, e)
                self.transition.update(pairs, uses)
            for c in self.contexts:
                c.reset_pairs()

    @staticmethod
    def _slot_counts(rows: torch.Tensor, chosen: torch.Tensor, n: int, experts: int) -> torch.Tensor:
        """(n, 1 + E) int32: occurrences (one per layer pass) and slots per expert of each row."""
        k = chosen.shape[-1]
        slots = torch.bincount(rows.repeat_interleave(k) * experts + chosen.reshape(-1), minlength=n * experts)
        seen = torch.bincount(rows, minlength=n)
        return torch.cat([seen[:, None], slots.view(n, experts)], 1).to(torch.int32)

    def _gather_to_first(self, rows: np.ndarray) -> np.ndarray | None:
        """Every rank's rows (padded with -1 to the longest) on rank 0; None elsewhere."""
        device = self.tokens.device
        n = torch.tensor([len(rows)], device=device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        padded = torch.full((int(n), rows.shape[1]), -1, dtype=torch.int32, device=device)
        padded[:len(rows)] = torch.from_numpy(rows).to(device)
        out = [torch.empty_like(padded) for _ in range(dist.get_world_size())] if self.rank == 0 else None
        dist.gather(padded, out, dst=0)
        return torch.cat(out).cpu().numpy() if self.rank == 0 else None

    # --- per-layer placement ------------------------------------------------------------------------

    def _install(self, parallel) -> None:
        plan, cfg = self.plan, self.plan.model.config
        if plan.pipeline.degree > 1:
            raise TesseraError("moe_placement='layer' does not run under pipeline parallelism "
                               "(moe_placement='step' does)")
        if parallel is None:
            raise TesseraError("moe_placement='layer' needs the parallelised model")
        for module, s, block in self.layers:
            if s.sp_degree > 1 or getattr(s, "cp", 1) > 1:
                raise TesseraError(f"layers[{block + 1}]: moe_placement='layer' needs MoE layers without Ulysses "
                                   f"or context parallelism (moe_placement='step' runs them)")
        self.transition = LayerTransition(len(self.layers), cfg.num_experts, cfg.top_k)
        self.contexts = []
        for index, (module, s, block) in enumerate(self.layers):
            group = token_mesh(self.dims, s).get_group("tokens") if s.dp > 1 else None
            geometry = LayerGeometry.of(s, cfg.num_experts, plan.cluster.gpus_per_node)
            stage_rank = self.dims.stage_rank(self.rank)
            ctx = PlacingContext(module.context, self, index, geometry, group, s.dp, stage_rank // s.tp,
                                 stage_rank % s.tp)
            module.context = ctx
            self.contexts.append(ctx)
        self.block_of = {block: index for index, (_, _, block) in enumerate(self.layers)}
        parallel.chunk.placement = self
        parallel.chunk.register_forward_pre_hook(lambda module, args: self._next_micro_batch())
        parallel.loss.labels_hook = self.labels

    def _next_micro_batch(self) -> None:
        """A forward starts: the next micro-batch, its rows where the step placed them."""
        self.mb += 1
        m, per = self.plan.num_micro_batches, self.order.shape[0] // self.data_ranks
        b = per // m
        rows = torch.cat([self.order[d * per + self.mb * b:d * per + (self.mb + 1) * b]
                          for d in range(self.data_ranks)])
        self.arrangements[self.mb] = [rows]

    def moved(self, index: int, order: torch.Tensor) -> None:
        """MoE layer `index` moved the current micro-batch's rows: new row r holds old row order[r]."""
        history = self.arrangements[self.mb]
        history.append(history[-1][order.to(history[-1].device)])

    def _data_rows(self, full: torch.Tensor, micro_batch: int, layer: int | None = None) -> torch.Tensor:
        """This rank's data-layout rows of a global tensor in micro-batch `micro_batch`'s arrangement
        at the input of MoE layer `layer` (None: the latest)."""
        history = self.arrangements[micro_batch]
        rows = history[-1] if layer is None else history[layer]
        b = rows.shape[0] // self.data_ranks
        d = self.dims.stage_rank(self.rank) // (self.plan.stage_size // self.data_ranks)
        return full[rows[d * b:(d + 1) * b].to(full.device)]

    def after_block(self, block: int, positions, doc_ids):
        """(positions, doc ids, moved) of this rank's rows after model block `block` (ParallelTransformer)."""
        if block not in self.block_of or (positions is None and doc_ids is None):
            return positions, doc_ids, False
        _, _, pos, docs = self.padded
        return (None if positions is None else self._data_rows(pos, self.mb),
                None if doc_ids is None else self._data_rows(docs, self.mb), True)

    def labels(self, labels: torch.Tensor) -> torch.Tensor:
        """The labels of the rows this rank holds at the LM head (ParallelLoss)."""
        return self._data_rows(self.padded[1], self.mb).to(labels.device)


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(order)
    inv[order] = torch.arange(len(order), device=order.device)
    return inv


class PlacingContext(ExpertParallelContext):
    """A MoE layer that places its samples for the next layer (module docstring: per layer)."""

    carries_residual = True

    def __init__(self, base: ExpertParallelContext, placer: SamplePlacer, index: int, geometry: LayerGeometry,
                 group, dp: int, group_rank: int, tp_rank: int):
        self.__dict__.update(base.__dict__)
        self.placer, self.index, self.geometry = placer, index, geometry
        self.last = index == len(placer.layers) - 1
        self.group, self.dp, self.group_rank, self.tp_rank = group, dp, group_rank, tp_rank
        self.decisions: dict[int, torch.Tensor] = {}
        self.prev: dict[int, torch.Tensor] = {}  # micro-batch -> (tokens, E) experts of the previous layer
        self.reset_pairs()

    def reset_pairs(self) -> None:
        e = self.num_experts
        self.pairs, self.uses = np.zeros((e, e)), np.zeros(e)

    def _count_group(self, splits: list[int], x: torch.Tensor) -> None:
        others = sum(splits) - splits[self.group_rank]
        self.moe_stats.a2a_bytes += others * x[0].numel() * x.element_size() if len(x) else 0

    def _decide(self, r: Routing, rows: int, seq: int, unserved: torch.Tensor) -> torch.Tensor:
        """The next arrangement of the micro-batch's rows (new row j holds old row order[j]): this
        layer's slots per row and expert all-gathered over the first tp rank's data ranks, solved
        on global rank 0 and broadcast to the stage (tp ranks route alike)."""
        e = self.num_experts
        local = torch.zeros(rows, e + 1, dtype=torch.float64, device=r.token.device)
        local.index_put_((r.token // seq, r.expert), torch.ones_like(r.token, dtype=torch.float64), accumulate=True)
        local[:, e] = unserved.view(rows, seq).sum(1).double()
        total = rows * self.dp
        order = torch.empty(total, dtype=torch.int64, device=local.device)
        gathered = local
        if self.group is not None and self.tp_rank == 0:
            gathered = torch.empty((total, e + 1), dtype=local.dtype, device=local.device)
            dist.all_gather_into_tensor(gathered, local, group=self.group)
        if dist.get_rank() == 0:
            c = gathered.cpu().numpy()
            counts, rest = c[:, :e], c[:, e]
            nxt = None if self.last else self.placer.transition.predict(self.index, counts)
            placed = place_layer(self.geometry, counts, nxt, np.arange(total) // rows, rest)
            order.copy_(torch.as_tensor(placed.order()))
        if dist.get_world_size() > 1:
            dist.broadcast(order, src=0)
        return order

    def place_block(self, moe: MoE, h: torch.Tensor, r: Routing, norm, shape, inject):
        rows, seq = shape[0], shape[1]
        tokens, hidden = rows * seq, h.shape[-1]
        device = h.device
        n_slots = len(r.token)
        first = torch.full((tokens,), n_slots, dtype=torch.int64, device=device)
        first.scatter_reduce_(0, r.token, torch.arange(n_slots, device=device), "amin")
        carrier = first[r.token] == torch.arange(n_slots, device=device)
        unserved = first == n_slots  # every slot dropped (capacity)
        replay = torch._C._current_graph_task_id() != -1  # a recompute inside the backward: same decision
        mb = self.placer.mb
        if replay:
            order = self.decisions[mb]
        else:
            order = self.decisions[mb] = self._decide(r, rows, seq, unserved)
            self.placer.moved(self.index, order)
            self._note_pairs(r, mb, tokens)
        new_row = _inverse(order)[self.group_rank * rows + torch.arange(rows, device=device)]
        dest = (new_row[:, None] * seq + torch.arange(seq, device=device)[None, :]).flatten()  # next global token
        meta = torch.stack([dest[r.token], carrier.long(), r.expert], 1)
        sent = torch.cat([h[r.token], r.weights.to(h.dtype)[:, None]], 1)
        received, meta, counts, expert_of_row = self._dispatch(sent, meta, r)
        order_e = torch.argsort(expert_of_row, stable=True)
        h_rows, w_rows = received[:, :hidden], received[:, hidden]
        n_rows = norm(h_rows)
        y = moe.experts(n_rows[order_e], counts)[_inverse(order_e)]
        every = torch.arange(len(y), device=device)
        out_rows = self.mix(y, w_rows, every, len(y), None, None)
        carriers = torch.nonzero(meta[:, 1]).flatten()
        extra = self._rest(moe, h_rows[carriers], n_rows[carriers])
        out_rows = out_rows.index_add(0, carriers, extra.to(out_rows.dtype))
        target, experts_of = meta[:, 0], meta[:, 2]
        if moe.config.capacity_factor is not None:  # tokens without a served slot move by themselves
            alone = torch.nonzero(unserved).flatten()
            out_rows = torch.cat([out_rows, self._rest(moe, h[alone], norm(h[alone])).to(out_rows.dtype)])
            target = torch.cat([target, dest[alone]])
            experts_of = torch.cat([experts_of, torch.full_like(alone, -1)])
        out, idx, prev = self._combine(out_rows, target, experts_of, shape, inject)
        if not replay and not self.last:  # the next layer's transition statistics
            onehot = torch.zeros(tokens, self.num_experts, dtype=torch.float64, device=device)
            keep = prev >= 0
            onehot[idx[keep], prev[keep]] = 1.0
            self.placer.contexts[self.index + 1].prev[mb] = onehot
        return self.leave(out)

    def _rest(self, moe: MoE, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """What a token adds besides its experts: the residual h, and the gated shared expert of x =
        norm(h). Under tensor parallelism a partial sum over the tp ranks like the experts' outputs:
        the residual on the first tp rank only, the shared expert's slices."""
        rest = h if self.tp_rank == 0 else torch.zeros_like(h)
        if moe.config.shared_expert_ffn:
            gate = torch.sigmoid(moe.shared_expert_gate(self.router_input(x)))
            rest = rest + self.mix(h[:0], h.new_zeros(0), torch.zeros(0, dtype=torch.int64, device=h.device),
                                   len(h), self.run_shared(moe.shared_expert, x), gate)
        return rest

    def _note_pairs(self, r: Routing, mb: int, tokens: int) -> None:
        """Transition statistics: the experts of each token here against its experts in the layer
        before (which the combine told this rank)."""
        prev = self.prev.pop(mb, None)
        if prev is None:
            return
        cur = torch.zeros(tokens, self.num_experts, dtype=torch.float64, device=prev.device)
        cur[r.token, r.expert] = 1.0
        self.pairs += (prev.T @ cur).cpu().numpy()
        self.uses += prev.sum(0).cpu().numpy()

    def _dispatch(self, sent: torch.Tensor, meta: torch.Tensor, r: Routing):
        """(rows, meta, counts per local expert, local expert of each row) at the experts' rank."""
        if self.ep == 1:
            return sent, meta, r.counts.tolist(), r.expert
        per = self.num_experts // self.ep
        send = r.counts.view(self.ep, per)
        recv = torch.empty(send.shape, dtype=send.dtype, device=send.device)
        dist.all_to_all_single(recv, send.contiguous(), group=self.ep_group)
        send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        rows = _AllToAll.apply(sent, recv_splits, send_splits, self.ep_group, self._count_sent)
        meta = _exchange(meta, recv_splits, send_splits, self.ep_group)
        expert_of_row = torch.repeat_interleave(torch.arange(per, device=sent.device).repeat(self.ep),
                                                recv.flatten())
        return rows, meta, recv.sum(0).tolist(), expert_of_row

    def _combine(self, out_rows: torch.Tensor, target: torch.Tensor, experts_of: torch.Tensor, shape, inject):
        """Every output row to the rank its token runs next, summed there: (out `shape`, local token
        of each received row, its expert here or -1)."""
        local_tokens = shape[0] * shape[1]
        rank_of = target // local_tokens
        order = torch.argsort(rank_of, stable=True)
        meta = torch.stack([target % local_tokens, experts_of], 1)[order]
        rows = out_rows[order]
        if self.group is not None:
            send = torch.bincount(rank_of, minlength=self.dp)
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=self.group)
            send_splits, recv_splits = send.tolist(), recv.tolist()
            rows = _AllToAll.apply(rows, recv_splits, send_splits, self.group, self._count_group)
            meta = _exchange(meta, recv_splits, send_splits, self.group)
        out = torch.zeros(shape, dtype=rows.dtype, device=rows.device)  # not a view (FSDP2 hooks the output)
        out.view(local_tokens, -1).index_add_(0, meta[:, 0], inject(rows))
        return out, meta[:, 0], meta[:, 1]
