"""Vision-language training with separate plans for the image encoder and the LLM.

The LLM (a `Transformer`) runs the plan's per-layer strategies exactly as a text model does
(`parallelize`: TP, sequence parallel, ZeRO / FSDP2, heterogeneous layers). The image encoder
(ViT + projector, `tessera.models.vision.ImageEncoder`) has its own strategy, `EncoderStrategy`:
data parallel over its own ranks (all ranks, or a contiguous subset of them), replicated
(ZeRO-0: one all-reduce of its gradients per step) or FSDP2-sharded (ZeRO-1/2/3, the contract of
`grad_sync`), with or without full recompute.

One micro-batch, per rank (explicit, so the encoder's work can be placed apart from the LLM's):

 1. encoder ranks encode their share of the micro-batch's images (`HandoffPlan`);
 2. hand-off forward: one all-to-all moves each image's tokens (P x d_llm) from the encoder rank
    that made them to every rank whose data block holds the image's row;
 3. the LLM forward splices them into the token embeddings at the placeholders (a forward hook of
    the embedding, `ImageSplice`, taking the embedding's own block of the data block); loss;
    backward down to the received image tokens (a leaf);
 4. hand-off backward: the reverse all-to-all returns d(loss)/d(image tokens) to the encoder rank
    of each image; 5. the encoder's backward.

Exactness. The gradient that reaches a rank's received image tokens is the gradient of its own
(batch, sequence) block of the embedding layer. Ranks of one data block hold either disjoint blocks
(data or sequence split, Megatron SP's split of the embedding output over tp included: their
gradients add) or the same block (tensor-parallel copies: each holds the whole gradient), so of
copies only the one with tensor-parallel coordinate 0 sends gradients back; the encoder rank sums what it receives. Summed over encoder ranks this is
P x d(loss)/d(encoder), P = the LM head's pieces (`ParallelLoss.pieces`, each piece's loss its
own mean): encoder gradients are summed over the encoder ranks and divided by P (ZeRO-0), or
FSDP2's mean over E ranks is rescaled by E / P. Gradient clipping takes the global norm over the
LLM's and the encoder's gradients on every rank.

With an LLM pipeline (Optimus): the encoder is replicated on every rank and its passes run in the
pipeline's bubbles, the hand-off by point-to-point transfers into stage 0 (`runtime/vlm_pipeline.py`).

Rows: the global batch has B rows in D data blocks (`data_parallel_size`), each split into m
micro-batches of b = B / (D m) rows; micro-batch i is rows {d B / D + i b + k}. The encoder's E
ranks take contiguous, near-equal shares of that list (floor(j N / E) .. floor((j+1) N / E)).
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..adapt.optimus import recomputed_blocks
from ..errors import TesseraError
from ..models.vision import ImageSplice, build_image_encoder, image_token_id, init_value, scatter_images, vision_frequencies
from ..plan import Plan
from .grad_sync import GradSync, ShardedUnit, settle_gradients
from .mesh import layer_coords
from .optim import _local, grad_norm
from .parallel_model import data_parallel_size
from .trainer import TrainConfig, Trainer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EncoderStrategy:
    """Where and how the image encoder runs: data parallel over ranks
    [first_rank, first_rank + dp), ZeRO stage `zero` (0: replicated), which blocks recompute."""

    dp: int = 0  # 0: every rank
    first_rank: int = 0
    zero: int = 0
    recompute: bool = False  # every block, when `recompute_blocks` is ()
    # With an LLM pipeline (Optimus, runtime/vlm_pipeline.py): images of each micro-batch each
    # pipeline rank encodes, [pipeline rank][micro-batch] (adapt.bubbles); () = its default.
    bubbles: tuple = ()
    # The encoder blocks each pipeline rank's replica recomputes (one entry without an LLM
    # pipeline): Optimus recomputes fewer where a rank's memory holds more (adapt/optimus.py).
    recompute_blocks: tuple = ()

    def recomputed(self, pipeline_rank: int, blocks: int) -> tuple[int, ...]:
        """The blocks (of `blocks`) that pipeline rank `pipeline_rank`'s replica recomputes."""
        if not self.recompute_blocks:
            return tuple(range(blocks)) if self.recompute else ()
        return tuple(self.recompute_blocks[pipeline_rank])

    def ranks(self, world_size: int) -> list[int]:
        dp = self.dp or world_size
        return list(range(self.first_rank, self.first_rank + dp))

    def check(self, world_size: int) -> None:
        dp = self.dp or world_size
        if dp < 1 or self.first_rank < 0 or self.first_rank + dp > world_size:
            raise TesseraError(f"encoder placement ranks {self.first_rank}..{self.first_rank + dp - 1} do not fit "
                               f"in the {world_size} ranks of the run")
        if self.zero not in (0, 1, 2, 3):
            raise TesseraError(f"encoder zero={self.zero} must be 0, 1, 2 or 3")

    def check_recompute(self, pipeline_ranks: int, blocks: int) -> None:
        if not self.recompute_blocks:
            return
        if len(self.recompute_blocks) != pipeline_ranks:
            raise TesseraError(f"encoder recompute_blocks has {len(self.recompute_blocks)} entries for "
                               f"{pipeline_ranks} pipeline ranks")
        bad = sorted({i for row in self.recompute_blocks for i in row if not 0 <= i < blocks})
        if bad:
            raise TesseraError(f"encoder recompute_blocks names blocks {bad}; the encoder runs blocks 0..{blocks - 1}")


