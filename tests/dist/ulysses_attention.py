"""Ulysses attention at 2 ranks on gloo equals single-process attention, outputs and gradients.

Run by tests/test_ulysses_attention.py through torchrun; rank 0 prints `CHECK <name> ok`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessera.models.transformer import CoreAttention, build_model
from tessera.runtime.attention import UlyssesAttention, kv_repeats
from tessera.spec.model import TransformerConfig


def check(name: str, ok: bool, detail: str = "") -> None:
    if not ok:
        raise AssertionError(f"rank {dist.get_rank()}: check {name} failed {detail}")
    if dist.get_rank() == 0:
        print(f"CHECK {name} ok", flush=True)


def block_diagonal_causal(doc_lens: list[int]) -> torch.Tensor:
    doc = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens))
    s = doc.numel()
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    return (causal & (doc[:, None] == doc[None, :]))[None, None]


def compare_attention(name: str, module, group_rank: int, size: int, heads: int, kv_heads: int,
                      seq: int, mask=None, seed: int = 0) -> None:
    """Same random q, k, v on every rank; this rank feeds its sequence slice to `module`."""
    gen = torch.Generator().manual_seed(seed)
    b, d = 2, 8
    q = torch.randn(b, heads, seq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, kv_heads, seq, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, kv_heads, seq, d, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(b, heads, seq, d, generator=gen, dtype=torch.float64)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = CoreAttention()(*ref_in, mask)
    (ref * grad_out).sum().backward()

    part = slice(group_rank * seq // size, (group_rank + 1) * seq // size)
    local = [t[:, :, part].clone().requires_grad_() for t in (q, k, v)]
    out = module(*local, mask)
    (out * grad_out[:, :, part]).sum().backward()
    check(f"{name}_output", torch.allclose(out, ref[:, :, part], atol=1e-10), f"{(out - ref[:, :, part]).abs().max()}")
    for label, mine, full in zip("qkv", local, ref_in):
        check(f"{name}_grad_{label}", torch.allclose(mine.grad, full.grad[:, :, part], atol=1e-10),
              f"{(mine.grad - full.grad[:, :, part]).abs().max()}")


def check_model(rank: int, world: int) -> None:
    """A tiny LLaMA with its attention cores replaced: logits and (summed) gradients are exact."""
    config = TransformerConfig(name="t", hidden=64, num_layers=2, num_heads=4, num_kv_heads=2,
                               ffn_hidden=96, vocab_size=101, max_seq_len=64)
    ref_model = build_model(config, seed=3)
    model = build_model(config, seed=3)
    for block in model.layers.values():
        block.attention.core = UlyssesAttention(None)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 101, (2, 16), generator=gen)
    targets = torch.randint(0, 101, (2, 16), generator=gen)
    ref_logits = ref_model(tokens)
    F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten(), reduction="sum").backward()

    part = slice(rank * 16 // world, (rank + 1) * 16 // world)
    positions = torch.arange(16)[part].expand(2, -1)
    logits = model(tokens[:, part], positions=positions)
    F.cross_entropy(logits.flatten(0, 1), targets[:, part].flatten(), reduction="sum").backward()
    check("model_logits", torch.allclose(logits, ref_logits[:, part], atol=1e-5))
    worst = 0.0
    for (name, p), ref_p in zip(model.named_parameters(), ref_model.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)  # sequence shards hold partial sums of the weight gradients
        worst = max(worst, (grad - ref_p.grad).abs().max().item())
    check("model_grads", worst < 1e-4, f"max diff {worst}")


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    check("kv_repeats", kv_repeats(8, 1, 4) == 4 and kv_repeats(8, 2, 4) == 2 and kv_repeats(8, 8, 4) == 1)

    world_sp = UlyssesAttention(None)
    compare_attention("mha_causal", world_sp, rank, world, heads=4, kv_heads=4, seq=12)
    compare_attention("gqa_causal", world_sp, rank, world, heads=4, kv_heads=2, seq=12, seed=1)
    compare_attention("gqa_repeat_kv", world_sp, rank, world, heads=4, kv_heads=1, seq=12, seed=2)
    mask = block_diagonal_causal([5, 3, 4])
    compare_attention("packed_mask", world_sp, rank, world, heads=4, kv_heads=2, seq=12, mask=mask, seed=3)

    # Swapping the group per step: every rank creates every group in the same order.
    singles = [dist.new_group([r]) for r in range(world)]
    pair = dist.new_group(list(range(world)))
    swap = UlyssesAttention(singles[rank])
    compare_attention("group_of_one", swap, 0, 1, heads=4, kv_heads=2, seq=8, seed=4)
    swap.group = pair
    compare_attention("swapped_to_pair", swap, rank, world, heads=4, kv_heads=2, seq=8,
                      mask=block_diagonal_causal([2, 6]), seed=5)
    check_model(rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
