"""Shared pieces of the pipeline and checkpoint tests: tiny models, hand-made plans, seeded data,
and the single-process reference run every distributed run is compared with."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.models import build_model
from tessera.models.attention import Documents
from tessera.plan import LayerStrategy, PipelineSpec, Plan
from tessera.spec import ModelSpec, TransformerConfig, Workload
from tessera.spec.presets import local_cpu_cluster

# 4 blocks + embedding + head = 6 plan layers; small enough for 4 ranks on 2 cores.
TINY_LLAMA = TransformerConfig(name="test-llama", hidden=64, num_layers=4, num_heads=4, num_kv_heads=2,
                               ffn_hidden=128, vocab_size=256, max_seq_len=32)
TINY_GPT2 = TransformerConfig(name="test-gpt2", family="gpt2", hidden=64, num_layers=4, num_heads=4,
                              num_kv_heads=4, ffn_hidden=128, vocab_size=256, max_seq_len=32,
                              norm="layernorm", mlp="gelu", position="learned", linear_bias=True,
                              tie_embeddings=True)
SEQ_LEN = 16
GLOBAL_BATCH = 8
LR = 3e-3


def even_stages(num_layers: int, num_chunks: int) -> tuple[tuple[int, int], ...]:
    bounds = [round(i * num_layers / num_chunks) for i in range(num_chunks + 1)]
    return tuple(zip(bounds[:-1], bounds[1:]))


def make_plan(config: TransformerConfig, world: int, pp: int = 1, schedule: str = "1f1b",
              virtual_stages: int = 1, tp: int = 1, zero: int = 0, num_micro_batches: int | None = None) -> Plan:
    spec = ModelSpec.from_config(config)
    dp = world // pp // tp
    m = num_micro_batches or (4 if pp > 1 else 1)
    return Plan(model=spec, cluster=local_cpu_cluster(world),
                workload=Workload(global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, dtype="fp32"),
                micro_batch_size=GLOBAL_BATCH // dp // m, num_micro_batches=m,
                pipeline=PipelineSpec(degree=pp, schedule=schedule, virtual_stages=virtual_stages,
                                      stages=even_stages(len(spec.layers), pp * virtual_stages)),
                layers=tuple(LayerStrategy(dp=dp, tp=tp, zero=zero) for _ in spec.layers))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded synthetic tokens for `step`: (inputs, next-token labels), each (GLOBAL_BATCH, SEQ_LEN)."""
    # Learnable: each sequence counts up from a random start with a stride of 1..3, so the
    # loss falls visibly within a few steps and a wrong gradient shows.
    gen = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, TINY_LLAMA.vocab_size, (GLOBAL_BATCH, 1), generator=gen)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=gen)
    seq = (start + stride * torch.arange(SEQ_LEN + 1)) % TINY_LLAMA.vocab_size
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def packed_documents(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and document ids (B, S) for packed documents: each sequence holds two documents,
    split at a seeded position."""
    gen = torch.Generator().manual_seed(2000 + step)
    cut = torch.randint(2, SEQ_LEN - 2, (GLOBAL_BATCH, 1), generator=gen)
    idx = torch.arange(SEQ_LEN).expand(GLOBAL_BATCH, SEQ_LEN)
    doc = (idx >= cut).long()
    positions = torch.where(doc == 1, idx - cut, idx)
    return positions, doc


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, betas=(0.9, 0.95))


def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up over 3 steps, then decay: the LR differs every step, so resume must restore it."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3) * 0.9 ** s)


def reference_losses(config: TransformerConfig, steps: int, seed: int = 0, packed: bool = False) -> list[float]:
    """Single-process training on the global batch: loss of each step (before its update)."""
    model = build_model(config, seed=seed)
    opt = make_optimizer(model.parameters())
    sched = make_scheduler(opt)
    losses = []
    for step in range(steps):
        tokens, labels = global_batch(step)
        positions, doc_ids = packed_documents(step) if packed else (None, None)
        # The reference attends with the dense document-causal mask.
        docs = Documents(doc_ids, backend="dense") if packed else None
        loss = loss_fn(model(tokens, positions, docs), labels)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def close(a: list[float], b: list[float], rtol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * abs(y) for x, y in zip(a, b))