def from_task_plan(task_plan, world_size: int) -> tuple[Plan, EncoderStrategy]:
    """The LLM plan and the encoder strategy this runtime executes for a planned VLM task
    (`tessera.search.multimodal.plan_vlm_task`). Colocated placements run as planned: the
    encoder data parallel on every rank with its plan's ZeRO stage (the largest over its layers)
    and its recomputed blocks, the LLM under its own plan. One sentence for what it cannot run yet."""
    if task_plan.placement == "llm_only":
        raise TesseraError(f"task '{task_plan.task}' has no images: train its LLM plan with the text trainer")
    if task_plan.placement != "colocated":
        raise TesseraError(f"task '{task_plan.task}': the encoder on {task_plan.encoder_gpus} ranks apart from the "
                           f"LLM's is not supported by this runtime yet; plan it colocated (encoder_gpus = all)")
    enc = task_plan.encoder.plan
    if enc.pipeline.degree > 1 or any(s.tp > 1 or s.sp_degree > 1 for s in enc.layers):
        raise TesseraError(f"task '{task_plan.task}': the encoder plan uses tensor/sequence/pipeline parallelism, "
                           "which this runtime does not run for the encoder yet (data parallel and ZeRO only)")
    if enc.world_size != world_size or task_plan.llm.plan.world_size != world_size:
        raise TesseraError(f"task '{task_plan.task}' was planned for {enc.world_size} ranks, not {world_size}")
    blocks = recomputed_blocks(enc)
    return task_plan.llm.plan, EncoderStrategy(dp=world_size, zero=max(s.zero for s in enc.layers),
                                               recompute=bool(blocks), recompute_blocks=(blocks,))


def from_optimus(result, world_size: int) -> tuple[Plan, EncoderStrategy]:
    """The LLM pipeline plan and the encoder strategy this runtime executes for a planned Optimus
    result (`adapt.optimus.optimus_schedule`): the encoder on every rank, replicated or (ZeRO-1/2/3)
    sharded over each pipeline rank's stage and replicated across stages, as the plan prices it
    (data parallel only: no tensor or sequence parallelism), its passes where the planner placed
    them (`counts`), each pipeline rank's replica recomputing the blocks its plan says."""
    plans = [result.rank_encoder(r).plan for r in range(result.pp)]
    if any(enc.pipeline.degree > 1 or any(s.tp > 1 or s.sp_degree > 1 or s.offload_optimizer for s in enc.layers)
           for enc in plans):
        raise TesseraError("the Optimus encoder plan uses tensor/sequence parallelism or offload, which this "
                           "runtime does not run in the bubbles yet (data parallel, with or without ZeRO)")
    zeros = {s.zero for enc in plans for s in enc.layers}
    if len(zeros) > 1:
        raise TesseraError(f"the Optimus encoder plan mixes ZeRO stages {sorted(zeros)}, which this runtime does "
                           "not run in the bubbles (one stage for the whole encoder)")
    if result.llm_plan.world_size != world_size:
        raise TesseraError(f"the Optimus plan was made for {result.llm_plan.world_size} ranks, not {world_size}")
    blocks = tuple(recomputed_blocks(enc) for enc in plans)
    return result.llm_plan, EncoderStrategy(dp=world_size, zero=zeros.pop(), recompute=any(blocks),
                                            bubbles=tuple(tuple(row) for row in result.counts),
                                            recompute_blocks=blocks)


