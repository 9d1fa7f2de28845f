"""APTMoE expert offload: the cost model's decision (tessera/cost/expert_offload.py) and the runtime
that executes it (tessera/runtime/expert_offload.py) computing exactly what the model computes."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tessera.cost.expert_offload import GPU, HOST, HostSpec, LayerOffload, OffloadPlan, decide_layer, expert_loads
from tessera.cost.expert_offload import plan_expert_offload
from tessera.models.moe import moe_aux_loss
from tessera.models.transformer import build_model
from tessera.runtime.expert_offload import apply_expert_offload
from tessera.spec.model import TransformerConfig
from tessera.spec.presets import get_model
from tessera.spec.presets.clusters import make_cluster
from tessera.spec.workload import Workload

CONFIG = TransformerConfig(name="offload-moe", family="mixtral", vocab_size=128, hidden=32, num_layers=2, num_heads=4,
                           num_kv_heads=2, ffn_hidden=48, max_seq_len=32, num_experts=4, top_k=2,
                           router_aux_loss_coef=0.1)


def test_offloaded_experts_compute_exactly_what_the_model_computes():
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    plain, offloaded = build_model(CONFIG, seed=0), build_model(CONFIG, seed=0)
    where = (GPU, HOST, HOST, GPU)
    plan = OffloadPlan(layers=(LayerOffload(where=where, seconds=0.0, offload_all_s=0.0, host_all_s=0.0),) * 2,
                       micro_batches=1)
    hosts = apply_expert_offload(offloaded, plan, "cpu")
    losses = []
    for model in (plain, offloaded):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) + moe_aux_loss(model)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    grads = dict(offloaded.named_parameters())
    for name, p in plain.named_parameters():
        assert grads[name].grad is not None, name
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-6, atol=1e-8)
    for host in hosts:  # the decision was executed: each expert ran only where the plan put it
        assert host.prefetches == 1
        for e, place in enumerate(where):
            assert host.ran[e][place] > 0 and host.ran[e][GPU if place == HOST else HOST] == 0
        assert all(p.device.type == "cpu" for p in host.parameters())
    assert list(dict(offloaded.named_parameters())) == list(dict(plain.named_parameters()))


def test_decision_brings_busy_experts_and_keeps_idle_ones_on_the_host():
    """Mixtral-8x7B on a memory-poor, bandwidth-poor GPU: a hot expert is worth its weights'
    transfer, rarely chosen ones compute on the host; the decision is never slower than bringing
    every expert or computing every expert on the host."""
    model = get_model("mixtral-8x7b")
    layer = model.layers[1]
    cluster = make_cluster("a100-40gb", 1)
    host = HostSpec(flops=1e12, link_bandwidth=12e9)
    loads = np.array([4000, 30, 20, 10, 900, 5, 0, 35], dtype=float)
    decision = decide_layer(layer, loads, 150e12, host, attention_s=0.002, act_elt=2, param_elt=2)
    assert decision.where[0] == GPU and decision.where[6] == HOST
    assert decision.seconds <= min(decision.offload_all_s, decision.host_all_s)
    assert decision.seconds < decision.offload_all_s  # skewed loads: mixing wins
    # Balanced loads from a large micro-batch: bringing the experts is best, as offload-all does.
    plan = plan_expert_offload(model, cluster, Workload(global_batch=1, seq_len=4096), host,
                               micro_batch_tokens=4096)
    assert plan.step_s == pytest.approx(plan.offload_all_s) and all(w == GPU for w in plan.layers[0].where)
    assert expert_loads(100, layer, skew=2.0).sum() == pytest.approx(200)


def test_plan_cli_prints_the_offload_decision(capsys):
    from tessera.cli import main

    args = ["plan", "--model", "mixtral-8x7b", "--gpus", "8", "--gpu", "a100-40gb", "--global-batch", "8",
            "--seq-len", "512", "--expert-offload"]
    assert main(args + ["1"]) == 0
    assert "experts brought to the GPU; bringing every expert" in capsys.readouterr().out
    assert main(args + ["0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "host TFLOP/s must be > 0" in err and len(err.splitlines()) == 1
