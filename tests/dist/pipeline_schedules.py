"""2 ranks, pp=2: every schedule (GPipe, 1F1B, interleaved 1F1B with 4 chunks, zero-bubble) and a
tied-embedding GPT-2 give the single-process losses over 4 AdamW steps. Then, when a checkpoint
directory is given (written at 4 ranks by `pipeline_dp_checkpoint_save.py`, pp=2 x dp=2 FSDP2),
resume it here under other plans (dp=2 FSDP2, pp=2, interleaved pp=2, tp=2, DDP+ZeRO-1) from a differently initialised model:
the next losses equal those of the uninterrupted single-process run."""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from pipeline_checkpoint_common import (LR, TINY_GPT2, TINY_LLAMA, close, global_batch, loss_fn, make_optimizer,
                                        make_plan, make_scheduler, packed_documents, reference_losses)
from tessera.models import build_model
from tessera.models.attention import Documents
from tessera.runtime.checkpoint import CheckpointManager
from tessera.runtime.pipeline import build_pipeline

STEPS = 4
SAVE_AT, RESUME_TO = 3, 6


def check(name: str, ok: bool, detail: str = "") -> None:
    if not ok:
        raise SystemExit(f"CHECK {name} FAILED {detail}")
    if dist.get_rank() == 0:
        print(f"CHECK {name} ok", flush=True)


def train_pipeline(config, plan, mesh, steps, parallelize_chunk=None, packed=False):
    runner = build_pipeline(build_model(config, seed=0), plan, mesh, loss_fn, parallelize_chunk)
    opts = [make_optimizer(p.parameters()) for p in runner.model_parts]
    scheds = [make_scheduler(o) for o in opts]
    losses = []
    for step in range(steps):
        tokens, labels = global_batch(step)
        positions, doc_ids = packed_documents(step) if packed else (None, None)
        loss = runner.step(tokens, labels, positions, doc_ids)
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
    # Packed documents: positions and document ids reach every stage (reference: the dense mask).
    ref_packed = reference_losses(TINY_LLAMA, STEPS, packed=True)
    for schedule, virtual in [("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1)]:
        plan = make_plan(TINY_LLAMA, world=2, pp=2, schedule=schedule, virtual_stages=virtual)
        losses = train_pipeline(TINY_LLAMA, plan, mesh, STEPS, packed=True)
        check(f"pp2_{schedule}_packed_documents_match_single_process", close(losses, ref_packed),
              f"{losses} vs {ref_packed}")
    plan = make_plan(TINY_GPT2, world=2, pp=2, schedule="1f1b")
    losses = train_pipeline(TINY_GPT2, plan, mesh, STEPS)
    check("pp2_tied_gpt2_matches_single_process", close(losses, ref[TINY_GPT2.name]),
          f"{losses} vs {ref[TINY_GPT2.name]}")
    trainer_pipeline_runs_packed_documents()
    if len(sys.argv) > 1:
        resume_under_other_plans(sys.argv[1])
    dist.destroy_process_group()


def trainer_pipeline_runs_packed_documents(name: str = "trainer_pp2_interleaved_packed_documents",
                                           strategy=None, stages=((0, 2), (2, 3), (3, 5), (5, 6)),
                                           schedule: str = "interleaved_1f1b") -> None:
    """The trainer's pipeline path with packed documents (positions restart, document ids) equals
    one process with the trainer's optimizer, warm-up and clipping, attending with the dense mask."""
    from runtime_common import LLAMA, OPTIM, S, one_process_losses
    from runtime_common import make_plan as runtime_plan
    from tessera.runtime.trainer import TrainConfig, Trainer

    batches = [(*global_batch(step), *packed_documents(step)) for step in range(3)]
    want = one_process_losses(LLAMA, OPTIM, [(t, l, p, Documents(d, backend="dense")) for t, l, p, d in batches])
    plan = runtime_plan(LLAMA, dist.get_world_size(), strategy or S(), num_micro_batches=2, schedule=schedule,
                        stages=stages)
    trainer = Trainer(TrainConfig(plan=plan, steps=3, optim=OPTIM, seed=0))
    got = [trainer.train_step(*batch) for batch in batches]
    trainer.close()
    check(f"{name}_match_single_process", close(got, want), f"{got} vs {want}")


def _tp_blocks(model, tp_mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    layout = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
              "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
              "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
              "feed_forward.w2": RowwiseParallel()}
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, layout)
    return model


def _fsdp(model, dp_mesh):
    from torch.distributed.fsdp import fully_shard

    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh)
    return fully_shard(model, mesh=dp_mesh)