# --- which rows go where ---------------------------------------------------------------------------


@dataclass(frozen=True)
class HandoffPlan:
    """Rows of the global batch per micro-batch, per encoder rank and per data block (pure arithmetic)."""

    global_batch: int
    data_size: int  # D
    micro_batches: int  # m
    encoder_ranks: tuple[int, ...]

    @property
    def rows_per_block(self) -> int:  # b
        return self.global_batch // (self.data_size * self.micro_batches)

    def micro_rows(self, i: int) -> list[int]:
        """Global rows of micro-batch i, ascending."""
        block, b = self.global_batch // self.data_size, self.rows_per_block
        return [d * block + i * b + k for d in range(self.data_size) for k in range(b)]

    def encoder_share(self, j: int) -> tuple[int, int]:
        """[lo, hi) positions in a micro-batch's row list that encoder rank index j encodes."""
        n, e = self.data_size * self.rows_per_block, len(self.encoder_ranks)
        return j * n // e, (j + 1) * n // e

    def block_span(self, d: int) -> tuple[int, int]:
        """[lo, hi) positions in a micro-batch's row list of data block d."""
        return d * self.rows_per_block, (d + 1) * self.rows_per_block

    def encoded_rows(self, rank: int) -> list[int]:
        """Global rows whose images `rank` encodes, micro-batch after micro-batch."""
        if rank not in self.encoder_ranks:
            return []
        lo, hi = self.encoder_share(self.encoder_ranks.index(rank))
        return [r for i in range(self.micro_batches) for r in self.micro_rows(i)[lo:hi]]

    def counts(self, src: int, dst_block: int) -> int:
        """Images encoder rank index `src` hands to a rank of data block `dst_block` per micro-batch."""
        lo, hi = self.encoder_share(src)
        b0, b1 = self.block_span(dst_block)
        return max(0, min(hi, b1) - max(lo, b0))


class _Exchange:
    """The all-to-all of one micro-batch's image tokens, forward and backward (see the module docstring)."""

    def __init__(self, plan: HandoffPlan, rank: int, world: int, data_block_of, sends_grad: list[bool], group):
        self.group, self.rank, self.world = group, rank, world
        enc = plan.encoder_ranks
        j = enc.index(rank) if rank in enc else None
        # Images per (source rank -> destination rank), per micro-batch.
        self.send = [plan.counts(j, data_block_of(r)) if j is not None else 0 for r in range(world)]
        self.recv = [plan.counts(enc.index(s), data_block_of(rank)) if s in enc else 0 for s in range(world)]
        self.sends_grad = sends_grad  # per rank: its gradient goes back (tensor-parallel coordinate 0)
        # Where each destination's images start inside this encoder rank's share.
        self.send_offset = []
        if j is not None:
            lo, _ = plan.encoder_share(j)
            for r in range(world):
                b0, _ = plan.block_span(data_block_of(r))
                self.send_offset.append(max(lo, b0) - lo)

    def forward(self, mine: torch.Tensor, tokens_per_image: int, hidden: int) -> torch.Tensor:
        """This rank's data block's image tokens (n_d, P, d) from the encoder ranks' (n_j, P, d)."""
        if self.send_offset:
            parts = [mine[o:o + n] for o, n in zip(self.send_offset, self.send)]
            out = torch.cat(parts) if parts else mine[:0]
        else:
            out = mine.new_zeros(0, tokens_per_image, hidden)
        received = out.new_empty(sum(self.recv), tokens_per_image, hidden)
        dist.all_to_all_single(received, out.contiguous(), self.recv, self.send, group=self.group)
        return received

    def backward(self, grad: torch.Tensor | None, mine_shape: tuple, dtype, device) -> torch.Tensor:
        """Sum of the gradients the data blocks' ranks return for this rank's encoded images."""
        n_mine, p, h = mine_shape
        send = self.recv if self.sends_grad[self.rank] else [0] * self.world
        recv = [n if self.sends_grad[r] else 0 for r, n in enumerate(self.send)]
        payload = grad.contiguous() if self.sends_grad[self.rank] else torch.zeros(0, p, h, dtype=dtype, device=device)
        received = torch.empty(sum(recv), p, h, dtype=dtype, device=device)
        dist.all_to_all_single(received, payload, recv, send, group=self.group)
        total = torch.zeros(n_mine, p, h, dtype=dtype, device=device)
        start = 0
        for r, n in enumerate(recv):
            if n:
                total[self.send_offset[r]:self.send_offset[r] + n] += received[start:start + n]
                start += n
        return total


