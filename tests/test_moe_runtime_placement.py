"""NetMoE per-layer placement's block in one process (runtime/moe_placement.py `PlacingContext`): the
residual and the shared expert ride the combine, tokens whose every slot the capacity dropped move by
themselves, packed documents follow their rows; gradients equal the plain model's. The 4-rank run
(tests/dist/moe_equivalence.py) checks the moves between ranks."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent / "dist"))

from runtime_common import OPTIM, make_plan  # noqa: E402

from tessera.errors import TesseraError  # noqa: E402
from tessera.models.moe import moe_aux_loss  # noqa: E402
from tessera.models.transformer import build_model  # noqa: E402
from tessera.plan import LayerStrategy  # noqa: E402
from tessera.runtime.materialize import canonical_name  # noqa: E402
from tessera.runtime.trainer import TrainConfig, Trainer  # noqa: E402
from tessera.spec.model import TransformerConfig  # noqa: E402

QWEN = TransformerConfig(name="layer-qwen", family="qwen2_moe", vocab_size=128, hidden=32, num_layers=2,
                         num_heads=4, num_kv_heads=2, ffn_hidden=24, max_seq_len=32, num_experts=4, top_k=2,
                         qkv_bias=True, router="softmax_topk", norm_topk_prob=True, shared_expert_ffn=40,
                         router_aux_loss_coef=0.1, router_z_loss_coef=0.01, capacity_factor=0.5)


def test_per_layer_block_equals_the_plain_model_with_drops_and_documents():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, QWEN.vocab_size, (4, 16), generator=gen)
    labels = torch.randint(0, QWEN.vocab_size, (4, 16), generator=gen)
    positions = torch.cat([torch.arange(5), torch.arange(11)]).expand(4, 16).contiguous()
    doc_ids = (torch.arange(16) >= 5).long().expand(4, 16).contiguous()

    model = build_model(QWEN, seed=0)
    lm = F.cross_entropy(model(tokens, positions, doc_ids).flatten(0, 1), labels.flatten())
    (lm + moe_aux_loss(model)).backward()
    want = {name: p.grad for name, p in model.named_parameters()}

    plan = make_plan(QWEN, 1, LayerStrategy(), global_batch=4)
    trainer = Trainer(TrainConfig(plan=plan, steps=1, optim=OPTIM, seed=0, moe_placement="layer"))
    dropped = []
    ctx = trainer.placer.contexts[0]
    decide = ctx._decide
    ctx._decide = lambda r, rows, seq, unserved: (dropped.append(int(unserved.sum())), decide(r, rows, seq,
                                                                                            unserved))[1]
    got = trainer.compute_gradients(tokens, labels, positions, doc_ids)
    trainer.close()
    assert sum(dropped) > 0  # some tokens lost every slot: they moved by themselves
    assert float(got) == pytest.approx(lm.item(), rel=1e-6)  # the trainer's loss leaves the router losses out
    for name, p in trainer.named_parameters():
        ref = want[canonical_name(name)]
        assert float((p.grad - ref).abs().max()) <= 1e-5 * float(ref.abs().max()), name


def test_per_layer_placement_refuses_what_it_cannot_run():
    plan = make_plan(QWEN, 1, LayerStrategy(), global_batch=4)
    with pytest.raises(TesseraError, match="moe_placement must be 'step' or 'layer'"):
        TrainConfig(plan=plan, steps=1, optim=OPTIM, moe_placement="sometimes")


def test_the_routing_table_learns_the_same_hashed_or_exact(monkeypatch):
    """One step's routing reaches rank 0's table as the step's distinct ids (small vocabularies) or
    as hashed buckets (large ones): a bucket holds the mean over its ids' occurrences."""
    import numpy as np

    import tessera.runtime.moe_placement as placement

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, QWEN.vocab_size, (4, 16), generator=gen)
    labels = torch.randint(0, QWEN.vocab_size, (4, 16), generator=gen)
    plan = make_plan(QWEN, 1, LayerStrategy(), global_batch=4)
    tables = []
    monkeypatch.setattr(placement, "HASHED_BUCKETS", 61)
    for limit in (10**9, 0):  # exact, then hashed
        monkeypatch.setattr(placement, "EXACT_UP_TO_IDS", limit)
        trainer = Trainer(TrainConfig(plan=plan, steps=1, optim=OPTIM, seed=0, moe_placement=True))
        trainer.train_step(tokens, labels)
        tables.append(trainer.placer.table)
        trainer.close()
    exact, hashed = tables
    assert exact.buckets is None and hashed.buckets is not None
    assert exact.buckets is None and hashed.slots.shape == (61, QWEN.num_experts)
    ids = np.unique(tokens.numpy())
    assert exact.seen[ids].min() > 0 and exact.seen.sum() == tokens.numel()
    seen = np.bincount(hashed.key(ids), exact.seen[ids], minlength=61)
    slots = np.zeros((61, QWEN.num_experts))
    np.add.at(slots, hashed.key(ids), exact.slots[ids] * exact.seen[ids, None])
    hit = seen > 0
    assert np.allclose(hashed.seen, seen) and np.allclose(hashed.slots[hit], slots[hit] / seen[hit, None])


def test_per_layer_placement_learns_the_first_moe_layer_only():
    """Per layer, the step's placement serves the first MoE layer (later ones are re-placed): its
    table holds that layer's top-k slots per occurrence; the step placement's table every layer's."""
    import numpy as np

    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, QWEN.vocab_size, (4, 16), generator=gen)
    labels = torch.randint(0, QWEN.vocab_size, (4, 16), generator=gen)
    plan = make_plan(QWEN, 1, LayerStrategy(), global_batch=4)
    for mode, layers in (("step", QWEN.num_layers), ("layer", 1)):
        trainer = Trainer(TrainConfig(plan=plan, steps=1, optim=OPTIM, seed=0, moe_placement=mode))
        trainer.train_step(tokens, labels)
        table = trainer.placer.table
        trainer.close()
        ids = np.unique(tokens.numpy())
        assert table.seen.sum() == tokens.numel()
        assert np.allclose(table.slots[ids].sum(1), QWEN.top_k * layers), mode
