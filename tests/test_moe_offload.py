"""APTMoE in the trainer (`TrainConfig.expert_offload`): the MoE layers' experts in host memory, each
computing where the decision says, train exactly as without offload (one process, CPU: the host is
the device, so only the mechanism runs; its speed is the cost model's prediction)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "dist"))

from runtime_common import OPTIM, S, make_plan  # noqa: E402

from tessera.cost.expert_offload import GPU, HOST, HostSpec, LayerOffload, OffloadPlan  # noqa: E402
from tessera.errors import TesseraError  # noqa: E402
from tessera.runtime.expert_offload import check_expert_offload, offload_plan_for  # noqa: E402
from tessera.runtime.trainer import TrainConfig, Trainer  # noqa: E402
from tessera.spec.model import TransformerConfig  # noqa: E402

CONFIG = TransformerConfig(name="offload-moe", family="mixtral", vocab_size=128, hidden=32, num_layers=2, num_heads=4,
                           num_kv_heads=2, ffn_hidden=48, max_seq_len=32, num_experts=4, top_k=2,
                           router_aux_loss_coef=0.1, router_z_loss_coef=0.01)
WHERE = (GPU, HOST, HOST, GPU)


def _batches(steps: int = 3):
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, CONFIG.vocab_size, (4, 17), generator=gen) for _ in range(steps)]
    return [(s[:, :-1].contiguous(), s[:, 1:].contiguous()) for s in seqs]


def _run(offload, micro_batches: int = 2):
    plan = make_plan(CONFIG, 1, S(recompute="full"), global_batch=4, num_micro_batches=micro_batches)
    trainer = Trainer(TrainConfig(plan=plan, steps=3, optim=OPTIM, seed=0, expert_offload=offload))
    batches = _batches()
    trainer.compute_gradients(*batches[0])
    grads = {name: p.grad.clone() for name, p in trainer.named_parameters()}
    trainer.optimizer_step()
    losses = [trainer.train_step(*b) for b in batches[1:]]
    hosts = getattr(trainer, "host_experts", [])
    trainer.close()
    return grads, losses, hosts


def test_offloaded_experts_train_exactly_as_without():
    mixed = OffloadPlan(layers=(LayerOffload(where=WHERE, seconds=0.0, offload_all_s=0.0, host_all_s=0.0),) * 2,
                        micro_batches=2)
    want_grads, want_losses, _ = _run(None)
    grads, losses, hosts = _run(mixed)
    assert grads.keys() == want_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-6, atol=1e-9)
    assert losses == pytest.approx(want_losses, rel=1e-6)
    assert len(hosts) == 2
    for host in hosts:  # the decision ran: each expert only where it was put, its weights on the host
        assert host.prefetches > 0 and all(p.device.type == "cpu" for p in host.parameters())
        for e, place in enumerate(WHERE):
            assert host.ran[e][place] > 0 and host.ran[e][GPU if place == HOST else HOST] == 0


def test_a_host_spec_runs_the_cost_models_decision():
    plan = make_plan(CONFIG, 1, S(), global_batch=4)
    host = HostSpec(flops=1e9, link_bandwidth=1e9)
    trainer = Trainer(TrainConfig(plan=plan, steps=1, optim=OPTIM, seed=0, expert_offload=host))
    want = offload_plan_for(plan, host)
    assert trainer.offload_plan == want
    assert [tuple(h.where[e] for e in range(4)) for h in trainer.host_experts] == [w.where for w in want.layers]
    trainer.close()


def test_offload_refuses_moe_layers_spread_over_ranks():
    plan = make_plan(CONFIG, 2, S(dp=2))
    with pytest.raises(TesseraError, match=r"plan.layers\[1\] \(block0\): expert offload keeps .* dp=sp=tp=ep=1"):
        check_expert_offload(plan)