# --- the trainer --------------------------------------------------------------------------------------


class MultimodalTrainer(Trainer):
    """`Trainer` for a vision-language model: the LLM under `config.plan`, the encoder under
    `encoder` (see the module docstring). `vlm` is the model's `VLMConfig` (vision, llm,
    image_token_id); the plan must be the LLM's."""

    def __init__(self, config: TrainConfig, vlm, encoder: EncoderStrategy | None = None, on_step=None, on_event=None):
        self.vlm = vlm
        self.encoder_strategy = encoder or EncoderStrategy()
        if config.plan.pipeline.degree > 1:
            _check_pipeline(config.plan, self.encoder_strategy)
        if config.eval_every:
            raise TesseraError("evaluation of a vision-language run is not supported yet (eval.every must be 0)")
        if config.plan.model.config != vlm.llm:
            raise TesseraError(f"the plan is for the model {config.plan.model.name}, not for the LLM of {vlm.name}")
        super().__init__(config, on_step=on_step, on_event=on_event)

    # --- build -----------------------------------------------------------------------------------
    def build_model(self) -> None:
        super().build_model()  # the LLM, parallelised and materialised
        strategy = self.encoder_strategy
        strategy.check(self.world_size)
        ranks = strategy.ranks(self.world_size)
        self.encoder_ranks = ranks
        if self.pipeline is not None:
            self._build_bubbles()
            return
        self.handoff_group = dist.new_group(list(range(self.world_size)))
        self.encoder_group = dist.new_group(ranks) if len(ranks) > 1 else None
        self.encoder_mesh = None
        if strategy.zero:
            from torch.distributed.device_mesh import DeviceMesh

            self.encoder_mesh = DeviceMesh(self.device.type, torch.tensor(ranks), mesh_dim_names=("dp_shard",))
        self.handoff = HandoffPlan(self.plan.workload.global_batch, data_parallel_size(self.plan),
                                   self.plan.num_micro_batches, tuple(ranks))
        if self.handoff.rows_per_block * self.data_size * self.plan.num_micro_batches != self.plan.workload.global_batch:
            raise TesseraError(f"global batch {self.plan.workload.global_batch} does not split into "
                               f"{self.data_size} data blocks x {self.plan.num_micro_batches} micro-batches")
        first = self.plan.layers[0]
        coords = [layer_coords(self.dims.stage_rank(r), self.plan.stage_size, first.dp, first.sp_degree, first.tp)
                  for r in range(self.world_size)]
        block_of = [self.dims.stage_rank(r) // (self.plan.stage_size // self.data_size) for r in range(self.world_size)]
        # Tensor-parallel copies of a data block hold the same embedding rows (one sends the
        # gradient back), unless Megatron SP splits the embedding's output over them (all send).
        split = self.loss_fn.ctx.layer_acts[0].seq_over_tp
        self.exchange = _Exchange(self.handoff, self.rank, self.world_size, lambda r: block_of[r],
                                  [c.tp == 0 or split for c in coords], self.handoff_group)
        self.encoder = self._build_encoder() if self.rank in ranks else None
        # The splice: on the embedding module itself (inside any recompute wrapper, so a replayed
        # forward splices too), taking the embedding layer's block of this rank's data block.
        ctx = self.loss_fn.ctx
        self.splice = ImageSplice(image_token_id(self.vlm), take=lambda x: ctx.data_block(x, ctx.layer_acts[0]))
        embedding = self.parallel.chunk.tok_embeddings
        embedding = getattr(embedding, "_checkpoint_wrapped_module", embedding)
        embedding.register_forward_hook(self.splice)
        if self.encoder is not None:
            self.model_parts = self.model_parts + [self.encoder]

    def _build_bubbles(self) -> None:
        """The LLM pipeline's Optimus step (runtime/vlm_pipeline.py): the encoder on every rank."""
        from ..adapt.bubbles import default_assignment
        from .precision import _LOW_PRECISION
        from .vlm_pipeline import BubbleRoutes, BubbleStep, check_counts

        plan, pp, m = self.plan, self.plan.pipeline.degree, self.plan.num_micro_batches
        self.handoff_group = dist.new_group(list(range(self.world_size)))
        self.encoder_group = self.handoff_group if self.world_size > 1 else None
        self.encoder_mesh = None
        if self.encoder_strategy.zero:
            # As the planner prices it: sharded over the n ranks of a pipeline rank's stage,
            # replicated across the pp stages (HSDP; the replicas' all-reduce once per step).
            from torch.distributed.device_mesh import DeviceMesh

            grid = torch.arange(self.world_size).reshape(pp, plan.stage_size)
            self.encoder_mesh = DeviceMesh(self.device.type, grid, mesh_dim_names=("dp_replicate", "dp_shard"))
        self.handoff = HandoffPlan(plan.workload.global_batch, self.data_size, m, tuple(self.encoder_ranks))
        if self.handoff.rows_per_block * self.data_size * m != plan.workload.global_batch:
            raise TesseraError(f"global batch {plan.workload.global_batch} does not split into "
                               f"{self.data_size} data blocks x {m} micro-batches")
        per_mb = self.data_size * self.handoff.rows_per_block
        counts = self.encoder_strategy.bubbles or default_assignment(pp, m, per_mb).counts
        check_counts(counts, pp, m, per_mb)
        first, n = plan.layers[0], plan.stage_size
        coords = [layer_coords(s, n, first.dp, first.sp_degree, first.tp) for s in range(n)]
        routes = BubbleRoutes(tuple(map(tuple, counts)), self.handoff, n,
                              tuple(s // (n // self.data_size) for s in range(n)), tuple(c.tp == 0 for c in coords))
        self.routes = routes
        self.encoder = self._build_encoder()
        self.wire_dtype = _LOW_PRECISION.get(self.dtype, torch.float32)
        ctx = self.loss_fn.ctx
        self.bubble_step = BubbleStep(self, routes, image_token_id(self.vlm), _image_tokens(self.vlm),
                                      self.vlm.llm.hidden, lambda x: ctx.data_block(x, ctx.layer_acts[0]))
        self.model_parts = self.model_parts + [self.encoder]

    def _build_encoder(self) -> nn.Module:
        from .materialize import canonical_name, full_value_slice, local_rectangle

        encoder = build_image_encoder(self.vlm, device="meta")
        s = self.encoder_strategy
        keys = list(encoder.vision.layers)
        pp = self.plan.pipeline.degree if self.pipeline is not None else 1
        s.check_recompute(pp, len(keys))
        recomputed = s.recomputed(self.dims.pp_rank(self.rank) if pp > 1 else 0, len(keys))
        if recomputed:
            from ..plan import Recompute
            from .parallelize import _recompute

            for i in recomputed:
                encoder.vision.layers[keys[i]] = _recompute(encoder.vision.layers[keys[i]], Recompute.FULL)
        self.encoder_units = []
        if s.zero:
            from torch.distributed.fsdp import fully_shard

            from .precision import fsdp_mixed_precision

            kw = dict(mesh=self.encoder_mesh, reshard_after_forward=s.zero >= 3)
            mp = fsdp_mixed_precision(self.dtype)
            if mp is not None:
                kw["mp_policy"] = mp
            units = list(encoder.vision.layers.values()) + [encoder]
            for unit in units:
                fully_shard(unit, **kw)
            self.encoder_sync = GradSync([ShardedUnit(u, s.zero) for u in units])
        else:
            self.encoder_sync = GradSync()
        encoder.to_empty(device=self.device)
        with torch.no_grad():
            for name, p in encoder.named_parameters():
                name = canonical_name(name)
                local = p.to_local() if hasattr(p, "to_local") else p
                rect = local_rectangle(p)
                if rect is not None:
                    value = init_value(name, p.shape, self.config.seed, self.vlm, 0.02, *rect)
                else:
                    value = full_value_slice(init_value(name, p.shape, self.config.seed, self.vlm), p)
                local.copy_(value)
        vision_frequencies(encoder, self.vlm)
        return encoder

    # --- data ------------------------------------------------------------------------------------
    def encoded_rows(self) -> list[int]:
        """Global rows whose images this rank encodes in a step (tests feed these)."""
        if self.pipeline is not None:
            return self.routes.encoded_rows(self.rank)
        return self.handoff.encoded_rows(self.rank)

    def build_data(self, split: str = "train"):
        from .image_data import ImageTextLoader, load_image_text

        holdout = self.config.eval_fraction if self.config.eval_every else 0.0
        w = self.plan.workload
        source = self.config.data or "synthetic-shapes"
        loader = ImageTextLoader(load_image_text(source), self.vlm, w.seq_len, w.global_batch, self.config.seed,
                                 holdout, split)
        return _RankView(loader, self)

    def run_batch(self, batch) -> torch.Tensor:
        loss = self.compute_gradients(batch.tokens, batch.labels, batch.images, batch.num_targets)
        self.optimizer_step()
        return torch.as_tensor(loss)

    # --- one step --------------------------------------------------------------------------------
    def compute_gradients(self, tokens, labels, images=None, num_targets: int | None = None):
        """Forward and backward of one step: `tokens`, `labels` (B_d, S) are this rank's data
        block, `images` the images of `encoded_rows()` in that order (empty off the encoder ranks).
        Every parameter's `.grad` then holds this rank's shard of d(global mean loss)/d(parameter)."""
        n = self.plan.num_micro_batches
        targets = num_targets if num_targets is not None else int((labels != -100).sum()) * self.data_size
        self.loss_fn.target_scale = self.loss_fn.pieces * n / max(targets, 1)
        tokens, labels = self._to_device(tokens), self._to_device(labels)
        images = self._to_device(images) if images is not None else None
        self.loss_fn.real_seq_len = tokens.shape[1]
        if self.seq_multiple > 1 and tokens.shape[1] % self.seq_multiple:
            raise TesseraError(f"seq_len {tokens.shape[1]} must be a multiple of {self.seq_multiple} "
                               "for this plan's sequence shards (a VLM's sequences are not padded)")
        if self.pipeline is not None:
            loss = self.bubble_step.run(tokens, labels, images)
            self._sync_encoder_grads()
            return loss
        module = self.parallel.module
        total = torch.zeros((), device=self.device)
        tok_chunks, lab_chunks = tokens.chunk(n), labels.chunk(n)
        per_mb = len(self.encoded_rows()) // n if self.encoder is not None else 0
        p_tokens, hidden = _image_tokens(self.vlm), self.vlm.llm.hidden
        for i in range(n):
            last = i == n - 1
            mine = None
            if self.encoder is not None:
                with self._encoder_autocast():
                    mine = self.encoder(images[i * per_mb:(i + 1) * per_mb])
            sent = mine.detach() if mine is not None else None
            received = self.exchange.forward(sent if sent is not None else torch.zeros(
                0, p_tokens, hidden, device=self.device), p_tokens, hidden).requires_grad_()
            self.splice.images = scatter_images(tok_chunks[i], received, self.splice.image_token_id)
            self.splice.placeholders = tok_chunks[i] == self.splice.image_token_id
            no_sync = module.no_sync() if (hasattr(module, "no_sync") and not last) else nullcontext()
            self.parallel.sync.before_backward(last)
            with no_sync, self.loss_fn.context():
                with self.autocast:
                    logits = module(tok_chunks[i])
                    loss = self.loss_fn(logits, lab_chunks[i])
                (loss / n).backward()
            self.splice.images = self.splice.placeholders = None
            total += _plain(loss).detach() / n
            grad = self.exchange.backward(received.grad, tuple(mine.shape) if mine is not None else (0, p_tokens, hidden),
                                          received.dtype, self.device)
            if mine is not None:
                self.encoder_sync.before_backward(last)
                mine.backward(grad.to(mine.dtype))
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        settle_gradients(self.params)
        self.parallel.rescale_grads()
        self.parallel.sync_tied_grads()
        self._sync_encoder_grads()
        return total / self.world_size

    def _encoder_autocast(self):
        from .precision import autocast

        return autocast(self.device.type, self.dtype) if not self.encoder_strategy.zero else nullcontext()

    @torch.no_grad()
    def _sync_encoder_grads(self) -> None:
        """Encoder gradients to d(global loss)/d(parameter): ZeRO-0 sums over the encoder ranks
        (one all-reduce per step) and divides by the loss pieces P; FSDP2 averaged over E: x E / P."""
        if self.encoder is None:
            return
        pieces, e = self.loss_fn.pieces, len(self.encoder_ranks)
        if self.pipeline is not None and not self.encoder_strategy.zero:  # a rank that encoded nothing adds zeros
            for p in self.encoder.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.encoder.parameters() if p.grad is not None]
        if self.encoder_strategy.zero:
            factor = e / pieces
        else:
            factor = 1.0 / pieces
            if self.encoder_group is not None and grads:
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat, group=self.encoder_group)
                for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
                    g.copy_(piece.view_as(g))
        if factor != 1.0 and grads:
            torch._foreach_mul_([_local(g) for g in grads], factor)

    def optimizer_step(self) -> None:
        """Clip by the global norm of the LLM's and the encoder's gradients (the encoder's
        squared norm broadcast from its first rank), then step every optimizer."""
        llm_params = [p for part in self.model_parts if part is not self.encoder for p in part.parameters()]
        llm_params = list({id(p): p for p in llm_params}.values())
        pp_group = self.dims.mesh.get_group("pp") if self.pipeline is not None else None
        sq = grad_norm([p for p in llm_params if id(p) not in self.tied_copies], pp_group).pow(2)
        enc_sq = torch.zeros((), device=sq.device)
        if self.encoder is not None:
            enc_sq = grad_norm(list(self.encoder.parameters())).pow(2).to(sq.device)
        dist.broadcast(enc_sq, src=self.encoder_ranks[0], group=self.handoff_group)
        norm = (sq + enc_sq).sqrt()
        self.grad_norm = norm
        max_norm = self.config.optim.grad_clip
        if max_norm > 0:
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            grads = [_local(p.grad) for p in self.params if p.grad is not None]
            by_dtype: dict = {}
            for g in grads:
                by_dtype.setdefault((g.device, g.dtype), []).append(g)
            for (device, dtype), group in by_dtype.items():
                torch._foreach_mul_(group, scale.to(device=device, dtype=dtype))
        for opt, sched in zip(self.optimizers, self.schedulers):
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)

    def named_parameters(self):
        """(name in the one-process `VisionLanguageModel`, parameter) of every parameter here."""
        from .materialize import canonical_name

        encoder = {id(q) for q in self.encoder.parameters()} if self.encoder is not None else set()
        for name, p in super().named_parameters():
            if id(p) in encoder:
                yield canonical_name(name), p
            else:
                yield "llm." + name, p



