"""Vision-language training with an LLM pipeline: the encoder's work in the pipeline's bubbles (Optimus).

The LLM runs its plan's 1F1B (or GPipe) pipeline on torch.distributed.pipelining exactly as a
text model does (`Trainer.build_pipeline`). Every rank also holds the image encoder, replicated
(data parallel over all ranks, one all-reduce of its gradients per step) or sharded (below).
Which rank encodes which images is `adapt.bubbles` (the placement the simulator prices): pipeline rank p encodes
a_{p,j} images of micro-batch j, split over the ranks of its stage in contiguous near-equal
shares; the images of micro-batch j are its rows in data-block order (`HandoffPlan.micro_rows`),
pipeline rank 0 taking the first a_{0,j}, rank 1 the next a_{1,j}, and so on.

The encoder may also be sharded (ZeRO-1/2/3 with FSDP2, as the planner's encoder plan says):
over the ranks of each pipeline rank's stage, replicated across the stages (HSDP), so every rank
of a stage runs each of the stage's passes, those with no image of its own on an empty batch
(a ZeRO-3 pass gathers the parameters over the stage; ZeRO-1/2 keep them gathered over the
step), and the replicas' all-reduce runs once, after each rank's last pass.

One step, per rank:
 1. warm-up bubble (before the schedule starts): one encoder forward pass per micro-batch it
    serves, in micro-batch order; after pass j (and on every rank, in micro-batch order, so that
    NCCL pairs them) one batch of point-to-point sends and receives moves micro-batch j's image
    tokens (P x d_llm each) to the stage-0 ranks whose data block holds the image's row;
 2. the pipeline schedule: before stage 0 forwards micro-batch j (its stage's
    `forward_one_chunk`) it waits for j's image tokens, makes them a leaf and splices them into the token
    embeddings (`MicroBatchSplice`; a recomputed embedding finds its micro-batch's tokens again by
    its input's storage); when stage 0's backward of j has accumulated the leaf's gradient (a
    post-accumulate-grad hook), the gradient goes back to the encoder ranks of j's images;
 3. cool-down bubble (after the schedule): each encoder pass's backward, in micro-batch order,
    once its image tokens' gradients are in.

Exactness. The schedule backpropagates each micro-batch's loss undivided (pipelining scales the
parameters' gradients by 1 / m afterwards), so the image tokens' gradient is m x that of the
non-pipeline runtime: each pass's gradient is divided by m before the encoder's backward; the
rest (tensor-parallel copies send nothing back, the encoder's gradients summed over ranks and
divided by the loss pieces P) is `runtime/multimodal.py`'s.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import TesseraError
from ..models.vision import ImageSplice, scatter_images


@dataclass(frozen=True)
class BubbleRoutes:
    """Who encodes which rows and where their tokens go (pure arithmetic)."""

    counts: tuple[tuple[int, ...], ...]  # [pipeline rank][micro-batch] images
    handoff: object  # multimodal.HandoffPlan: rows per micro-batch and data block
    stage_size: int
    block_of: tuple[int, ...]  # per stage rank: its data block
    grad_senders: tuple[bool, ...]  # per stage rank: sends gradients back (tensor-parallel coordinate 0)

    @property
    def world(self) -> int:
        return len(self.counts) * self.stage_size

    def share(self, rank: int, j: int) -> tuple[int, int]:
        """[lo, hi) positions of micro-batch j's row list that `rank` encodes."""
        p, s, n = rank // self.stage_size, rank % self.stage_size, self.stage_size
        off, a = sum(self.counts[q][j] for q in range(p)), self.counts[p][j]
        return off + s * a // n, off + (s + 1) * a // n

    def passes(self, rank: int, whole_stage: bool = False) -> list[tuple[int, int]]:
        """(micro-batch, images) of every encoder pass of `rank`, in order. `whole_stage`: every
        pass its pipeline rank runs, also those whose images all fall to the stage's other ranks
        (0 images here): a sharded encoder gathers and reduces over the whole stage."""
        out = []
        p = rank // self.stage_size
        for j in range(self.handoff.micro_batches):
            lo, hi = self.share(rank, j)
            if hi > lo or (whole_stage and self.counts[p][j] > 0):
                out.append((j, hi - lo))
        return out

    def encoded_rows(self, rank: int) -> list[int]:
        rows = []
        for j, _ in self.passes(rank):
            lo, hi = self.share(rank, j)
            rows += self.handoff.micro_rows(j)[lo:hi]
        return rows

    def links(self, j: int) -> list[tuple[int, int, int, int]]:
        """(encoder rank, stage-0 rank, offset in the encoder's pass, offset in the stage-0 rank's
        block, images) of every image-token transfer of micro-batch j."""
        out = []
        for src in range(self.world):
            lo, hi = self.share(src, j)
            if hi <= lo:
                continue
            for dst in range(self.stage_size):
                b0, b1 = self.handoff.block_span(self.block_of[dst])
                a, z = max(lo, b0), min(hi, b1)
                if z > a:
                    out.append((src, dst, a - lo, a - b0, z - a))
        return out


