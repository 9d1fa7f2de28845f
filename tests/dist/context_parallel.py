"""Context parallelism (ring attention) at 4 ranks on gloo against one process.

Attention alone (fp64): ring attention over cp = 4 (the world) and cp = 2 (two rings), and cp 2 x
Ulysses 2, outputs and the gradients of q, k, v against SDPA with the dense document-causal mask,
grouped-query heads, with and without packed documents.

Whole plans (fp32, packed documents, grouped-query attention): the initial weights bit for bit,
the logits of this rank's block, every parameter's gradient after the first step (1e-5
relative), then the losses of 3 AdamW steps (1e-5), for cp 4, cp 2 x dp 2 (DDP), cp 2 x dp 2
ZeRO-3, cp 2 x tp 2 (Megatron SP), cp 2 x Ulysses 2, cp 2 in a 2-stage pipeline, and a layer-wise
plan moving activations between context-parallel and other layouts.

Run by tests/test_context_parallel.py; rank 0 prints `CHECK <name> ok` per check.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from runtime_common import (LLAMA, OPTIM, STEPS, S, check_gradients, check_initial_weights,  # noqa: E402
                            make_plan, one_process_losses)

from tessera.models.attention import Documents  # noqa: E402
from tessera.models.transformer import CoreAttention, build_model  # noqa: E402
from tessera.runtime.context_parallel import ContextParallelAttention  # noqa: E402
from tessera.runtime.layout import ActLayout  # noqa: E402
from tessera.runtime.trainer import TrainConfig, Trainer  # noqa: E402

GLOBAL_BATCH, SEQ = 8, 32


def ok(name: str, good: bool, detail: str = "") -> None:
    if not good:
        raise AssertionError(f"rank {dist.get_rank()}: {name} failed {detail}")
    if dist.get_rank() == 0:
        print(f"CHECK {name} ok", flush=True)


def doc_ids_of(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths])


# --- attention alone ---------------------------------------------------------------------------


def check_attention(name: str, cp: int, sp: int, docs: torch.Tensor | None) -> None:
    """Ranks (c, s) = divmod(rank % (cp sp), sp) of a (cp, sp) layout hold the load-balanced
    block of the sequence; the same random q, k, v on every rank."""
    world = dist.get_world_size()
    gen = torch.Generator().manual_seed(7)
    b, h, hkv, seq, d = docs.shape[0] if docs is not None else 2, 4, 2, 48, 8
    q, grad_out = (torch.randn(b, h, seq, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, hkv, seq, d, generator=gen, dtype=torch.float64) for _ in range(2))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = CoreAttention()(*ref_in, Documents(docs, backend="dense") if docs is not None else None)
    (ref * grad_out).sum().backward()

    layout = ActLayout(dp=world // (cp * sp), sp=sp, tp=1, cp=cp)
    ranks = torch.arange(world).view(world // (cp * sp), cp, sp)
    cp_group = sp_group = None
    for d_ in range(ranks.shape[0]):  # every rank creates every group, in the same order
        for s_ in range(sp):
            g = dist.new_group(ranks[d_, :, s_].tolist())
            cp_group = g if dist.get_rank() in ranks[d_, :, s_].tolist() else cp_group
        for c_ in range(cp):
            if sp > 1:
                g = dist.new_group(ranks[d_, c_, :].tolist())
                sp_group = g if dist.get_rank() in ranks[d_, c_, :].tolist() else sp_group
    index = layout.seq_index(dist.get_rank(), seq)
    local = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
    out = ContextParallelAttention(cp_group, sp_group)(*local, Documents(docs) if docs is not None else None)
    (out * grad_out[:, :, index]).sum().backward()
    ok(f"{name}_output", torch.allclose(out, ref[:, :, index], atol=1e-12), f"{(out - ref[:, :, index]).abs().max()}")
    for label, mine, full in zip("qkv", local, ref_in):
        ok(f"{name}_grad_{label}", torch.allclose(mine.grad, full.grad[:, :, index], atol=1e-12),
           f"{(mine.grad - full.grad[:, :, index]).abs().max()}")


# --- whole plans --------------------------------------------------------------------------------


def packed_batches(steps: int = STEPS, seed: int = 3):
    """(tokens, labels, positions, doc_ids) global batches of rows packed with random documents
    (lengths 1 to 20, some crossing the load-balanced chunks), one row a single document."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        seqs = torch.randint(0, LLAMA.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=gen)
        rows = []
        for r in range(GLOBAL_BATCH):
            lens, left = [], SEQ
            while left and r:
                n = min(left, int(torch.randint(1, 21, (1,), generator=gen)))
                lens.append(n)
                left -= n
            rows.append(lens or [SEQ])
        doc_ids = doc_ids_of(rows)
        starts = torch.ones_like(doc_ids, dtype=torch.bool)
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        first = torch.cummax(torch.where(starts, torch.arange(SEQ), 0), dim=1).values
        positions = torch.arange(SEQ) - first
        out.append((seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous(), positions, doc_ids))
    return out