def resume_under_other_plans(ckpt_dir: str) -> None:
    """Resume the 4-rank pp=2 x dp=2 checkpoints at 2 ranks under other plans: FSDP2, pipelines
    (one optimizer per chunk, or one for all chunks), tensor parallel, DDP with ZeRO-1."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    for config, directory in ((TINY_LLAMA, ckpt_dir), (TINY_GPT2, f"{ckpt_dir}-gpt2")):
        ref = reference_losses(config, RESUME_TO)[SAVE_AT:]
        manager = CheckpointManager(directory)
        for layout in ("dp2_fsdp", "pp2", "pp2_interleaved_one_optimizer", "tp2"):
            if layout == "tp2" and config.tie_embeddings:
                continue
            model = build_model(config, seed=123)  # different weights: everything must come from the checkpoint
            if layout.startswith("pp2"):
                interleaved = layout != "pp2"
                plan = make_plan(config, world=2, pp=2, schedule="interleaved_1f1b" if interleaved else "1f1b",
                                 virtual_stages=2 if interleaved else 1)
                mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
                runner = build_pipeline(model, plan, mesh, loss_fn)
                parts = runner.model_parts
                # The trainer's way: one optimizer over all of a rank's chunks.
                opts = ([make_optimizer([p for part in parts for p in part.parameters()])] if interleaved
                        else [make_optimizer(p.parameters()) for p in parts])

                def step_fn(tokens, labels, runner=runner):
                    return runner.global_loss(runner.step(tokens, labels))
            else:
                name = layout[:2]
                mesh = init_device_mesh("cpu", (2,), mesh_dim_names=(name,))
                parts = [_fsdp(model, mesh) if name == "dp" else _tp_blocks(model, mesh)]
                opts = [make_optimizer(parts[0].parameters())]

                def step_fn(tokens, labels, model=parts[0], name=name):
                    if name == "dp":
                        tokens, labels = tokens[rows], labels[rows]
                    loss = loss_fn(model(tokens), labels)
                    loss.backward()
                    value = loss.detach().clone()
                    dist.all_reduce(value)
                    return float(value) / world
            scheds = [make_scheduler(o) for o in opts]
            extra = manager.load(parts, opts)
            for s in scheds:
                s.load_state_dict(extra["lr_scheduler"])
            losses = []
            for step in range(extra["data_step"], RESUME_TO):
                losses.append(step_fn(*global_batch(step)))
                for o, s in zip(opts, scheds):
                    o.step()
                    s.step()
                    o.zero_grad()
            check(f"resume_{config.name}_pp2xdp2_at_4_ranks_as_{layout}_at_2_ranks", close(losses, ref),
                  f"{losses} vs {ref}")
    zero1_resume_save_and_resume_plain(ckpt_dir)
    async_save_while_training(f"{ckpt_dir}-async")
    refuse_corrupt_checkpoint(ckpt_dir)


def async_save_while_training(directory: str) -> None:
    """FSDP2 at 2 ranks: an asynchronous save holds the weights of the step it was called at,
    although training goes on before it finishes; the next save finishes it (manifest, rename)."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    rank = dist.get_rank()
    rows = slice(rank * 4, rank * 4 + 4)

    def fresh(seed):
        model = _fsdp(build_model(TINY_LLAMA, seed=seed), mesh)
        return model, make_optimizer(model.parameters())

    def train_one(model, opt, step):
        tokens, labels = global_batch(step)
        loss_fn(model(tokens[rows]), labels[rows]).backward()
        opt.step()
        opt.zero_grad()

    if rank == 0:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
    dist.barrier()
    model, opt = fresh(0)
    manager = CheckpointManager(directory, async_save=True)
    train_one(model, opt, 0)
    manager.save(1, [model], opt, {"data_step": 1})
    snapshot = [p.full_tensor().clone() for p in model.parameters()]
    # save() handed the write to the background (whether it is still running here depends on how
    # fast this machine writes: checking that made the test flaky once saves got faster).
    pending = manager._pending is not None
    train_one(model, opt, 1)
    manager.save(2, [model], opt, {"data_step": 2})
    manager.wait()
    names = [p.name for p in manager.checkpoints()]
    restored, restored_opt = fresh(7)
    extra = manager.load([restored], restored_opt, path=manager.directory / "step-1")
    same = all(torch.equal(a, b.full_tensor()) for a, b in zip(snapshot, restored.parameters()))
    check("async_save_keeps_the_weights_of_its_step", pending and names == ["step-1", "step-2"] and same
          and extra["data_step"] == 1, f"{pending} {names} {same}")


