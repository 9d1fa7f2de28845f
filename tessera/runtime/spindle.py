"""Multi-task steps as Spindle waves: each task's operators run on their own group of ranks.

A step's workload is several tasks sharing one vision-language model (captioning, text only, ...),
each with its own batch and sequence length. `tessera.adapt.spindle` packs the tasks' operators
(a task's vision encoder + projector, then its LLM) into waves, each operator on its own
contiguous group of ranks; `SpindleSteps` executes such a schedule:

- every rank holds the whole model (the same initial values everywhere, `build_vlm(seed)`); inside
  a group, an operator runs data parallel: the k-th of g ranks takes rows [k B / g, (k+1) B / g)
  of its task's B samples (encoder: images; LLM: text rows);
- waves run in order; an encoder operator keeps its output (and graph) on its ranks; when the
  task's LLM operator runs (a later wave, possibly on other ranks), one all-to-all hands each
  image's tokens from the rank that encoded it to the rank whose rows hold it, the LLM runs
  forward and backward, the reverse all-to-all returns d(loss)/d(image tokens), and the encoder
  ranks run their backward;
- every rank accumulates the gradients of what it ran; at the end of the step one all-reduce sums
  them over all ranks (the shared parameters' combine); clipping and AdamW then act on identical
  gradients everywhere.

The step's loss is the sum over tasks of each task's mean over its caption/text target tokens,
L = sum_t (sum of task t's token losses) / (task t's targets); a rank's part of it is the sum of
its rows' token losses over its task's targets, so the combined gradient is exactly dL/dtheta,
the gradient one process gets running the tasks one after another (tested).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..errors import TesseraError
from ..models.vision import build_vlm, image_token_id, scatter_images
from .image_data import IGNORE_INDEX, CaptionTokenizer, encode_sample, load_image_text, read_image
from .optim import OptimConfig, build_optimizer, build_scheduler, clip_grad_norm_

PARTS = ("vision_encoder", "llm")


@dataclass(frozen=True)
class RunTask:
    """One task of the step: `batch` samples of `seq_len` tokens; `images`: one image per sample
    (an image-captioning task), else text only (the captions alone)."""

    name: str
    batch: int
    seq_len: int
    images: bool = True
    data: str = "synthetic-shapes"
    seed: int = 0


@dataclass(frozen=True)
class RunOp:
    """An operator placed in a wave: task `task`'s `part` on ranks [first_rank, first_rank + ranks)."""

    task: str
    part: str
    first_rank: int
    ranks: int

    def members(self) -> range:
        return range(self.first_rank, self.first_rank + self.ranks)


def waves_of(plan) -> list[list[RunOp]]:
    """The waves of a `tessera.adapt.spindle.SpindlePlan` as `RunOp`s (its devices are the ranks)."""
    return [[RunOp(plan.ops[p.op].task, plan.ops[p.op].part, p.first_gpu, p.gpus) for p in w.ops]
            for w in plan.waves]


def check_waves(waves: list[list[RunOp]], tasks: dict[str, RunTask], world: int) -> None:
    """One sentence for a schedule this runtime cannot run: unknown task or part, groups outside
    the ranks or overlapping in a wave, a task's LLM before its encoder, an operator missing or twice."""
    seen: dict[tuple[str, str], int] = {}
    for k, wave in enumerate(waves):
        used: set[int] = set()
        for op in wave:
            where = f"wave {k + 1}: {op.task}/{op.part}"
            if op.task not in tasks:
                raise TesseraError(f"{where} names an unknown task; tasks: {', '.join(tasks)}")
            if op.part not in PARTS:
                raise TesseraError(f"{where}: unknown model part; parts: {', '.join(PARTS)}")
            if op.ranks < 1 or op.first_rank < 0 or op.first_rank + op.ranks > world:
                raise TesseraError(f"{where} on ranks {op.first_rank}..{op.first_rank + op.ranks - 1} "
                                   f"does not fit in the {world} ranks")
            if used & set(op.members()):
                raise TesseraError(f"{where} shares ranks with another operator of its wave")
            used |= set(op.members())
            if (op.task, op.part) in seen:
                raise TesseraError(f"{where} runs twice (also in wave {seen[op.task, op.part] + 1})")
            if op.part == "llm" and tasks[op.task].images and (op.task, "vision_encoder") not in seen:
                raise TesseraError(f"{where} runs before its task's vision encoder")
            seen[op.task, op.part] = k
    for t in tasks.values():
        for part in (PARTS if t.images else ("llm",)):
            if (t.name, part) not in seen:
                raise TesseraError(f"task {t.name}: its {part} runs in no wave")


