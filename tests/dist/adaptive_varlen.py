"""Adaptive SP steps at 4 ranks on gloo equal a single-process run, loss and gradients.

Run by tests/test_adaptive_varlen.py through torchrun; rank 0 prints `CHECK <name> ok`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tessera.models.attention as doc_attention
from tessera.adapt import cost_model_from_budget
from tessera.models.transformer import build_model
from tessera.plan import MicroBatchPlan, SPGroupAssignment, StepPlan
from tessera.runtime.varlen import IGNORE_INDEX, AdaptiveStepRunner, pack_group
from tessera.spec.model import ModelSpec, TransformerConfig
from tessera.spec.presets import local_cpu_cluster

CONFIG = TransformerConfig(name="tiny-varlen", hidden=64, num_layers=2, num_heads=4, num_kv_heads=2,
                           ffn_hidden=96, vocab_size=101, max_seq_len=64)
LENS = [9, 5, 12, 3, 7, 4, 10]


def check(name: str, ok: bool, detail: str = "") -> None:
    if not ok:
        raise AssertionError(f"rank {dist.get_rank()}: check {name} failed {detail}")
    if dist.get_rank() == 0:
        print(f"CHECK {name} ok", flush=True)


def make_samples(seed: int):
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for n in LENS:
        x = torch.randint(0, CONFIG.vocab_size, (n,), generator=gen)
        y = torch.randint(0, CONFIG.vocab_size, (n,), generator=gen)
        y[torch.rand(n, generator=gen) < 0.2] = IGNORE_INDEX  # some targets ignored
        samples.append((x, y))
    return samples


def reference(samples):
    """Single process: each document alone (causal, positions from 0); sum of token losses / targets."""
    model = build_model(CONFIG, seed=7)
    total = sum(int((y != IGNORE_INDEX).sum()) for _, y in samples)
    loss = sum(F.cross_entropy(model(x[None]).flatten(0, 1), y, ignore_index=IGNORE_INDEX, reduction="sum")
               for x, y in samples) / total
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def compare(name: str, runner: AdaptiveStepRunner, plan: StepPlan, samples, ref) -> None:
    runner.model.zero_grad(set_to_none=True)
    loss = runner.forward_backward(plan, samples)
    ref_loss, ref_grads = ref
    check(f"{name}_loss", abs(loss - ref_loss) < 1e-5, f"{loss} vs {ref_loss}")
    worst = max((p.grad - ref_grads[n]).abs().max().item() for n, p in runner.model.named_parameters())
    check(f"{name}_grads", worst < 1e-5, f"max diff {worst}")


def group(ranks, seqs):
    return SPGroupAssignment(ranks=tuple(ranks), sequences=tuple(seqs))


def no_dense_mask(doc_ids):
    raise AssertionError(f"a dense {tuple(doc_ids.shape)} document mask was built")


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    samples = make_samples(1)
    # Packed groups carry doc ids of the whole packed sequence (padding is one more document),
    # and attention never builds the dense S x S mask.
    shard = pack_group([samples[0], samples[1]], 4, 1)  # 9 + 5 tokens, padded to 16
    check("pack_group_doc_ids", shard.doc_ids.tolist() == [[0] * 9 + [1] * 5 + [2] * 2]
          and shard.tokens.shape == (1, 4) and shard.positions.tolist() == [[4, 5, 6, 7]])
    doc_attention.document_causal_mask = no_dense_mask
    ref = reference(samples)
    spec = ModelSpec.from_config(CONFIG)
    # A budget of ~8 tokens per device: longer documents need sequence parallelism to fit.
    cost = cost_model_from_budget(spec, local_cpu_cluster(4), budget_bytes=1.0, dtype="fp32")
    cost = cost_model_from_budget(spec, local_cpu_cluster(4), budget_bytes=8.5 * cost.act_bytes_per_token, dtype="fp32")
    runner = AdaptiveStepRunner(build_model(CONFIG, seed=7), cost=cost)

    # The mixed step: one group of 2 and two groups of 1; then all 4 ranks as one group (kv heads
    # repeated: 2 kv heads over 4 ranks), with the group swapped between micro-batches.
    mixed = StepPlan(step=0, seq_lens=tuple(LENS), micro_batches=(
        MicroBatchPlan(groups=(group([0, 1], [0, 2]), group([2], [1, 3]), group([3], [4]))),
        MicroBatchPlan(groups=(group([0, 1, 2, 3], [6, 5]),)),
    ))
    compare("mixed_step", runner, mixed, samples, ref)

    idle = StepPlan(step=1, seq_lens=tuple(LENS), micro_batches=(
        MicroBatchPlan(groups=(group([0, 1], list(range(7))), group([2], []), group([3], []))),
    ))
    compare("idle_ranks", runner, idle, samples, ref)

    # Planned by tessera.adapt on rank 0 (one step ahead), broadcast, and run.
    runner.prefetch(2, LENS)
    planned = runner.plan(2, LENS)
    texts = [None] * dist.get_world_size()
    dist.all_gather_object(texts, planned.model_dump_json())
    check("plan_same_on_all_ranks", len(set(texts)) == 1)
    degrees = sorted({len(g.ranks) for mb in planned.micro_batches for g in mb.groups if g.sequences})
    check("plan_uses_sequence_parallel", max(degrees) >= 2, f"degrees {degrees}")
    if dist.get_rank() == 0:
        print("planned groups:", [[(g.ranks, g.sequences) for g in mb.groups] for mb in planned.micro_batches], flush=True)
    compare("planned_step", runner, planned, samples, ref)

    try:
        runner.groups.get((1, 2))
        check("misaligned_group_refused", False)
    except ValueError:
        check("misaligned_group_refused", True)
    runner.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
