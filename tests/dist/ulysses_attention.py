"""Ulysses attention at 2 ranks on gloo equals single-process attention, outputs and gradients.

Packed documents travel as doc ids over the full sequence; the reference is SDPA with the dense
document-causal mask.

Run by tests/test_ulysses_attention.py through torchrun; rank 0 prints `CHECK <name> ok`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessera.models.attention import Documents
from tessera.models.transformer import CoreAttention, build_model
from tessera.runtime.attention import UlyssesAttention, kv_repeats
from tessera.spec.model import TransformerConfig


def check(name: str, ok: bool, detail: str = "") -> None:
    if not ok:
        raise AssertionError(f"rank {dist.get_rank()}: check {name} failed {detail}")
    if dist.get_rank() == 0:
        print(f"CHECK {name} ok", flush=True)


def doc_ids_of(rows: list[list[int]]) -> torch.Tensor:
    """(B, S) document ids of rows packed with documents of the given lengths."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)) for lens in rows])


def compare_attention(name: str, module, group_rank: int, size: int, heads: int, kv_heads: int,
                      seq: int, docs=None, seed: int = 0, backend: str | None = None) -> None:
    """Same random q, k, v on every rank; this rank feeds its sequence slice to `module`, with the
    doc ids (B, S) of the full sequence. The reference is the dense document-causal mask.
    backend="flex" checks the forward only (flex_attention has no CPU backward)."""
    gen = torch.Generator().manual_seed(seed)
    b, d = 2, 8
    q = torch.randn(b, heads, seq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, kv_heads, seq, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, kv_heads, seq, d, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(b, heads, seq, d, generator=gen, dtype=torch.float64)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = CoreAttention()(*ref_in, Documents(docs, backend="dense") if docs is not None else None)
    (ref * grad_out).sum().backward()

    part = slice(group_rank * seq // size, (group_rank + 1) * seq // size)
    local = [t[:, :, part].clone().requires_grad_(backend != "flex") for t in (q, k, v)]
    out = module(*local, Documents(docs, backend=backend) if docs is not None else None)
    if backend == "flex":
        check(f"{name}_output", torch.allclose(out, ref[:, :, part], atol=1e-10),
              f"{(out - ref[:, :, part]).abs().max()}")
        return
    (out * grad_out[:, :, part]).sum().backward()
    check(f"{name}_output", torch.allclose(out, ref[:, :, part], atol=1e-10), f"{(out - ref[:, :, part]).abs().max()}")
    for label, mine, full in zip("qkv", local, ref_in):
        check(f"{name}_grad_{label}", torch.allclose(mine.grad, full.grad[:, :, part], atol=1e-10),
              f"{(mine.grad - full.grad[:, :, part]).abs().max()}")


def check_model(rank: int, world: int, doc_lens=None, label: str = "model") -> None:
    """A tiny LLaMA with its attention cores replaced: logits and (summed) gradients are exact.
    With `doc_lens`, rows are packed documents: the sharded model gets the doc ids of the full
    sequence and its positions slice; the reference runs the dense document-causal mask."""
    config = TransformerConfig(name="t", hidden=64, num_layers=2, num_heads=4, num_kv_heads=2,
                               ffn_hidden=96, vocab_size=101, max_seq_len=64)
    ref_model = build_model(config, seed=3)
    model = build_model(config, seed=3)
    for block in model.layers.values():
        block.attention.core = UlyssesAttention(None)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 101, (2, 16), generator=gen)
    targets = torch.randint(0, 101, (2, 16), generator=gen)
    doc_ids = doc_ids_of(doc_lens) if doc_lens is not None else None
    if doc_ids is None:
        positions = torch.arange(16).expand(2, -1)
        ref_logits = ref_model(tokens)
    else:
        first = torch.cummax(torch.where(torch.diff(doc_ids, prepend=doc_ids[:, :1] - 1) != 0,
                                         torch.arange(16), 0), dim=1).values
        positions = torch.arange(16) - first
        ref_logits = ref_model(tokens, positions, Documents(doc_ids, backend="dense"))
    F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten(), reduction="sum").backward()

    part = slice(rank * 16 // world, (rank + 1) * 16 // world)
    logits = model(tokens[:, part], positions=positions[:, part], doc_ids=doc_ids)
    F.cross_entropy(logits.flatten(0, 1), targets[:, part].flatten(), reduction="sum").backward()
    check(f"{label}_logits", torch.allclose(logits, ref_logits[:, part], atol=1e-5),
          f"{(logits - ref_logits[:, part]).abs().max()}")
    worst = 0.0
    for (name, p), ref_p in zip(model.named_parameters(), ref_model.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)  # sequence shards hold partial sums of the weight gradients
        worst = max(worst, ((grad - ref_p.grad).abs().max() / ref_p.grad.abs().max().clamp_min(1e-12)).item())
    check(f"{label}_grads", worst < 1e-5, f"max relative diff {worst}")


def packed_batches(steps: int, rows: int, seq: int, vocab: int):
    """(tokens, labels, positions, doc_ids) per step; rows hold 1 to 5 documents at seeded cuts."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        seqs = torch.randint(0, vocab, (rows, seq + 1), generator=gen)
        starts = torch.rand(rows, seq, generator=gen) < torch.linspace(0.0, 0.3, rows)[:, None]
        starts[:, 0] = True
        doc_ids = torch.cumsum(starts, 1) - 1
        idx = torch.arange(seq).expand(rows, -1)
        positions = idx - torch.cummax(torch.where(starts, idx, 0), dim=1).values
        out.append((seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous(), positions, doc_ids))
    return out


def check_trainer_packed(world: int) -> None:
    """The trainer with Ulysses layers (and data-parallel layers between them, so the doc ids are
    taken per layout) on packed documents equals one process attending with the dense mask."""
    from runtime_common import LLAMA, OPTIM, SEQ, GLOBAL_BATCH, S, make_plan, one_process_losses
    from tessera.runtime.trainer import TrainConfig, Trainer

    batches = packed_batches(3, GLOBAL_BATCH, SEQ, LLAMA.vocab_size)
    want = one_process_losses(LLAMA, OPTIM, [(t, l, p, Documents(d, backend="dense")) for t, l, p, d in batches])
    uly, dp = S(sp="ulysses", sp_degree=world), S(dp=world)
    for name, strategies in (("trainer_ulysses_packed", uly),
                             ("trainer_ulysses_dp_mix_packed", [dp, uly, dp, uly, dp, dp])):
        plan = make_plan(LLAMA, world, strategies, num_micro_batches=2)
        trainer = Trainer(TrainConfig(plan=plan, steps=3, optim=OPTIM, seed=0))
        got = [trainer.train_step(*(trainer.local_rows(t) for t in batch)) for batch in batches]
        trainer.close()
        check(name, all(abs(g - w) <= 1e-5 * abs(w) for g, w in zip(got, want)), f"{got} vs {want}")


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    check("kv_repeats", kv_repeats(8, 1, 4) == 4 and kv_repeats(8, 2, 4) == 2 and kv_repeats(8, 8, 4) == 1)

    world_sp = UlyssesAttention(None)
    compare_attention("mha_causal", world_sp, rank, world, heads=4, kv_heads=4, seq=12)
    compare_attention("gqa_causal", world_sp, rank, world, heads=4, kv_heads=2, seq=12, seed=1)
    compare_attention("gqa_repeat_kv", world_sp, rank, world, heads=4, kv_heads=1, seq=12, seed=2)
    # Packed documents, as doc ids of the full sequence: one document in a row, several (crossing
    # the ranks' slice boundary), many short ones; grouped-query attention with kv repeated.
    several = doc_ids_of([[5, 3, 4], [12]])
    compare_attention("packed_docs", world_sp, rank, world, heads=4, kv_heads=2, seq=12, docs=several, seed=3)
    many = doc_ids_of([[1, 1, 2, 3, 1, 4, 2, 1, 1, 1, 3, 4], [6, 6, 6, 6]])
    compare_attention("many_docs_repeat_kv", world_sp, rank, world, heads=4, kv_heads=1, seq=24, docs=many, seed=6)
    # The CUDA kernel's block mask and call (flex_attention, forward only on CPU) under Ulysses.
    compare_attention("flex_packed_docs", world_sp, rank, world, heads=4, kv_heads=2, seq=24, docs=many,
                      seed=7, backend="flex")
    try:
        world_sp(*(torch.zeros(1, 4, 6, 8) for _ in range(3)), torch.zeros(1, 6, dtype=torch.long))
        check("sliced_doc_ids_refused", False)
    except ValueError as e:
        check("sliced_doc_ids_refused", "doc ids of the full sequence of 12 tokens, got ids of 6" in str(e), str(e))

    # Swapping the group per step: every rank creates every group in the same order.
    singles = [dist.new_group([r]) for r in range(world)]
    pair = dist.new_group(list(range(world)))
    swap = UlyssesAttention(singles[rank])
    compare_attention("group_of_one", swap, 0, 1, heads=4, kv_heads=2, seq=8, seed=4)
    swap.group = pair
    compare_attention("swapped_to_pair", swap, rank, world, heads=4, kv_heads=2, seq=8,
                      docs=doc_ids_of([[2, 6], [1, 1, 1, 5]]), seed=5)
    check_model(rank, world)
    check_model(rank, world, doc_lens=[[5, 7, 4], [1, 2, 1, 9, 3]], label="model_packed")
    check_trainer_packed(world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
