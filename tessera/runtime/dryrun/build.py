"""Build one rank of a plan with the trainer's own code, without its process group or data.

`rank_trainer(plan, rank)` returns a `Trainer` built by `Trainer.on_process_group` on the
caller's (fake) process group: the same `build_model` / `build_optimizer` as training (so
`ParallelDims`, `parallelize` and `build_pipeline` apply the plan exactly as in training) and
`train_step` is the training step. The working dtype is the plan's, as on an accelerator (bf16
through FSDP2's MixedPrecisionPolicy, or autocast on the DDP path), not the fp32 a CPU run uses.

Inside `world.fake_execution` every tensor the trainer creates is fake (any model size);
outside, real (a small model; only the rank's shards are allocated).
"""
from __future__ import annotations

import torch

from ...errors import TesseraError
from ...plan import Plan
from ..mesh import ParallelDims
from ..optim import OptimConfig
from ..parallelize import check_plan_supported
from ..trainer import TrainConfig, Trainer


def rank_trainer(plan: Plan, rank: int) -> Trainer:
    """A Trainer for `rank` of the plan's world, built inside an initialised (fake) process group."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() != plan.world_size or dist.get_rank() != rank:
        raise TesseraError(f"rank_trainer needs a process group of {plan.world_size} ranks in which it is rank {rank}")
    check_plan_supported(plan, plan.world_size, pipeline_available=True)
    # Meshes are built for the accelerator's device type only in name: the fake backend serves both.
    config = TrainConfig(plan=plan, steps=2, optim=OptimConfig(warmup_steps=1, total_steps=2))
    trainer = Trainer.on_process_group(config, torch.device("cpu"), plan.workload.dtype)
    return trainer


def step_batch(trainer: Trainer, fake: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels of one step for this rank's data block (random ids, or fake ones)."""
    plan = trainer.plan
    rows = plan.workload.global_batch // trainer.data_size
    shape = (rows, plan.workload.seq_len)
    if fake:
        tokens = torch.empty(shape, dtype=torch.long)
        return tokens, tokens
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, plan.model.config.vocab_size, shape, generator=gen)
    return tokens, torch.roll(tokens, -1, dims=1)