def _share(n: int, parts: int, k: int) -> tuple[int, int]:
    return k * n // parts, (k + 1) * n // parts


class TaskData:
    """A task's global batches: tokens and labels (B, S), images (B, C, H, W) for image tasks."""

    def __init__(self, task: RunTask, vlm):
        self.task, self.vlm = task, vlm
        self.samples = load_image_text(task.data)
        self.tokenizer = CaptionTokenizer(vlm.llm.vocab_size, image_token_id(vlm))
        self.image_tokens = vlm.image_tokens if task.images else 0

    def batch(self, step: int):
        v, t = self.vlm.vision, self.task
        tokens, labels, images = [], [], []
        for i in range(t.batch):
            index = (step * t.batch + i + t.seed * 7_919) % len(self.samples)
            image, caption = read_image(self.samples[index], v.image_size, v.channels)
            tok, lab = encode_sample(self.tokenizer.encode(caption), self.image_tokens, image_token_id(self.vlm),
                                     self.tokenizer.eos_id, t.seq_len)
            tokens.append(torch.from_numpy(tok))
            labels.append(torch.from_numpy(lab))
            images.append(torch.from_numpy(image))
        return torch.stack(tokens), torch.stack(labels), (torch.stack(images) if t.images else None)


def task_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


class SpindleSteps:
    """Runs multi-task steps wave by wave (module docstring) on the current process group."""

    def __init__(self, vlm, tasks: list[RunTask], waves: list[list[RunOp]], optim: OptimConfig | None = None,
                 seed: int = 0, device: torch.device | None = None):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.tasks = {t.name: t for t in tasks}
        check_waves(waves, self.tasks, self.world)
        self.vlm, self.waves = vlm, waves
        self.device = device or torch.device("cpu")
        self.model = build_vlm(vlm, seed=seed, device="cpu").to(self.device)
        self.group = dist.new_group(list(range(self.world)))
        self.data = {t.name: TaskData(t, vlm) for t in tasks}
        self.optim = optim or OptimConfig()
        self.optimizer = build_optimizer(self.model.parameters(), self.optim)
        self.scheduler = build_scheduler(self.optimizer, self.optim)
        self.step = 0

    def _ops(self, task: str, part: str) -> RunOp:
        return next(op for wave in self.waves for op in wave if (op.task, op.part) == (task, part))

    def compute_gradients(self, step: int | None = None) -> torch.Tensor:
        """Every wave's forward and backward, then the combine: each parameter's `.grad` is
        d(sum over tasks of the task's mean loss)/d(parameter) on every rank. Returns that loss."""
        step = self.step if step is None else step
        batches = {name: d.batch(step) for name, d in self.data.items()}
        targets = {name: max(1, int((b[1] != IGNORE_INDEX).sum())) for name, b in batches.items()}
        encoded: dict[str, torch.Tensor] = {}  # task -> this rank's encoder output (with its graph)
        total = torch.zeros((), device=self.device)
        for wave in self.waves:
            for op in wave:
                tokens, labels, images = batches[op.task]
                if op.part == "vision_encoder":
                    if self.rank in op.members():
                        lo, hi = _share(len(images), op.ranks, self.rank - op.first_rank)
                        encoded[op.task] = self.model.encode(images[lo:hi].to(self.device))
                    continue
                total += self._run_llm(op, tokens, labels, targets[op.task], encoded)
        self._combine()
        dist.all_reduce(total, group=self.group)
        return total

    def _run_llm(self, op: RunOp, tokens, labels, targets: int, encoded: dict) -> torch.Tensor:
        """The LLM operator of a task (every rank takes part in its hand-off collectives)."""
        task = self.tasks[op.task]
        mine = op.members()
        lo, hi = _share(task.batch, op.ranks, self.rank - op.first_rank) if self.rank in mine else (0, 0)
        received = None
        if task.images:
            enc = self._ops(op.task, "vision_encoder")
            received = self._handoff(enc, op, encoded.get(op.task), task.batch)
        loss = torch.zeros((), device=self.device)
        if self.rank in mine:
            rows = tokens[lo:hi].to(self.device)
            self.model.splice.images = (scatter_images(rows, received, self.model.splice.image_token_id)
                                        if received is not None else None)
            logits = self.model.llm(rows)
            loss = task_loss_sum(logits, labels[lo:hi].to(self.device)) / targets
            loss.backward()
            self.model.splice.images = None
        if task.images:
            grad = self._handoff_back(enc, op, received, encoded.get(op.task), task.batch)
            if op.task in encoded:
                encoded.pop(op.task).backward(grad)
        return loss.detach()

    def _counts(self, enc: RunOp, llm: RunOp, batch: int):
        """Images per (encoder rank -> LLM rank): intersections of their row shares."""
        def share(op, r):
            return _share(batch, op.ranks, r - op.first_rank) if r in op.members() else (0, 0)

        return [[max(0, min(share(enc, s)[1], share(llm, d)[1]) - max(share(enc, s)[0], share(llm, d)[0]))
                 for d in range(self.world)] for s in range(self.world)]

    def _handoff(self, enc: RunOp, llm: RunOp, mine, batch: int) -> torch.Tensor:
        counts = self._counts(enc, llm, batch)
        p, h = self.vlm.image_tokens, self.vlm.llm.hidden
        send = torch.zeros(0, p, h, device=self.device) if mine is None else mine.detach().contiguous()
        received = torch.empty(sum(counts[s][self.rank] for s in range(self.world)), p, h, device=self.device)
        dist.all_to_all_single(received, send, [counts[s][self.rank] for s in range(self.world)],
                               counts[self.rank], group=self.group)
        return received.requires_grad_()

    def _handoff_back(self, enc: RunOp, llm: RunOp, received, mine, batch: int) -> torch.Tensor:
        counts = self._counts(enc, llm, batch)
        p, h = self.vlm.image_tokens, self.vlm.llm.hidden
        grad = received.grad if received.grad is not None else torch.zeros_like(received)
        back = torch.empty(sum(counts[self.rank]), p, h, device=self.device)
        dist.all_to_all_single(back, grad.contiguous(), counts[self.rank],
                               [counts[s][self.rank] for s in range(self.world)], group=self.group)
        return back  # encoder and LLM shares are both in row order: the rows line up

    @torch.no_grad()
    def _combine(self) -> None:
        """Sum every rank's gradients over all ranks (one all-reduce of one flat buffer)."""
        params = list(self.model.parameters())
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        for p, piece in zip(params, flat.split([g.numel() for g in grads])):
            p.grad = piece.view_as(p).clone()

    def train_step(self) -> float:
        loss = self.compute_gradients()
        clip_grad_norm_(list(self.model.parameters()), self.optim.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return float(loss)


def one_process_gradients(model, vlm, tasks: list[RunTask], step: int = 0) -> torch.Tensor:
    """The reference: the tasks one after another in one process, sum of their mean losses."""
    total = torch.zeros(())
    for t in tasks:
        tokens, labels, images = TaskData(t, vlm).batch(step)
        targets = max(1, int((labels != IGNORE_INDEX).sum()))
        loss = task_loss_sum(model(tokens, images), labels) / targets
        loss.backward()
        total += loss.detach()
    return total
