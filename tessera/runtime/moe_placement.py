"""NetMoE sample placement in the trainer: each step's samples move once, to the data ranks that
`tessera.adapt.moe_placement` chooses from the routing predicted for them.

Per step (`SamplePlacer.place`): the data ranks' rows (token ids, labels, positions and document
ids: integers, cheap) are all-gathered, so every rank holds the global batch; rank 0 predicts each
sample's token-slots per expert from the routing table and solves the placement, and broadcasts
the order; every rank keeps the rows of its data rank. Every rank still runs N / D samples and
the loss is a mean over the same tokens, so losses and gradients are those without placement.
After the step (`observe`), the MoE layers' routing of the step (recorded per forward call, in
micro-batch order) updates the routing table: slots per token id and expert, all-reduced so that
every rank holds the same table.

The crossing matrix averages the MoE layers' (each with its strategy and its pipeline stage's
ranks) over the layers: samples move once for all of them.
"""
from __future__ import annotations

import logging

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..adapt.moe_placement import RoutingTable, crossing_matrix, place_samples
from ..errors import TesseraError
from ..models.moe import MoE
from ..plan import Plan
from ..spec.model import LayerKind
from .layout import ActLayout
from .mesh import ParallelDims
from .parallel_model import StageContext

log = logging.getLogger(__name__)


class SamplePlacer:
    def __init__(self, plan: Plan, dims: ParallelDims, rank: int, parts: list[nn.Module]):
        cfg = plan.model.config
        if cfg is None or not cfg.num_experts:
            raise TesseraError("MoE sample placement needs a model with experts")
        self.plan, self.dims, self.rank = plan, dims, rank
        self.data_ranks = min(s.dp for s in plan.layers)
        moe = [i for i, layer in enumerate(plan.model.layers) if layer.kind == LayerKind.MOE_DECODER]
        self.crossing = np.mean([crossing_matrix(plan.layers[i], self.data_ranks, cfg.num_experts,
                                                 plan.cluster.gpus_per_node,
                                                 plan.pipeline.rank_of_chunk(plan.stage_of_layer(i)) * plan.stage_size)
                                 for i in moe], axis=0)
        self.table = RoutingTable(cfg.vocab_size, cfg.num_experts)
        self.num_moe_layers = len(moe)
        self.ctx = StageContext.build(plan, dims, rank)
        self.layers = []  # (MoE module, its plan layer's strategy)
        for part in parts:
            for name, module in part.named_modules():
                if isinstance(module, MoE):
                    path = name.split(".")
                    block = int(path[path.index("layers") + 1])
                    module.routing_log = []
                    self.layers.append((module, plan.layers[block + 1]))
        self.last = None  # the placement of the last step

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
        order = torch.empty(n, dtype=torch.int64, device=full[0].device)
        if self.rank == 0:
            counts = self.table.predict(full[0].cpu().numpy())
            self.last = place_samples(counts, self.crossing)
            order.copy_(torch.as_tensor(self.last.order()))
        dist.broadcast(order, src=0)
        per = n // self.data_ranks
        d = self.dims.stage_rank(self.rank) // (self.plan.stage_size // self.data_ranks)
        mine = order[d * per:(d + 1) * per]
        placed = tuple(None if f is None else f[mine] for f in full)
        self.tokens = placed[0]
        return placed

    def observe(self) -> None:
        """Update the routing table with the routing of the step just run (its placed rows)."""
        cfg = self.plan.model.config
        tokens = self.tokens
        delta = np.zeros((cfg.vocab_size, cfg.num_experts))
        seen = np.zeros(cfg.vocab_size)
        chunks = tokens.chunk(self.plan.num_micro_batches)
        for module, s in self.layers:
            log_, module.routing_log = module.routing_log, []
            want = ActLayout(dp=s.dp, sp=s.sp_degree, tp=s.tp, seq_over_tp=False)
            for chunk, chosen in zip(chunks, log_):
                ids = self.ctx.data_block(chunk, want)
                d, n = RoutingTable.observed(ids.cpu().numpy(), chosen.cpu().numpy()[None], cfg.vocab_size,
                                             cfg.num_experts)
                delta += d / s.tp  # tp replicas route the same tokens
                seen += n / s.tp / self.num_moe_layers  # each layer saw the same tokens
        both = torch.from_numpy(np.concatenate([delta.ravel(), seen]))
        dist.all_reduce(both)
        both = both.numpy()
        self.table.apply(both[:delta.size].reshape(delta.shape), both[delta.size:])