def check_logits(name: str, trainer: Trainer, batch) -> None:
    """The chunk's logits of this rank's block equal the one-process logits' block."""
    tokens, _, positions, doc_ids = batch
    with torch.no_grad():
        want = build_model(LLAMA, seed=0)(tokens, positions, doc_ids)
        local = [trainer.local_rows(t) for t in (tokens, positions, doc_ids)]
        got = trainer.parallel.chunk(*local)
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
    loss = trainer.parallel.loss
    want = loss.ctx.data_block(trainer.local_rows(want), loss.act)
    err = float((got - want).abs().max() / want.abs().max())
    if err > 1e-5:
        raise AssertionError(f"{name}: logits off by {err:.3e} (relative)")


def check_plan(name: str, plan, batches) -> None:
    trainer = Trainer(TrainConfig(plan=plan, steps=STEPS, optim=OPTIM, seed=0))
    check_initial_weights(name, trainer, LLAMA, batches[0])
    if trainer.parallel is not None:
        check_logits(name, trainer, batches[0])
    local = [[trainer.local_rows(t) for t in batch] for batch in batches]
    losses = [float(trainer.compute_gradients(*local[0]))]
    check_gradients(name, trainer, LLAMA, batches[0], 1e-5)
    trainer.optimizer_step()
    losses += [trainer.train_step(*b) for b in local[1:]]
    trainer.close()
    want = one_process_losses(LLAMA, OPTIM, batches)
    for step, (g, w) in enumerate(zip(losses, want)):
        if abs(g - w) > 1e-5 * abs(w):
            raise AssertionError(f"{name}: step {step} loss {g:.8f} != one-process {w:.8f}")
    ok(name, True)


def plans():
    n = len(make_plan(LLAMA, 4, S(dp=4)).layers)
    mixed = ([S(dp=4)] + [S(dp=2, cp=2, zero=3)] + [S(cp=4, recompute="full")]
             + [S(dp=2, tp=2, sp="megatron")] * (n - 4) + [S(dp=2, cp=2)])
    kw = dict(global_batch=GLOBAL_BATCH, seq_len=SEQ)
    return [
        ("cp4", make_plan(LLAMA, 4, S(cp=4), **kw)),
        ("cp2_dp2_ddp", make_plan(LLAMA, 4, S(dp=2, cp=2), **kw)),
        ("cp2_dp2_zero3_microbatch2", make_plan(LLAMA, 4, S(dp=2, cp=2, zero=3), num_micro_batches=2, **kw)),
        ("cp2_tp2_megatron_sp", make_plan(LLAMA, 4, S(cp=2, tp=2, sp="megatron", zero=1), **kw)),
        ("cp2_ulysses2_selective", make_plan(LLAMA, 4, S(cp=2, sp="ulysses", sp_degree=2, recompute="selective"),
                                             **kw)),
        ("cp2_pp2_1f1b", make_plan(LLAMA, 4, S(cp=2, zero=2), num_micro_batches=2, stages=((0, 3), (3, n)), **kw)),
        ("layerwise_dp4_cp2_cp4_tp2", make_plan(LLAMA, 4, mixed, **kw)),
    ]


def main() -> None:
    dist.init_process_group("gloo")
    docs = doc_ids_of([[5, 20, 23], [48], [10, 3, 1, 30, 4]])
    check_attention("ring_cp4_gqa", 4, 1, None)
    check_attention("ring_cp4_gqa_documents", 4, 1, docs)
    check_attention("ring_cp2_gqa_documents", 2, 1, docs)
    check_attention("ring_cp2_ulysses2_documents", 2, 2, docs)
    batches = packed_batches()
    for name, plan in plans():
        check_plan(name, plan, batches)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
