"""2 ranks, pp=2: every schedule (GPipe, 1F1B, interleaved 1F1B with 4 chunks, zero-bubble) and a
tied-embedding GPT-2 give the single-process losses over 4 AdamW steps; then, when a checkpoint
directory is given, resume there under other plans (see `checkpoint_resume` below)."""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from pipeline_checkpoint_common import (TINY_GPT2, TINY_LLAMA, close, global_batch, loss_fn, make_optimizer,
                                        make_plan, make_scheduler, reference_losses)
from tessera.models import build_model
from tessera.runtime.pipeline import build_pipeline

STEPS = 4


def check(name: str, ok: bool, detail: str = "") -> None:
    if not ok:
        raise SystemExit(f"CHECK {name} FAILED {detail}")
    if dist.get_rank() == 0:
        print(f"CHECK {name} ok", flush=True)


def train_pipeline(config, plan, mesh, steps, parallelize_chunk=None):
    runner = build_pipeline(build_model(config, seed=0), plan, mesh, loss_fn, parallelize_chunk)
    opts = [make_optimizer(p.parameters()) for p in runner.model_parts]
    scheds = [make_scheduler(o) for o in opts]
    losses = []
    for step in range(steps):
        tokens, labels = global_batch(step)
        loss = runner.step(tokens, labels)
        for o, s in zip(opts, scheds):
            o.step()
            s.step()
            o.zero_grad()
        losses.append(runner.global_loss(loss))
    return losses


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    ref = {c.name: reference_losses(c, STEPS) for c in (TINY_LLAMA, TINY_GPT2)}
    for schedule, virtual in [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1)]:
        plan = make_plan(TINY_LLAMA, world=2, pp=2, schedule=schedule, virtual_stages=virtual)
        losses = train_pipeline(TINY_LLAMA, plan, mesh, STEPS)
        check(f"pp2_{schedule}_matches_single_process", close(losses, ref[TINY_LLAMA.name]),
              f"{losses} vs {ref[TINY_LLAMA.name]}")
    plan = make_plan(TINY_GPT2, world=2, pp=2, schedule="1f1b")
    losses = train_pipeline(TINY_GPT2, plan, mesh, STEPS)
    check("pp2_tied_gpt2_matches_single_process", close(losses, ref[TINY_GPT2.name]),
          f"{losses} vs {ref[TINY_GPT2.name]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
