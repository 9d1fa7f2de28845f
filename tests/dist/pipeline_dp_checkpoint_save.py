"""4 ranks, pp=2 x dp=2 with FSDP2 on the dp axis: 1F1B, interleaved 1F1B and zero-bubble (per-block +
root fully_shard, and zero-bubble with one root fully_shard per chunk) give the single-process
losses. Then a pp=2 x dp=2 run saves a checkpoint after 3
steps into argv[1], which `pipeline_schedules.py` resumes at 2 ranks under other plans."""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from pipeline_checkpoint_common import (GLOBAL_BATCH, TINY_GPT2, TINY_LLAMA, close, global_batch, loss_fn,
                                        make_optimizer, make_plan, make_scheduler, reference_losses)
from tessera.models import build_model
from tessera.runtime.checkpoint import CheckpointManager
from tessera.runtime.pipeline import build_pipeline

STEPS = 4
SAVE_AT = 3


def check(name: str, ok: bool, detail: str = "") -> None:
    if not ok:
        raise SystemExit(f"CHECK {name} FAILED {detail}")
    if dist.get_rank() == 0:
        print(f"CHECK {name} ok", flush=True)


def main() -> None:
    ckpt_dir = sys.argv[1]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    dp_mesh = mesh["dp"]
    dp_rank, dp = dp_mesh.get_local_rank(), dp_mesh.size()
    rows = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)

    def root_fsdp(chunk, layer_ids):
        return fully_shard(chunk, mesh=dp_mesh)

    def block_fsdp(chunk, layer_ids):
        for block in chunk.layers.values():
            fully_shard(block, mesh=dp_mesh)
        return fully_shard(chunk, mesh=dp_mesh)

    def train(config, plan, parallelize, steps, start=0, manager=None):
        runner = build_pipeline(build_model(config, seed=0), plan, mesh, loss_fn, parallelize)
        opts = [make_optimizer(p.parameters()) for p in runner.model_parts]
        scheds = [make_scheduler(o) for o in opts]
        losses = []
        for step in range(start, steps):
            tokens, labels = global_batch(step)
            loss = runner.step(tokens[rows], labels[rows])
            for o, s in zip(opts, scheds):
                o.step()
                s.step()
                o.zero_grad()
            losses.append(runner.global_loss(loss))
            if manager is not None and step + 1 == SAVE_AT:
                manager.save(SAVE_AT, runner.model_parts, opts,
                             {"lr_scheduler": scheds[0].state_dict(), "data_step": SAVE_AT,
                              "rng": torch.get_rng_state()})
        return losses

    ref = reference_losses(TINY_LLAMA, STEPS)
    for schedule, virtual, parallelize in [("1f1b", 1, block_fsdp), ("interleaved_1f1b", 2, block_fsdp),
                                           ("zero_bubble", 1, root_fsdp)]:
        plan = make_plan(TINY_LLAMA, world=4, pp=2, schedule=schedule, virtual_stages=virtual, zero=3)
        losses = train(TINY_LLAMA, plan, parallelize, STEPS)
        check(f"pp2xdp2_fsdp_{schedule}_matches_single_process", close(losses, ref), f"{losses} vs {ref}")

    # Nested per-block sharding under the split backward (the stage gathers before each pass).
    plan = make_plan(TINY_LLAMA, world=4, pp=2, schedule="zero_bubble", zero=3)
    losses = train(TINY_LLAMA, plan, block_fsdp, STEPS)
    check("pp2xdp2_nested_fsdp_zero_bubble_matches_single_process", close(losses, ref), f"{losses} vs {ref}")

    # Tied GPT-2 under pp x FSDP: the head's copy is sharded like the embedding, grads summed.
    ref_gpt2 = reference_losses(TINY_GPT2, STEPS)
    plan = make_plan(TINY_GPT2, world=4, pp=2, schedule="gpipe", zero=3)
    losses = train(TINY_GPT2, plan, block_fsdp, STEPS)
    check("pp2xdp2_fsdp_tied_gpt2_matches_single_process", close(losses, ref_gpt2), f"{losses} vs {ref_gpt2}")

    # The trainer's pipeline with tensor + sequence parallel stages on packed documents.
    from pipeline_schedules import trainer_pipeline_runs_packed_documents
    from runtime_common import S

    trainer_pipeline_runs_packed_documents("trainer_pp2_tp2_sp_packed_documents", S(tp=2, sp="megatron"),
                                           stages=((0, 3), (3, 6)), schedule="1f1b")

    # The checkpoint that the 2-rank launch resumes: pp=2 x dp=2, FSDP2 per block, after 3 steps.
    manager = CheckpointManager(ckpt_dir, keep=2)
    plan = make_plan(TINY_LLAMA, world=4, pp=2, schedule="1f1b", zero=3)
    losses = train(TINY_LLAMA, plan, block_fsdp, SAVE_AT, manager=manager)
    check("pp2xdp2_checkpoint_saved", manager.latest() is not None and manager.latest().name == f"step-{SAVE_AT}"
          and close(losses, ref[:SAVE_AT]))
    gpt2_manager = CheckpointManager(f"{ckpt_dir}-gpt2", keep=2)
    plan = make_plan(TINY_GPT2, world=4, pp=2, schedule="1f1b", zero=3)
    train(TINY_GPT2, plan, block_fsdp, SAVE_AT, manager=gpt2_manager)
    check("pp2xdp2_tied_checkpoint_saved", gpt2_manager.latest() is not None)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