def check_counts(counts, pp: int, m: int, images_per_micro_batch: int) -> None:
    if len(counts) != pp or any(len(row) != m for row in counts):
        raise TesseraError(f"encoder bubbles must give {pp} pipeline ranks x {m} micro-batches of image counts, "
                           f"not {len(counts)} x {len(counts[0]) if counts else 0}")
    for j in range(m):
        got = sum(row[j] for row in counts)
        if got != images_per_micro_batch or any(row[j] < 0 for row in counts):
            raise TesseraError(f"encoder bubbles: micro-batch {j} has {images_per_micro_batch} images, the "
                               f"counts place {got}")


class MicroBatchSplice(ImageSplice):
    """`ImageSplice` whose images are the current micro-batch's (set before stage 0's forward of
    it); a recomputed embedding (its input kept alive by the checkpoint) finds its own again, and
    a forward outside the step's micro-batches (the stage's shape inference) splices nothing."""

    def __init__(self, image_token_id: int, take=None):
        super().__init__(image_token_id, take)
        self.fresh = False
        self.by_input: dict = {}

    def __call__(self, module, args, output):
        tokens = args[0].to_local() if hasattr(args[0], "to_local") else args[0]
        key = (tokens.untyped_storage().data_ptr(), tokens.storage_offset(), tuple(tokens.shape))
        if self.fresh:  # the forward itself: remember which images its input takes
            self.by_input[key] = (self.images, self.placeholders)
            self.fresh = False
        elif key not in self.by_input:  # a forward outside the step's (the stage's shape inference)
            return output
        current = (self.images, self.placeholders)
        self.images, self.placeholders = self.by_input[key]
        try:
            return super().__call__(module, args, output)
        finally:
            self.images, self.placeholders = current