def zero1_resume_save_and_resume_plain(ckpt_dir: str) -> None:
    """DDP + ZeRO-1 resumes the pp x dp checkpoint, trains, and saves its sharded optimizer state
    (each rank the share it owns); a plain single-model AdamW then resumes that checkpoint."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    world, rank = dist.get_world_size(), dist.get_rank()
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    ref = reference_losses(TINY_LLAMA, RESUME_TO + 2)
    model = DistributedDataParallel(build_model(TINY_LLAMA, seed=123))
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR,
                                  weight_decay=0.1, betas=(0.9, 0.95))
    sched = make_scheduler(opt)
    extra = CheckpointManager(ckpt_dir).load([model], opt)
    sched.load_state_dict(extra["lr_scheduler"])
    losses = []
    for step in range(extra["data_step"], RESUME_TO):
        tokens, labels = global_batch(step)
        loss = loss_fn(model(tokens[rows]), labels[rows])
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(float(value) / world)
    check("resume_test-llama_pp2xdp2_at_4_ranks_as_dp2_ddp_zero1_at_2_ranks", close(losses, ref[SAVE_AT:RESUME_TO]),
          f"{losses} vs {ref[SAVE_AT:RESUME_TO]}")
    manager = CheckpointManager(f"{ckpt_dir}-zero1")
    manager.save(RESUME_TO, [model], opt, {"lr_scheduler": sched.state_dict(), "data_step": RESUME_TO})
    plain = build_model(TINY_LLAMA, seed=5)
    plain_opt = make_optimizer(plain.parameters())
    plain_sched = make_scheduler(plain_opt)
    plain_sched.load_state_dict(manager.load([plain], plain_opt)["lr_scheduler"])
    losses = []
    for step in (RESUME_TO, RESUME_TO + 1):  # the second loss shows the optimizer state was restored
        tokens, labels = global_batch(step)
        loss = loss_fn(plain(tokens), labels)
        loss.backward()
        plain_opt.step()
        plain_sched.step()
        plain_opt.zero_grad()
        losses.append(loss.item())
    check("zero1_checkpoint_resumes_as_one_process", close(losses, ref[RESUME_TO:]), f"{losses} vs {ref[RESUME_TO:]}")


def refuse_corrupt_checkpoint(ckpt_dir: str) -> None:
    """A truncated file that rank 1 hashes: every rank raises the same one-line error, the model
    keeps its weights, and the file is left as it was."""
    import shutil
    from pathlib import Path

    from tessera.errors import TesseraError

    corrupt = Path(f"{ckpt_dir}-corrupt")
    victim = corrupt / "step-3" / "__0_0.distcp"  # sorted files: rank 1 checks the 2nd, 4th, ...
    if dist.get_rank() == 0:
        shutil.rmtree(corrupt, ignore_errors=True)
        shutil.copytree(ckpt_dir, corrupt)
        size = victim.stat().st_size
        with open(victim, "r+b") as f:
            f.truncate(size - 100)
    dist.barrier()
    model = build_model(TINY_LLAMA, seed=9)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        CheckpointManager(corrupt).load([model], [make_optimizer(model.parameters())])
        message = ""
    except TesseraError as e:
        message = str(e)
    messages = [None, None]
    dist.all_gather_object(messages, message)
    size = victim.stat().st_size
    expected = f"checkpoint {corrupt / 'step-3'} is corrupt: file __0_0.distcp has {size} bytes, manifest says {size + 100}"
    check("corrupt_checkpoint_refused_alike_on_every_rank", messages == [expected, expected], f"{messages}")
    check("corrupt_checkpoint_leaves_model_untouched",
          all(torch.equal(a, b) for a, b in zip(before, model.parameters())))


if __name__ == "__main__":
    main()
