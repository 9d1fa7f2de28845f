"""The training loop: build everything from a Plan, then step, log, checkpoint.

    trainer = Trainer(TrainConfig(plan=plan, steps=100))   # process group, mesh, model, optimizer
    trainer.train()                                         # resume; step; log; evaluate; save

Every rank loads its block of the global batch in the plan's data layout: the batch split over
the gcd of the layers' dp (`data_rank`, `data_size`); every layer takes its sub-block of it
without communication. The model is built on the meta device, parallelised, and only this rank's
shards are allocated and initialised (`build_model`). A step runs the plan's micro-batches
(gradient accumulation with the plan's gradient synchronisation, or the pipeline schedule),
rescales gradients of layers replicated over fewer or more ranks than the loss is split over,
clips the global norm, and steps AdamW and the LR schedule (`compute_gradients` stops before
clipping: the gradient oracle of the equivalence tests). Every `eval_every` steps the model's
mean loss over `eval_batches` global batches of the held-out split is reported (`evaluate`).
Saves, resumes and evaluations are reported to `on_event(kind, info)` beside the log.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import TesseraError
from ..models.transformer import build_model
from ..plan import Plan
from .expert_parallel import moe_step_stats
from .grad_sync import settle_gradients
from .materialize import materialize
from .mesh import ParallelDims
from .metrics import (EventWriter, MetricsWriter, PendingRecord, StepClock, StepRecord, model_flops_utilisation,
                      peak_memory_bytes)
from .optim import OptimConfig, build_optimizer, build_scheduler, clip_grad_norm_
from .parallel_model import data_parallel_size, pad_sequences, sequence_multiple
from .parallelize import Parallelized, check_plan_supported, parallelize, uses_ddp
from .precision import autocast, compute_dtype, configure_matmul, fsdp_mixed_precision, peak_dtype
from .resilience import ResilienceConfig, all_finite, init_rank_process_group
from .steptime import StepTimer, rank_mfu
from .stragglers import StragglerConfig

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    plan: Plan
    steps: int = 100
    optim: OptimConfig = field(default_factory=OptimConfig)
    seed: int = 0
    data: str | None = None  # a directory or file of text/tokens; None = the built-in corpus
    synthetic_data: bool = False  # seeded random tokens (tests, benchmarks)
    metrics_path: str | None = None
    tensorboard_dir: str | None = None
    log_every: int = 1
    compile: bool = False
    init_from: str | None = None  # a Hugging Face directory: its weights (and tokenizer, for text data)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: str | None = None
    adaptive: bool = False  # per-step sequence-parallel groups for the batch's documents
    adaptive_time_budget_s: float = 0.1
    # NetMoE (runtime/moe_placement.py): "step" (or True) places each step's samples on data ranks,
    # "layer" also moves them between MoE layers.
    moe_placement: bool | str = False
    # APTMoE (runtime/expert_offload.py): a cost.expert_offload.HostSpec (the cost model decides where
    # each expert computes) or an OffloadPlan; the MoE layers' experts live in host memory.
    expert_offload: object = None
    # --- run records, evaluation, retention (tessera.config documents each) ---
    run_id: str | None = None  # carried by every metrics line
    wandb: dict | None = None  # wandb.init arguments (project, name, id, config, dir); None: off
    checkpoint_keep: int = 3  # complete checkpoints kept; 0 keeps all
    checkpoint_final: bool = True  # save after the last step
    eval_every: int = 0  # evaluate on the held-out split every N steps and after the last; 0: never
    eval_batches: int = 4  # global batches per evaluation
    eval_fraction: float = 0.05  # share of the data held out (training never sees it when eval is on)
    adaptive_switching: bool = True  # length groups may switch ZeRO working mode and recompute
    long_documents: str = "error"  # adaptive: a document no plan holds is an "error", "skip" or "truncate"
    balance_data: bool = True  # packed rows to data-parallel ranks by predicted time (runtime/balanced_data.py)
    # Recovery (runtime/resilience.py): hang timeout, non-finite policy; async checkpoints;
    # stragglers (runtime/stragglers.py); `events_path`: the run's events.jsonl.
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    checkpoint_async: bool = True
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    events_path: str | None = None

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise TesseraError(f"steps must be >= 0, got {self.steps}")
        if self.moe_placement not in (False, True, "step", "layer"):
            raise TesseraError(f"moe_placement must be 'step' or 'layer', not {self.moe_placement!r}")
        generated = self.data is not None and self.data.split(":")[0] == "synthetic-shapes"  # image_data.py
        if self.data is not None and not generated and not Path(self.data).exists():
            raise TesseraError(f"data directory {self.data} does not exist")
        if self.init_from is not None:
            from ..models.hf_load import hf_model_config, same_architecture

            hf_cfg = hf_model_config(self.init_from)
            if self.plan.model.config is not None and not same_architecture(hf_cfg, self.plan.model.config):
                raise TesseraError(f"the plan is for the model {self.plan.model.name}, not for the checkpoint "
                                   f"in {self.init_from} (its config.json describes another architecture)")


def _pipeline_available() -> bool:
    from importlib.util import find_spec

    return find_spec("tessera.runtime.pipeline") is not None


def positions_for_workload(plan: Plan) -> Plan:
    """RoPE models train at any length: a workload longer than the config's `max_seq_len` (which
    only sizes the rotation table) gets a table as long as its sequences (long-context training,
    as Llama 3's 128K stage). Learned positions stop at their table: refused in one line."""
    cfg, seq = plan.model.config, plan.workload.seq_len
    if cfg is None or seq <= cfg.max_seq_len:
        return plan
    if cfg.position == "learned":
        raise TesseraError(f"{plan.model.name} has learned positions for {cfg.max_seq_len} tokens; the "
                           f"workload's sequences have {seq}")
    log.info("RoPE table extended from %d to %d positions for the workload", cfg.max_seq_len, seq)
    model = plan.model.model_copy(update={"config": cfg.model_copy(update={"max_seq_len": seq})})
    return plan.model_copy(update={"model": model})


class Trainer:
    def __init__(self, config: TrainConfig, on_step: Callable[[StepRecord], None] | None = None,
                 on_event: Callable[[str, dict], None] | None = None):
        self.config = config
        self.plan = positions_for_workload(config.plan)
        self.on_step = on_step
        self.on_event = on_event  # ("save" | "resume" | "eval", details), on rank 0
        self.step = 0
        self.build_distributed()
        self.build()

    @classmethod
    def on_process_group(cls, config: TrainConfig, device: torch.device, dtype: str) -> "Trainer":
        """A trainer on a process group that already exists and that it does not own (the dry
        run's fake one at the plan's world size), computing in `dtype` on `device` whatever this
        machine has: the same build as training, without starting a process group."""
        self = cls.__new__(cls)
        self.config, self.plan, self.on_step, self.on_event, self.step = config, config.plan, None, None, 0
        self.device, self.dtype, self.owns_process_group = device, dtype, False
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dims = ParallelDims.from_plan(self.plan, self.world_size, self.device.type)
        self.build()
        return self

    def build(self) -> None:
        """Everything after the process group: model, optimizer, sample placement, data, metrics."""
        config = self.config
        check_plan_supported(self.plan, self.world_size, pipeline_available=_pipeline_available())
        self.build_model()
        self.build_optimizer()
        self.placer = None
        if config.moe_placement:
            from .moe_placement import SamplePlacer

            self.placer = SamplePlacer(self.plan, self.dims, self.rank, self.model_parts,
                                       per_layer=config.moe_placement == "layer", parallel=self.parallel)
        self.loader = None
        self.data_iter = None
        self.eval_loader = None
        self.metrics = (MetricsWriter(config.metrics_path, config.tensorboard_dir, config.run_id, config.wandb)
                        if self.rank == 0 else None)
        self.events = EventWriter(config.events_path if self.rank == 0 else None)
        self.timer = StepTimer(self.device, self.rank)
        self.bad_step = False  # the last step's loss or gradient norm was not finite (not applied)
        self.guard = None  # `train` starts it (runtime/guard.py)
        self.redo: dict[int, tuple] = {}  # after a resume, rank 0: step -> (loss, grad norm) logged before it
        self.redone: list[tuple[int, tuple, tuple]] = []
        # Read a logged step's figures after the next step is queued (`train`): on CUDA reading
        # them right away would leave the device idle while the host queues the next step.
        self.defer_records = self.device.type == "cuda"

    # --- build --------------------------------------------------------------------------------
    def build_distributed(self) -> None:
        if torch.cuda.is_available():
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
            backend = "nccl"
        else:
            self.device = torch.device("cpu")
            backend = "gloo"
        self.owns_process_group = False
        if not dist.is_initialized():
            if "RANK" in os.environ:  # a collective waiting past the hang deadline raises (gloo) or aborts (NCCL)
                init_rank_process_group(backend, self.config.resilience.process_group_timeout)
            else:  # one process without torchrun: an in-memory store, no port to collide on
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
                self.owns_process_group = True  # `close` ends it: nothing else in the process uses it
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dims = ParallelDims.from_plan(self.plan, self.world_size, self.device.type)
        # bf16 compute only on accelerators: CPUs here have no fast bf16 matmul (runtime/precision.py).
        self.dtype = compute_dtype(self.plan.workload.dtype, self.device.type)
        configure_matmul(self.device.type, self.dtype)
        if self.dtype != self.plan.workload.dtype:
            log.info("workload dtype %s runs as fp32 on CPU", self.plan.workload.dtype)

    def build_model(self) -> None:
        """Build on the meta device, apply the plan, then allocate and initialise only this rank's
        shards (`materialize`): each value is the one `build_model(config, seed)` gives the whole
        model, whatever the plan or world size. DDP wraps the materialised model."""
        self.model = build_model(self.plan.model.config, device="meta")
        self.seq_multiple = sequence_multiple(self.plan)
        mp_policy = fsdp_mixed_precision(self.dtype)
        self.pipeline = None
        self.adaptive = None
        if self.config.adaptive:
            self.build_adaptive()
            return
        if self.plan.pipeline.degree > 1:
            self.parallel = None
            self.build_pipeline(mp_policy)
            return
        self.parallel: Parallelized = parallelize(self.model, self.plan, self.dims, self.rank,
                                                  compile=self.config.compile, mp_policy=mp_policy)
        self.materialize(self.parallel.chunk)
        self.offload_experts(self.parallel.chunk)
        self.parallel.wrap_ddp()
        self.model_parts = [self.parallel.module]
        self.loss_fn = self.parallel.loss
        # FSDP2 casts through its MixedPrecisionPolicy; the DDP path autocasts.
        self.autocast = autocast(self.device.type, self.dtype) if uses_ddp(self.plan) else nullcontext()

    def build_pipeline(self, mp_policy) -> None:
        """Cut the model into the plan's stages; each local chunk is parallelised like a model."""
        from .parallelize import ParallelLoss, StageContext
        from .pipeline import build_pipeline

        parts: list[Parallelized] = []

        def parallelize_chunk(chunk, layers: range) -> Parallelized:
            parts.append(parallelize(chunk, self.plan, self.dims, self.rank, layers, compile=self.config.compile,
                                     mp_policy=mp_policy))
            self.materialize(parts[-1].chunk)  # before the pipeline stage sees it
            self.offload_experts(parts[-1].chunk)
            return parts[-1]

        self.loss_fn = ParallelLoss(StageContext.build(self.plan, self.dims, self.rank))
        self.pipeline = build_pipeline(self.model, self.plan, self.dims.mesh, self.loss_fn, parallelize_chunk)
        self.pipeline_parts = parts
        self.model_parts = list(self.pipeline.model_parts)
        self.autocast = nullcontext()

    def build_adaptive(self) -> None:
        """Per-step sequence-parallel groups (`runtime/adaptive.py`): the plan's layout with its
        Ulysses degree folded into data parallelism (`varlen.storage_plan`), parallelised on the
        meta device and materialised like a static plan."""
        from .adaptive import AdaptiveSteps, check_adaptive_plan
        from .varlen import storage_plan

        check_adaptive_plan(self.plan)
        if self.config.compile:
            raise TesseraError("--compile does not run with --adaptive: the shapes change every micro-batch")
        layout = storage_plan(self.plan)
        dims = ParallelDims.from_plan(layout, self.world_size, self.device.type)
        self.parallel = parallelize(self.model, layout, dims, self.rank, mp_policy=fsdp_mixed_precision(self.dtype))
        self.materialize(self.parallel.chunk)
        self.parallel.wrap_ddp()
        self.model_parts = [self.parallel.module]
        self.loss_fn = self.parallel.loss
        self.autocast = autocast(self.device.type, self.dtype) if uses_ddp(layout) else nullcontext()
        self.adaptive = AdaptiveSteps(self.parallel, self.plan, self.config.adaptive_time_budget_s,
                                      self.config.adaptive_switching, self.config.long_documents)
        self.adaptive.runner.autocast = self.autocast

    def materialize(self, part) -> None:
        """Allocate and initialise this rank's shards of `part`: from the seed, or, with
        `init_from`, read from the Hugging Face checkpoint's files (models/hf_load.py)."""
        if self.config.init_from:
            from ..models.hf_load import load_hf_shards

            load_hf_shards(part, self.config.init_from, self.plan.model.config, self.device)
        else:
            materialize(part, self.plan.model.config, self.config.seed, self.device)

    def offload_experts(self, part) -> None:
        """APTMoE: the MoE experts of `part` to host memory, each computing where the decision says."""
        if self.config.expert_offload is None:
            return
        from .expert_offload import apply_expert_offload, check_expert_offload, offload_plan_for

        check_expert_offload(self.plan)
        self.offload_plan = offload_plan_for(self.plan, self.config.expert_offload)
        self.host_experts = getattr(self, "host_experts", []) + apply_expert_offload(part, self.offload_plan,
                                                                                     self.device)

    def build_optimizer(self) -> None:
        """AdamW and its LR schedule per model part (pipeline chunks checkpoint one pair each)."""
        cfg = self.config.optim
        if cfg.total_steps != self.config.steps and self.config.steps:
            cfg = OptimConfig(**{**cfg.__dict__, "total_steps": self.config.steps})
        self.optimizers = [build_optimizer(part.parameters(), cfg) for part in self.model_parts]
        self.schedulers = [build_scheduler(opt, cfg) for opt in self.optimizers]
        self.params = list({id(p): p for part in self.model_parts for p in part.parameters()}.values())
        # The gradient norm counts a tied weight once: a pipeline's head copy is left out.
        self.tied_copies = set()
        if self.pipeline is not None and not self.pipeline.has_first_stage:
            self.tied_copies = {id(p) for p in self.pipeline.tied_params}
        elif self.parallel is not None and self.parallel.tied_head_copy is not None:
            self.tied_copies = {id(self.parallel.tied_head_copy)}

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer of the first model part (all of them: `optimizers`)."""
        return self.optimizers[0]

    def build_data(self, split: str = "train"):
        """The batch iterator of this rank's data block (`data_rank` of `data_size`); `split`
        "eval": the held-out batches evaluation reads (the training stream leaves them out)."""
        w = self.plan.workload
        holdout = self.config.eval_fraction if self.config.eval_every else 0.0
        if self.config.synthetic_data:  # held-out batches: another seed's stream
            seed = self.config.seed if split == "train" else self.config.seed + 7_919
            loader = SyntheticLoader(self.plan.model.config.vocab_size, w.seq_len, w.global_batch,
                                     self.data_rank, self.data_size, seed)
            loader.rows = self.data_rows()
            return loader
        from .data import build_dataloader

        tokenizer = None
        if self.config.init_from:  # the model's own tokenizer, not GPT-2's
            from .hf_tokenizer import HFTokenizer

            tokenizer = HFTokenizer(self.config.init_from)
            tokenizer.check_fits(self.plan.model.config.vocab_size)
        # An adaptive run hands every rank the whole global batch (the step plan splits it); a
        # balanced one reads it whole too and keeps the rows the balancer gives this rank.
        # Replicas of unequal speed take the plan's uneven shares instead (`Plan.batch_shares`).
        balance = (self.adaptive is None and self.config.balance_data and self.data_size > 1
                   and not self.plan.batch_shares)
        rank, size = (0, 1) if self.adaptive is not None or balance else (self.data_rank, self.data_size)
        loader = build_dataloader(self.config.data, w.seq_len, w.global_batch, rank, size,
                                  self.config.seed, pack=True, tokenizer=tokenizer, holdout=holdout, split=split)
        if loader.vocab_size > self.plan.model.config.vocab_size:
            raise TesseraError(f"the data's tokenizer has {loader.vocab_size} tokens, more than the model's "
                               f"vocabulary of {self.plan.model.config.vocab_size}")
        if balance:
            from ..adapt.seqcost import plan_sequence_cost
            from .balanced_data import BalancedLoader

            lin, attn = plan_sequence_cost(self.plan)
            loader = BalancedLoader(loader, self.data_rank, self.data_size, self.plan.num_micro_batches, lin, attn)
        elif self.adaptive is None:
            loader.rows = self.data_rows()
        return loader

    # --- data placement ---------------------------------------------------------------------------
    @property
    def data_size(self) -> int:
        return data_parallel_size(self.plan)

    @property
    def data_rank(self) -> int:
        return self.dims.stage_rank(self.rank) // (self.plan.stage_size // self.data_size)

    def data_rows(self) -> slice | None:
        """This rank's rows of the global batch when replicas take uneven shares (`Plan.batch_shares`);
        None: the equal block `data_rank` of `data_size`."""
        if not self.plan.batch_shares:
            return None
        shares = self.plan.batch_shares
        start = sum(shares[:self.data_rank])
        return slice(start, start + shares[self.data_rank])

    def local_rows(self, global_batch: torch.Tensor) -> torch.Tensor:
        """This rank's block of a global-batch tensor (tests feed the same global batch everywhere)."""
        if self.plan.batch_shares:
            return global_batch[self.data_rows()]
        rows = global_batch.shape[0] // self.data_size
        return global_batch[self.data_rank * rows:(self.data_rank + 1) * rows]

    # --- one step ---------------------------------------------------------------------------------
    def train_step(self, tokens: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None,
                   doc_ids: torch.Tensor | None = None) -> float:
        """One optimizer step on this rank's data block; returns the mean loss of the global batch
        (waiting for the device; `run_step` does not). Packed documents: `positions` and `doc_ids`
        (B, S), see `Transformer.forward`."""
        return float(self.run_step(tokens, labels, positions, doc_ids))

    def run_batch(self, batch) -> torch.Tensor:
        """`run_step` on a loader's batch (a multimodal trainer's batches carry images too)."""
        packed = getattr(batch, "packed", False)
        return self.run_step(batch.tokens, batch.labels, batch.positions if packed else None,
                             batch.doc_ids if packed else None, getattr(batch, "num_targets", None))

    def run_step(self, tokens: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None,
                 doc_ids: torch.Tensor | None = None, num_targets: int | None = None) -> torch.Tensor:
        """`train_step` queued on the device without waiting for it: the global batch's mean loss
        as a 0-dim tensor, which `float()` reads once the step is done. `num_targets`: the labels
        that are not -100 in the whole global batch, when some are (the loss is then their mean)."""
        if num_targets is None and self.plan.batch_shares:  # uneven rows: the global count weighs them
            num_targets = self.plan.workload.global_batch * tokens.shape[1]
        loss = self.compute_gradients(tokens, labels, positions, doc_ids, num_targets)
        self.optimizer_step(loss)
        if self.placer is not None:
            self.placer.observe()
        return torch.as_tensor(loss)

    def compute_gradients(self, tokens: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None,
                          doc_ids: torch.Tensor | None = None, num_targets: int | None = None):
        """Forward and backward of one step without stepping: every parameter's `.grad` holds this
        rank's shard of d(global batch mean loss)/d(parameter), before clipping (`optimizer_step`
        clips and steps). Returns the global batch's mean loss (a device tensor, or a float for
        pipelines)."""
        self.loss_fn.target_scale = (None if num_targets is None else
                                     self.loss_fn.pieces * self.plan.num_micro_batches / max(num_targets, 1))
        tokens, labels, positions, doc_ids = (self._to_device(t) for t in (tokens, labels, positions, doc_ids))
        if self.placer is not None:  # NetMoE: this step's samples to the data ranks it chooses
            tokens, labels, positions, doc_ids = self.placer.place(tokens, labels, positions, doc_ids)
        # A sequence that does not split into the plan's sequence shards is padded (ignored labels).
        self.loss_fn.real_seq_len = tokens.shape[1]
        tokens, labels, positions, doc_ids = pad_sequences(self.seq_multiple, tokens, labels, positions, doc_ids)
        if self.pipeline is not None:
            return self.forward_backward_pp(tokens, labels, positions, doc_ids)
        loss = self.forward_backward(tokens, labels, positions, doc_ids)
        settle_gradients(self.params)
        self.parallel.rescale_grads()
        self.parallel.sync_tied_grads()
        return loss

    def _to_device(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A host batch to the device without a host wait: pinned, then copied asynchronously (a
        copy from pageable memory would wait for the device to finish the previous step)."""
        if t is None or t.device == self.device:
            return t
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def named_parameters(self):
        """(name in the one-process model, parameter) of every parameter this rank holds; a
        pipeline's untied LM head copy is named after the tied embedding it copies."""
        from .materialize import EMBEDDING_WEIGHT, HEAD_WEIGHT, canonical_name

        tied = self.plan.model.config.tie_embeddings
        seen: set[int] = set()
        for part in self.model_parts:
            for name, p in part.named_parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                name = canonical_name(name)
                yield (EMBEDDING_WEIGHT if tied and name == HEAD_WEIGHT else name), p

    def adaptive_step(self, batch) -> float:
        """One optimizer step of an adaptive run; the next batch is planned while this one trains."""
        peek = getattr(self.loader, "batch_at", None)
        next_batch = peek(self.loader.samples_seen) if peek is not None else None
        loss = self.adaptive.forward_backward(self.step, batch, next_batch)
        self.optimizer_step(loss)
        return loss

    def optimizer_step(self, loss=None) -> None:
        """Clip the global gradient norm, step every optimizer and LR schedule. Given the step's
        (global) loss, a step whose loss or gradient norm is not finite is not applied: its
        gradients are dropped and `bad_step` is set (the loop decides what follows, see
        runtime/resilience.py); the LR schedule still advances, as the step counter does."""
        pp_group = self.dims.mesh.get_group("pp") if self.plan.pipeline.degree > 1 else None
        self.grad_norm = clip_grad_norm_(self.params, self.config.optim.grad_clip, pp_group,
                                         skip_in_norm=self.tied_copies)
        # Loss and norm are the same on every rank (reduced), so every rank decides alike.
        self.bad_step = loss is not None and not all_finite(loss, self.grad_norm)
        # DDP's gradients are views into its buckets: zeroed in place (no second copy next step).
        in_buckets = self.parallel is not None and self.parallel.grads_in_buckets
        for opt, sched in zip(self.optimizers, self.schedulers):
            if not self.bad_step:
                opt.step()
            sched.step()
            opt.zero_grad(set_to_none=not in_buckets)

    def forward_backward(self, tokens, labels, positions, doc_ids) -> float:
        n = self.plan.num_micro_batches
        module = self.parallel.module
        total = torch.zeros((), device=self.device)
        chunks = [t.chunk(n) if t is not None else [None] * n for t in (tokens, labels, positions, doc_ids)]
        for i in range(n):
            last = i == n - 1
            # DDP all-reduces once, after the last micro-batch; FSDP2 units as their ZeRO stage says.
            no_sync = module.no_sync() if (hasattr(module, "no_sync") and not last) else nullcontext()
            self.parallel.sync.before_backward(last)
            with no_sync, self.loss_fn.context():
                with self.autocast:
                    logits = module(chunks[0][i], chunks[2][i], chunks[3][i])
                    loss = self.loss_fn(logits, chunks[1][i])
                (loss / n).backward()
            total += _plain(loss).detach() / n
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total / self.world_size  # a device tensor: reading it here would stall the device

    def forward_backward_pp(self, tokens, labels, positions, doc_ids) -> float:
        # Every rank holds the batch: positions and doc ids reach each stage as keyword arguments.
        with self.loss_fn.context():
            loss = self.pipeline.step(tokens, labels, positions, doc_ids, sync_tied=False)
        for part in self.pipeline_parts:
            part.rescale_grads()
        self.pipeline.sync_tied_gradients()  # after rescaling: the copies' factors may differ
        return self.pipeline.global_loss(loss)

    # --- the loop ---------------------------------------------------------------------------------
    def train(self) -> list[StepRecord]:
        """Resume if asked (or after a restart: the latest valid checkpoint); then step, log and
        checkpoint until `steps`, or until a SIGTERM (checkpoint, stop). Returns the logged records.
        Around each step, `runtime/guard.py`: non-finite steps, hangs, stragglers."""
        from .guard import TrainingGuard

        self.guard = TrainingGuard(self)
        try:
            self.settle_ddp_buckets()
            path = self.guard.resume_path()
            if path is not None:
                self.guard.load(path)
                self._after_resume(path)
            if self.data_iter is None:
                self.loader = self.build_data()
                self.data_iter = iter(self.loader)
            return self._steps()
        finally:
            self.guard.close()

    def settle_ddp_buckets(self) -> None:
        """DDP reduces a process's first backward in one bucket of every gradient, and each later
        one in buckets rebuilt in the order the gradients became ready: the sums round
        differently, so the first step of a process would not equal the same step run later in a
        longer one (a resumed run's first step against the uninterrupted run's). One backward of
        a batch of zeros before the first step makes DDP rebuild its buckets first; its gradients
        are dropped, nothing else changes (the model has no dropout; a resume restores the RNG)."""
        module = self.parallel.module if self.parallel is not None else None
        if module is None or not hasattr(module, "reducer") or self.world_size == 1 or self.placer is not None:
            return
        if type(self).compute_gradients is not Trainer.compute_gradients:  # a trainer with its own step's inputs
            return
        w = self.plan.workload
        rows = self.data_rows()
        count = rows.stop - rows.start if rows is not None else w.global_batch // self.data_size
        zeros = torch.zeros(count, w.seq_len, dtype=torch.long)
        self.compute_gradients(zeros, zeros.clone(), num_targets=w.global_batch * w.seq_len)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def _steps(self) -> list[StepRecord]:
        records = []
        clock = StepClock(self.device)
        pending: PendingRecord | None = None
        while self.step < self.config.steps:
            self.timer.start()
            with self.timer.data():
                batch = next(self.data_iter)
            self._rank_times_s = getattr(batch, "rank_times_s", None)
            clock.start()
            self.timer.compute_starts(self.step + 1)
            if self.adaptive is not None:
                loss = self.adaptive_step(batch)
            else:
                loss = self.run_batch(batch)
            self.step += 1
            span = clock.stop()
            times = self.timer.stop(self.step)
            if pending is not None:  # the previous step's, now that this one is queued
                records.append(self.log_step(pending))
                pending = None
            if self.bad_step:  # not applied: skip it, roll back, or stop (raises)
                self.guard.on_bad_step(loss)
                clock.restart()
                continue
            self.guard.good_step()
            if self.step % self.config.log_every == 0 or self.step == self.config.steps:
                pending = self.pending_record(loss, span, times)
                if not self.defer_records:
                    records.append(self.log_step(pending))
                    pending = None
            if self.maybe_evaluate():
                clock.restart()  # the evaluation is not the next step's time
            if self.maybe_checkpoint():
                clock.restart()  # the save is not the next step's time
            if self.guard.end_of_step(clock):
                break
        if pending is not None:
            records.append(self.log_step(pending))
        self.guard.finish()
        return records

    def pending_record(self, loss, span, times=None) -> PendingRecord:
        """What `log_step` will report about the step just queued, without waiting for it: its
        loss and norm as device tensors, and every rank's peak memory and step times being
        gathered (collective)."""
        nan = float("nan")
        values = [peak_memory_bytes(self.device)]
        values += [nan] * 4 if times is None else [
            times.data_s, nan if times.compute_s is None else times.compute_s,
            nan if times.comm_s is None else times.comm_s, times.bubble_s]
        mine = torch.tensor(values, dtype=torch.float64, device=self.device)
        peaks = [torch.empty_like(mine) for _ in range(self.world_size)]
        work = dist.all_gather(peaks, mine, async_op=True)
        step_plan = self.adaptive.last_plan if self.adaptive is not None else None
        return PendingRecord(step=self.step, loss=loss, grad_norm=self.grad_norm,
                             lr=self.schedulers[0].get_last_lr()[0], span=span, peaks=peaks, work=work,
                             step_plan=step_plan, moe=moe_step_stats(self.model_parts, self.plan, self.device),
                             rank_times_s=getattr(self, "_rank_times_s", None))

    def log_step(self, pending: PendingRecord) -> StepRecord:
        """Read and report one step (waits for that step only)."""
        pending.work.wait()
        elapsed = pending.span.seconds()
        tokens_per_s = self.plan.workload.tokens_per_step / elapsed
        gathered = [t.tolist() for t in pending.peaks]
        column = (lambda i: None if any(x[i] != x[i] for x in gathered) else [x[i] for x in gathered])  # NaN: not measured
        peak = peak_dtype(self.dtype, self.device.type)
        record = StepRecord(
            step=pending.step, loss=float(pending.loss), lr=pending.lr, grad_norm=float(pending.grad_norm),
            step_time_s=elapsed, tokens_per_s=tokens_per_s,
            mfu=model_flops_utilisation(self.plan, tokens_per_s, self.world_size, peak),
            peak_memory_bytes=[x[0] for x in gathered],
            predicted_step_time_s=self.plan.prediction.step_time_s if self.plan.prediction else None,
            data_s=column(1), compute_s=column(2), comm_s=column(3), bubble_s=column(4),
            rank_mfu=rank_mfu(self.plan, self.world_size, elapsed, self.plan.cluster.device.peak_flops.get(peak)),
            moe=pending.moe)
        if pending.step_plan is not None:
            record.predicted_step_time_s = pending.step_plan.predicted_time_s
            record.sp_groups = [[g.degree for g in mb.groups] for mb in pending.step_plan.micro_batches]
        times = pending.step_plan.unit_times() if pending.step_plan is not None else pending.rank_times_s
        if times:
            record.rank_time_max_s, record.rank_time_mean_s = max(times), sum(times) / len(times)
        if self.guard is not None:
            self.guard.observe(record)
        if self.rank == 0:
            log.info("step %d loss %.4f %.0f tok/s", record.step, record.loss, record.tokens_per_s)
            if self.metrics is not None:
                self.metrics.write(record)
            if self.redo:
                self._check_redone(record)
            if self.on_step is not None:
                self.on_step(record)
        return record

    # --- evaluation -------------------------------------------------------------------------------
    def maybe_evaluate(self) -> bool:
        """Evaluate when due (every `eval_every` steps and after the last); returns whether it did."""
        every = self.config.eval_every
        if not every or (self.step % every and self.step != self.config.steps):
            return False
        loss, tokens = self.evaluate()
        from .runs import perplexity

        if self.metrics is not None:
            self.metrics.write_eval(self.step, loss, perplexity(loss), tokens)
        self._event("eval", step=self.step, loss=loss, perplexity=perplexity(loss), tokens=tokens)
        return True

    @torch.no_grad()
    def evaluate(self) -> tuple[float, int]:
        """(mean cross-entropy in nats per target token, target tokens) over the first
        `eval_batches` global batches of the held-out split, the same batches every time."""
        if self.eval_loader is None:
            self.eval_loader = self.build_data("eval")
        total = torch.zeros(2, dtype=torch.float64, device=self.device)  # summed loss, targets
        for i in range(self.config.eval_batches):
            batch = self.eval_loader.batch_at(i * self.plan.workload.global_batch)
            total += self._eval_sums(batch)
        dist.all_reduce(total)
        self._reshard()
        return float(total[0] / total[1].clamp(min=1)), int(total[1])

    def _reshard(self) -> None:
        """Free the parameters a forward without backward left gathered (FSDP2 units that do not
        reshard after forward), so that the model's parameters are the optimizer's shards again."""
        from torch.distributed.fsdp import FSDPModule

        for part in self.model_parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def _eval_sums(self, batch) -> torch.Tensor:
        """This rank's (summed loss, targets) of one held-out batch, forward only."""
        from .parallel_model import IGNORE

        packed = getattr(batch, "packed", False)
        tokens, labels, positions, doc_ids = (self._to_device(t) for t in (
            batch.tokens, batch.labels, batch.positions if packed else None, batch.doc_ids if packed else None))
        targets = (labels != IGNORE).sum().double()
        if self.adaptive is not None:  # the whole batch on every rank: each rank takes its rows
            rows = self.adaptive.runner.evaluation_rows(len(tokens))
            logits = self.model_parts[0](tokens[rows], *(t[rows] if t is not None else None for t in (positions, doc_ids)))
            part = labels[rows]
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), part.flatten(),
                                                     ignore_index=IGNORE, reduction="sum")
            sums = torch.stack([loss.double(), (part != IGNORE).sum().double()])
            return sums if self.rank % self.adaptive.runner.tp == 0 else torch.zeros_like(sums)  # once per unit
        # The loss as the sum over this piece's targets, times pieces x micro-batches (ParallelLoss).
        scale = self.loss_fn.target_scale
        self.loss_fn.target_scale = self.loss_fn.pieces * self.plan.num_micro_batches
        try:
            self.loss_fn.real_seq_len = tokens.shape[1]
            tokens, labels, positions, doc_ids = pad_sequences(self.seq_multiple, tokens, labels, positions, doc_ids)
            if self.pipeline is not None:
                mean = self.pipeline.evaluate(tokens, labels, positions, doc_ids)  # None off the last stage
                loss = mean if mean is not None else torch.zeros((), dtype=torch.float64, device=self.device)
            else:
                loss = self._eval_forward(tokens, labels, positions, doc_ids)
        finally:
            self.loss_fn.target_scale = scale
        # Each rank's value is pieces x its piece's sum; the loss's pieces are held by
        # holders / pieces ranks each (the world, or a pipeline's last stage), so the all-reduced
        # sum is holders x the batch's sum. Each data block is held by world / data_size ranks.
        holders = self.world_size // self.plan.pipeline.degree if self.pipeline is not None else self.world_size
        return torch.stack([loss.double() / holders, targets * self.data_size / self.world_size])

    def _eval_forward(self, tokens, labels, positions, doc_ids) -> torch.Tensor:
        n = self.plan.num_micro_batches
        module = self.parallel.module
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        chunks = [t.chunk(n) if t is not None else [None] * n for t in (tokens, labels, positions, doc_ids)]
        for i in range(n):
            with self.loss_fn.context(), self.autocast:
                logits = module(chunks[0][i], chunks[2][i], chunks[3][i])
                loss = self.loss_fn(logits, chunks[1][i])
            total += _plain(loss).detach().double() / n
        return total

    # --- checkpoints ------------------------------------------------------------------------------
    def _checkpoint_manager(self, directory: str):
        from .checkpoint import CheckpointManager
        from .export import model_files

        return CheckpointManager(directory, keep=self.config.checkpoint_keep,
                                 model_files=model_files(self.plan.model.config, self.config.init_from))

    def extra_state(self) -> dict:
        """What a checkpoint holds beside the model and optimizer: step, LR schedule, data
        position and this rank's RNG states (tensors and plain values only)."""
        from .rng import rng_state

        state = {"step": self.step, "schedulers": [s.state_dict() for s in self.schedulers], "rng": rng_state()}
        if self.loader is not None and hasattr(self.loader, "state_dict"):
            state["data"] = self.loader.state_dict()
        return state

    def maybe_checkpoint(self) -> bool:
        """Save when due (only finite parameters, written in the background); returns whether it saved."""
        cfg = self.config
        every = cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0
        if cfg.checkpoint_dir and (every or (cfg.checkpoint_final and self.step == cfg.steps)):
            background = False
            if self.guard is not None:
                if not self.guard.save_checkpoint():
                    return False
                background = self.guard.manager.async_save
            else:
                self._checkpoint_manager(cfg.checkpoint_dir).save(self.step, self.model_parts, self.optimizers,
                                                                  self.extra_state())
            self._event("save", step=self.step, path=str(Path(cfg.checkpoint_dir) / f"step-{self.step}"),
                        asynchronous=background)
            return True
        return False

    def load_checkpoint(self, path, keep_data_position: bool = False) -> None:
        """Load checkpoint `path` (a `step-N` directory) into the model, optimizers, schedules, RNG and
        data position (kept as it is with `keep_data_position`: a rollback skips the bad batches)."""
        from .rng import restore_rng_state

        path = Path(path)
        manager = self._checkpoint_manager(str(path.parent))
        extra = manager.load(self.model_parts, self.optimizers, path=path)
        self.step = int(extra["step"])
        # The schedule depends on the step only; another plan may have other chunk counts.
        for sched in self.schedulers:
            sched.load_state_dict(extra["schedulers"][0])
        if extra.get("_own_rank") and "rng" in extra:
            restore_rng_state(extra["rng"])
        if not keep_data_position:
            self.loader = self.build_data()
            if "data" in extra and hasattr(self.loader, "load_state_dict"):
                self.loader.load_state_dict(extra["data"])
            self.data_iter = iter(self.loader)
        log.info("loaded %s: at step %d", path, self.step)

    # --- switching plans (stragglers) -------------------------------------------------------------
    def switch_plan(self, plan: Plan) -> str:
        """Run `plan` from the next step, losing none. When only the data shares (and device speeds)
        differ, the ranks take their new rows ("rebalanced"); otherwise the state goes through a DCP
        checkpoint, the model is rebuilt under the new plan and loads it ("resharded")."""
        check_plan_supported(plan, self.world_size, pipeline_available=_pipeline_available())
        same_layout = (plan.layers == self.plan.layers and plan.pipeline == self.plan.pipeline
                       and plan.num_micro_batches == self.plan.num_micro_batches)
        if same_layout:
            self.plan = plan
            self._reload_data()
            return "rebalanced"
        from .checkpoint import CheckpointManager

        where = Path(self.config.checkpoint_dir or Path(self.config.metrics_path or "runs").parent) / "replan"
        manager = CheckpointManager(where, keep=1)
        path = manager.save(self.step, self.model_parts, self.optimizers, self.extra_state())
        self.plan = plan
        self.dims = ParallelDims.from_plan(plan, self.world_size, self.device.type)
        self.build_model()
        self.build_optimizer()
        self.load_checkpoint(path, keep_data_position=True)
        self._reload_data()
        if self.pipeline is not None:
            from .steptime import hook_pipeline_waits

            hook_pipeline_waits()
        return "resharded"

    def _reload_data(self) -> None:
        """The data loader for the current plan (its rows per rank), at the same data position."""
        if self.loader is None:
            return
        state = self.loader.state_dict() if hasattr(self.loader, "state_dict") else None
        self.loader = self.build_data()
        if state is not None and hasattr(self.loader, "load_state_dict"):
            self.loader.load_state_dict(state)
        self.data_iter = iter(self.loader)
        self.eval_loader = None  # built again for the new rows when next needed

    def _after_resume(self, path: Path) -> None:
        """The metrics lines of steps after the checkpoint are dropped (the file holds each step
        once); their losses are kept to compare with the steps as computed again (`redone`)."""
        dropped = 0
        if self.metrics is not None:
            self.redo = self.metrics.losses_after(self.step)
            dropped = self.metrics.truncate_after(self.step)
        self._event("resume", step=self.step, path=str(path), dropped_lines=dropped)

    def _check_redone(self, record: StepRecord) -> None:
        """A step computed before a failure and again after the resume: once past the last such
        step, one `recomputed` event says whether the losses and gradient norms are the same, bit
        for bit (the norm is of the reduced gradients: it shows a different reduction order)."""
        before = self.redo.get(record.step)
        if before is not None:
            self.redone.append((record.step, before, (record.loss, record.grad_norm)))
        if record.step >= max(self.redo):
            same = all(a == b for _, a, b in self.redone)
            self.events.write("recomputed", record.step, steps=[s for s, _, _ in self.redone], identical=same,
                              losses_before=[a[0] for _, a, _ in self.redone],
                              losses_after=[b[0] for _, _, b in self.redone],
                              grad_norms_before=[a[1] for _, a, _ in self.redone],
                              grad_norms_after=[b[1] for _, _, b in self.redone])
            if not same:
                log.warning("steps %s computed again after the resume have other losses than before",
                            [s for s, a, b in self.redone if a != b])
            self.redo, self.redone = {}, []

    def _event(self, kind: str, **info) -> None:
        if self.rank == 0 and self.on_event is not None:
            self.on_event(kind, info)

    def close(self) -> None:
        if self.adaptive is not None:
            self.adaptive.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()