class BubbleStep:
    """One rank's share of an Optimus step (module docstring); `run` is the trainer's step."""

    def __init__(self, trainer, routes: BubbleRoutes, image_token_id: int, p_tokens: int, hidden: int, take):
        self.t, self.routes = trainer, routes
        self.rank, self.m = trainer.rank, routes.handoff.micro_batches
        self.p_tokens, self.hidden = p_tokens, hidden
        self.group = dist.new_group(list(range(routes.world)))
        self.sharded = bool(trainer.encoder_strategy.zero)
        self.my_passes = routes.passes(self.rank, whole_stage=self.sharded)
        self.is_first = trainer.pipeline.has_first_stage
        self.wire_dtype = trainer.wire_dtype  # the image tokens' dtype on the wire
        self.splice = None
        if self.is_first:
            self.splice = MicroBatchSplice(image_token_id, take)
            chunk = trainer.pipeline_parts[0].chunk
            embedding = getattr(chunk.tok_embeddings, "_checkpoint_wrapped_module", chunk.tok_embeddings)
            embedding.register_forward_hook(self.splice)
            # The stage's forward of micro-batch j (its index is the schedule's): j's image tokens
            # first. Not a pre-hook of the chunk: the stage also runs the chunk once to infer shapes.
            stage = trainer.pipeline.schedule._stage
            forward_one_chunk = stage.forward_one_chunk

            def forward_with_images(fwd_chunk_id, args, *rest, **kwargs):
                self._before_stage0_forward(fwd_chunk_id, args)
                return forward_one_chunk(fwd_chunk_id, args, *rest, **kwargs)

            stage.forward_one_chunk = forward_with_images
        dist.barrier(group=self.group)  # the communicator exists before the first batched p2p

    # --- the step -----------------------------------------------------------------------------
    def run(self, tokens, labels, images) -> float:
        t = self.t
        self.keep: list[torch.Tensor] = []  # sent tensors, alive until their sends are done
        self.pending: list = []  # every p2p work of the step
        self.image_parts: dict[int, list] = {j: [] for j in range(self.m)}
        self.image_works: dict[int, list] = {}
        self.grad_parts: dict[int, list] = {j: [] for j in range(self.m)}
        self.grad_works: dict[int, list] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if self.splice is not None:
            self.splice.by_input = {}
        passes = dict(self.my_passes)
        # 1. warm-up bubble: encoder passes, each micro-batch's image tokens sent as it is done.
        start = 0
        for j in range(self.m):
            if j in passes:
                with t._encoder_autocast():
                    self.outputs[j] = t.encoder(images[start:start + passes[j]])
                start += passes[j]
            self.image_works[j] = self._p2p(self._image_ops(j))
        if not self.is_first:  # gradients come back during the schedule: receive them as they do
            for j, _ in self.my_passes:
                self.grad_works[j] = self._p2p(self._grad_recv_ops(j))
        # 2. the pipeline schedule.
        loss = t.forward_backward_pp(tokens, labels, None, None)
        # 3. cool-down bubble: the encoder passes' backward, in micro-batch order.
        for k, (j, count) in enumerate(self.my_passes):
            self._wait(self.grad_works.get(j, []))
            out = self.outputs.pop(j)
            grad = torch.zeros(count, self.p_tokens, self.hidden, dtype=out.dtype, device=out.device)
            for offset, part in self.grad_parts[j]:
                grad[offset:offset + part.shape[0]] += part.to(out.dtype)
            # A sharded encoder reduce-scatters as its ZeRO stage says, the replicas' all-reduce
            # on this rank's last pass (every rank of a stage runs the same passes).
            t.encoder_sync.before_backward(k == len(self.my_passes) - 1)
            out.backward(grad / self.m)
        self._wait(list(self.pending))
        self.keep = []
        return loss

    def _p2p(self, ops: list) -> list:
        works = dist.batch_isend_irecv(ops) if ops else []
        self.pending.extend(works)
        return works

    def _wait(self, works: list) -> None:
        """Wait for `works`, each once (a gloo receive waited again waits for another message)."""
        for w in works:
            if w in self.pending:
                w.wait()
                self.pending.remove(w)

    def _buffer(self, n: int) -> torch.Tensor:
        return torch.empty(n, self.p_tokens, self.hidden, device=self.t.device, dtype=self.wire_dtype)

    def _image_ops(self, j: int) -> list:
        """Micro-batch j's image-token sends (this rank's pass j) and receives (stage 0)."""
        ops = []
        for src, dst, off, at, n in self.routes.links(j):
            if src == self.rank:
                piece = self.outputs[j][off:off + n].detach().to(self.wire_dtype)
                if dst == self.rank:
                    self.image_parts[j].append((at, piece))
                else:
                    self.keep.append(piece.contiguous())
                    ops.append(dist.P2POp(dist.isend, self.keep[-1], dst, self.group, j))
            elif dst == self.rank:
                self.image_parts[j].append((at, self._buffer(n)))
                ops.append(dist.P2POp(dist.irecv, self.image_parts[j][-1][1], src, self.group, j))
        return ops

    def _grad_recv_ops(self, j: int) -> list:
        """Receives of micro-batch j's image-token gradients for this rank's pass j."""
        ops = []
        for src, dst, off, at, n in self.routes.links(j):
            if src == self.rank and dst != self.rank and self.routes.grad_senders[dst]:
                self.grad_parts[j].append((off, self._buffer(n)))
                ops.append(dist.P2POp(dist.irecv, self.grad_parts[j][-1][1], dst, self.group, self.m + j))
        return ops

    # --- stage 0 --------------------------------------------------------------------------------
    def _before_stage0_forward(self, j: int, args):
        self._wait(self.image_works.get(j, []))
        parts = sorted(self.image_parts[j], key=lambda x: x[0])
        tokens = torch.cat([p for _, p in parts]).detach().requires_grad_()
        tokens.register_post_accumulate_grad_hook(lambda leaf, j=j: self._send_grads(j, leaf.grad))
        x = args[0].to_local() if hasattr(args[0], "to_local") else args[0]
        self.splice.images = scatter_images(x, tokens, self.splice.image_token_id)
        self.splice.placeholders = x == self.splice.image_token_id
        self.splice.fresh = True

    def _send_grads(self, j: int, grad: torch.Tensor) -> None:
        """Stage 0, after its backward of j: micro-batch j's image-token gradients to their
        encoders, and (in the same batch) the receives of its own pass j's gradients."""
        ops = []
        if self.routes.grad_senders[self.rank]:
            for src, dst, off, at, n in self.routes.links(j):
                if dst != self.rank:
                    continue
                piece = grad[at:at + n].detach()
                if src == self.rank:
                    self.grad_parts[j].append((off, piece.clone()))
                else:
                    self.keep.append(piece.contiguous())
                    ops.append(dist.P2POp(dist.isend, self.keep[-1], src, self.group, self.m + j))
        if dict(self.my_passes).get(j):
            ops += self._grad_recv_ops(j)
        self.grad_works[j] = self._p2p(ops)