def _check_pipeline(plan: Plan, encoder: EncoderStrategy) -> None:
    """What the Optimus runtime runs (runtime/vlm_pipeline.py), refused in one sentence otherwise."""
    from ..plan import Schedule

    if plan.pipeline.schedule not in (Schedule.ONE_F_ONE_B, Schedule.GPIPE) or plan.pipeline.virtual_stages > 1:
        raise TesseraError(f"a vision-language plan with an LLM pipeline runs the 1f1b or gpipe schedule with one "
                           f"chunk per rank, not {plan.pipeline.schedule.value} with {plan.pipeline.virtual_stages}")
    if encoder.first_rank or encoder.dp not in (0, plan.world_size):
        raise TesseraError("with an LLM pipeline the encoder runs on every rank (encoder dp = all), not "
                           f"dp={encoder.dp} from rank {encoder.first_rank}")


def _image_tokens(vlm) -> int:
    return vlm.image_tokens


def _plain(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class _RankView:
    """A rank's view of the global image-text batches: the text of its data block, the images it encodes."""

    def __init__(self, loader, trainer: MultimodalTrainer):
        self.loader, self.trainer = loader, trainer

    def _rows(self):
        t = self.trainer
        block = self.loader.global_batch // t.data_size
        return slice(t.data_rank * block, (t.data_rank + 1) * block), t.encoded_rows()

    def batch_at(self, first_sample: int):
        rows, image_rows = self._rows()
        return self.loader.batch_at(first_sample, rows, image_rows)

    def __iter__(self):
        return self

    def __next__(self):
        batch = self.batch_at(self.loader.samples_seen)
        self.loader.samples_seen += self.loader.global_batch
        return batch

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)