def _plain(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@dataclass
class SyntheticBatch:
    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None
    doc_ids: torch.Tensor | None = None
    packed: bool = False


class SyntheticLoader:
    """Seeded random token sequences: step k's global batch comes from a generator seeded (seed, k),
    each rank keeps its rows; the position is one integer, so resume is exact."""

    def __init__(self, vocab: int, seq_len: int, global_batch: int, dp_rank: int, dp_size: int, seed: int):
        self.vocab, self.seq_len, self.global_batch = vocab, seq_len, global_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.step = 0
        self.rows: slice | None = None  # uneven replica shares (Plan.batch_shares)

    @staticmethod
    def global_batch_at(vocab: int, seq_len: int, global_batch: int, seed: int, step: int):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        seqs = torch.randint(0, vocab, (global_batch, seq_len + 1), generator=gen)
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()

    def __iter__(self):
        return self

    def __next__(self) -> SyntheticBatch:
        batch = self.batch_at(self.samples_seen)
        self.step += 1
        return batch

    @property
    def samples_seen(self) -> int:
        return self.step * self.global_batch

    def batch_at(self, first_sample: int) -> SyntheticBatch:
        """This rank's rows of the global batch starting at `first_sample` (a multiple of the batch)."""
        step = first_sample // self.global_batch
        tokens, labels = self.global_batch_at(self.vocab, self.seq_len, self.global_batch, self.seed, step)
        rows = self.global_batch // self.dp_size
        mine = self.rows or slice(self.dp_rank * rows, (self.dp_rank + 1) * rows)
        return SyntheticBatch(tokens=tokens[mine], labels=labels[mine])

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
