"""Adaptive steps at 4 ranks on gloo equal a single-process run: every parameter's gradient after
the first step (1e-5 relative, fp32), then the losses of three AdamW steps, on sharded layouts
(ZeRO-3 over all, HSDP, TP inside the groups with ZeRO-3 and ZeRO-2) and a replicated one (DDP),
with steps that mix groups of 1, 2 and 4 units, idle ranks, a recompute per group, and phases that
switch the ZeRO working mode (3 -> 2 -> 1), hand-made and planned.

Run by tests/test_adaptive_varlen.py through torchrun; rank 0 prints `CHECK <name> ok`.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

import tessera.models.attention as doc_attention  # noqa: E402
from runtime_common import OPTIM, S, make_plan  # noqa: E402
from tessera.adapt.seqcost import cost_model_from_plan  # noqa: E402
from tessera.models.transformer import build_model  # noqa: E402
from tessera.plan import MicroBatchPlan, PhasePlan, SPGroupAssignment, StepPlan  # noqa: E402
from tessera.runtime.materialize import full_value_slice  # noqa: E402
from tessera.runtime.optim import build_optimizer, build_scheduler, clip_grad_norm_  # noqa: E402
from tessera.runtime.trainer import TrainConfig, Trainer  # noqa: E402
from tessera.runtime.varlen import IGNORE_INDEX, pack_group  # noqa: E402
from tessera.spec.model import TransformerConfig  # noqa: E402

CONFIG = TransformerConfig(name="tiny-varlen", hidden=64, num_layers=2, num_heads=4, num_kv_heads=2,
                           ffn_hidden=96, vocab_size=101, max_seq_len=64)
STEP_LENS = [[9, 5, 12, 3, 7, 4, 10], [14, 2, 6, 8, 11], [7, 7, 13, 1, 5, 9]]
SEED = 7


def check(name: str, ok: bool, detail: str = "") -> None:
    if not ok:
        raise AssertionError(f"rank {dist.get_rank()}: check {name} failed {detail}")
    if dist.get_rank() == 0:
        print(f"CHECK {name} ok", flush=True)


def make_samples(lens, seed: int):
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for n in lens:
        x = torch.randint(0, CONFIG.vocab_size, (n,), generator=gen)
        y = torch.randint(0, CONFIG.vocab_size, (n,), generator=gen)
        y[torch.rand(n, generator=gen) < 0.2] = IGNORE_INDEX  # some targets ignored
        samples.append((x, y))
    return samples


STEPS = [make_samples(lens, 1 + k) for k, lens in enumerate(STEP_LENS)]


def one_process_loss(model, samples):
    """Each document alone (causal, positions from 0); sum of token losses / targets."""
    total = sum(int((y != IGNORE_INDEX).sum()) for _, y in samples)
    return sum(F.cross_entropy(model(x[None]).flatten(0, 1), y, ignore_index=IGNORE_INDEX, reduction="sum")
               for x, y in samples) / total


def reference():
    """The first step's gradients, then the losses of every step (the trainer's AdamW and clipping)."""
    model = build_model(CONFIG, seed=SEED)
    opt = build_optimizer(model.parameters(), OPTIM)
    sched = build_scheduler(opt, OPTIM)
    grads, losses = None, []
    for samples in STEPS:
        loss = one_process_loss(model, samples)
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        clip_grad_norm_(list(model.parameters()), OPTIM.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return grads, losses


def compare_gradients(name: str, trainer: Trainer, want: dict) -> None:
    floor = 1e-3 * max(float(g.abs().max()) for g in want.values())
    worst = 0.0
    for n, p in trainer.named_parameters():
        g = p.grad
        local = (g.to_local() if hasattr(g, "to_local") else g).detach()
        ref = full_value_slice(want[n], g)
        err = float((local - ref).abs().max()) if ref.numel() else 0.0
        worst = max(worst, err / max(float(want[n].abs().max()), floor))
    check(f"{name}_grads", worst < 1e-5, f"worst relative error {worst:.2e}")


def group(ranks, seqs, recompute=None):
    return SPGroupAssignment(ranks=tuple(ranks), sequences=tuple(seqs), recompute=recompute)


def mixed_plan(tp: int) -> StepPlan:
    """Phases in working modes 3, 2, 1; groups of 1, 2 and 4 units (of tp ranks); a recompute per
    group; idle units."""
    u = lambda *units: [r for k in units for r in range(k * tp, (k + 1) * tp)]  # noqa: E731
    units = 4 // tp
    if units == 4:
        first = (group(u(0, 1), [0, 2], "selective"), group(u(2), [1, 3], "none"), group(u(3), [4], "full"))
        second = (group(u(0, 1, 2, 3), [6, 5], "selective"),)
        third = (group(u(0, 1), [], None), group(u(2), [], None), group(u(3), [], "full"))
    else:
        first = (group(u(0, 1), [0, 2], "selective"),)
        second = (group(u(0), [6, 5, 1], "full"), group(u(1), [3, 4], "none"))
        third = (group(u(0), [], None), group(u(1), [], None))
    return StepPlan(step=0, seq_lens=tuple(STEP_LENS[0]), tp=tp, phases=(
        PhasePlan(zero=3, micro_batches=(MicroBatchPlan(groups=first),)),
        PhasePlan(zero=2, micro_batches=(MicroBatchPlan(groups=second), MicroBatchPlan(groups=third))),
        PhasePlan(zero=1, micro_batches=(MicroBatchPlan(groups=third),)),
    ))


def tight_cluster(plan, tokens_per_device: float):
    """The plan's cluster with just enough memory for `tokens_per_device` tokens of activations
    beside the model states (under the strategy that holds the most): longer documents need
    sequence parallelism."""
    cluster = plan.cluster
    lo, hi = 0.0, cluster.device.memory_bytes
    for _ in range(60):
        mid = (lo + hi) / 2
        trial = cluster.model_copy(update={"device": cluster.device.model_copy(update={"memory_bytes": mid})})
        cap = max(c.cap_tokens[0] for c in cost_model_from_plan(plan.model_copy(update={"cluster": trial}), True))
        lo, hi = (mid, hi) if cap < tokens_per_device else (lo, mid)
    return cluster.model_copy(update={"device": cluster.device.model_copy(update={"memory_bytes": hi})})


def run_layout(name: str, plan, want_grads, want_losses) -> None:
    plan = plan.model_copy(update={"cluster": tight_cluster(plan, 8.5)})
    trainer = Trainer(TrainConfig(plan=plan, steps=len(STEPS), optim=OPTIM, seed=SEED, adaptive=True))
    runner = trainer.adaptive.runner
    tp = runner.tp
    # Hand-made: every working mode, recompute and group size; then the planner's own plan.
    runner.forward_backward(mixed_plan(tp), STEPS[0])
    compare_gradients(f"{name}_mixed_step", trainer, want_grads)
    for p in trainer.params:
        p.grad = None
    lens = STEP_LENS[0]
    runner.prefetch(0, lens)
    planned = runner.plan(0, lens)
    texts = [None] * dist.get_world_size()
    dist.all_gather_object(texts, planned.model_dump_json())
    check(f"{name}_plan_same_on_all_ranks", len(set(texts)) == 1)
    degrees = {len(g.ranks) // tp for mb in planned.micro_batches for g in mb.groups if g.sequences}
    check(f"{name}_plan_uses_sequence_parallel", max(degrees) >= 2, f"degrees {degrees}")
    loss = runner.forward_backward(planned, STEPS[0])
    compare_gradients(f"{name}_planned_step", trainer, want_grads)
    losses = [loss]
    trainer.optimizer_step()
    for k, samples in enumerate(STEPS[1:], start=1):
        lens = [int(x.numel()) for x, _ in samples]
        losses.append(runner.forward_backward(runner.plan(k, lens), samples))
        trainer.optimizer_step()
    ok = all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, want_losses))
    check(f"{name}_losses", ok, f"{losses} vs {want_losses}")
    trainer.close()


def check_balanced_loader(tmp: str) -> None:
    """A static ZeRO-3 plan on real packed data with the balanced loader: each rank's rows are the
    balancer's (not the contiguous block), and the gradients equal one process on the global batch."""
    import numpy as np

    from tessera.runtime.data import build_dataloader
    from tessera.runtime.tokenizer import EOT_ID

    config = CONFIG.model_copy(update={"name": "tiny-balanced", "vocab_size": EOT_ID + 1, "hidden": 32,
                                       "num_layers": 1, "ffn_hidden": 48})
    if dist.get_rank() == 0:
        rng = np.random.default_rng(0)
        parts = []
        for k in range(300):
            n = int(rng.integers(40, 64)) if (k // 12) % 3 == 0 else int(rng.integers(2, 8))
            parts += [EOT_ID] + rng.integers(0, 1000, n).tolist()
        np.save(os.path.join(tmp, "docs.npy"), np.array(parts, dtype=np.int64))
    dist.barrier()
    plan = make_plan(config, 4, S(dp=4, zero=3), num_micro_batches=2, global_batch=16, seq_len=64)
    trainer = Trainer(TrainConfig(plan=plan, steps=1, optim=OPTIM, seed=SEED, data=tmp))
    batch = next(trainer.build_data())
    whole = build_dataloader(tmp, 64, 16, 0, 1, seed=SEED).batch_at(0)
    contiguous = whole.tokens[dist.get_rank() * 4:(dist.get_rank() + 1) * 4]
    moved = torch.tensor([not torch.equal(batch.tokens, contiguous)])
    dist.all_reduce(moved)
    check("balanced_loader_moves_rows", bool(moved.item()) and max(batch.rank_times_s) > 0)
    trainer.compute_gradients(batch.tokens, batch.labels, batch.positions, batch.doc_ids, batch.num_targets)
    model = build_model(config, seed=SEED)
    logits = model(whole.tokens, whole.positions, whole.doc_ids)
    F.cross_entropy(logits.flatten(0, 1), whole.labels.flatten()).backward()
    compare_gradients("balanced_loader", trainer, {n: p.grad for n, p in model.named_parameters()})
    trainer.close()


def no_dense_mask(doc_ids):
    raise AssertionError(f"a dense {tuple(doc_ids.shape)} document mask was built")


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    # Packed groups carry doc ids of the whole packed sequence (padding is one more document),
    # and attention never builds the dense S x S mask.
    shard = pack_group([STEPS[0][0], STEPS[0][1]], 4, 1)  # 9 + 5 tokens, padded to 16
    check("pack_group_doc_ids", shard.doc_ids.tolist() == [[0] * 9 + [1] * 5 + [2] * 2]
          and shard.tokens.shape == (1, 4) and shard.positions.tolist() == [[4, 5, 6, 7]])
    doc_attention.document_causal_mask = no_dense_mask
    want_grads, want_losses = reference()
    layouts = [
        ("zero3_dp4", make_plan(CONFIG, 4, S(dp=4, zero=3, recompute="selective"))),
        ("hsdp_shard2", make_plan(CONFIG, 4, S(dp=4, zero=3, dp_shard=2))),
        ("tp2_zero3", make_plan(CONFIG, 4, S(dp=2, tp=2, zero=3))),
        # Megatron SP's plan runs its TP plain (Ulysses shards the sequence), ZeRO-2 as the default mode.
        ("tp2_plan_megatron_sp_zero2", make_plan(CONFIG, 4, S(dp=2, tp=2, zero=2, sp="megatron"))),
        ("replicated_ddp", make_plan(CONFIG, 4, S(dp=4))),
    ]
    for name, plan in layouts:
        run_layout(name, plan, want_grads, want_losses)
    check_balanced_loader(sys.argv[1])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
