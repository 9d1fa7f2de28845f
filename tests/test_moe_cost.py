"""The expert-parallel cost (tessera/cost/moe.py): skew, node crossing, capacity, recompute replay,
skew measured from a routing trace; and bad MoE input answered in one line."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tessera.cli import main as cli_main
from tessera.cost.comm import collective_time
from tessera.cost.layer import StepContext, StrategyTable, layer_costs
from tessera.cost.moe import all_to_all_times, expert_share, load_factor, routing_skew, slot_bytes, with_routing
from tessera.plan import LayerStrategy, Plan, PlanError
from tessera.search import manual_plan
from tessera.spec.model import ModelSpec, TransformerConfig
from tessera.spec.presets import get_model
from tessera.spec.presets.clusters import make_cluster
from tessera.spec.workload import Workload


def _costs(layer, strategies, cluster, seqs=8):
    ctx = StepContext(cluster=cluster, workload=Workload(global_batch=seqs, seq_len=4096), stage_size=8,
                      micro_batch_seqs=seqs)
    return layer_costs(layer, StrategyTable.build(strategies), ctx)


def test_skew_slows_the_all_to_alls_and_the_experts_only_under_expert_parallelism():
    cluster = make_cluster("h100-80gb", 8)
    moe = get_model("mixtral-8x7b").layers[1]
    skewed = moe.model_copy(update={"routing_skew": 1.5})
    strategies = [LayerStrategy(dp=8), LayerStrategy(dp=8, ep=8)]
    even, hot = _costs(moe, strategies, cluster), _costs(skewed, strategies, cluster)
    assert hot.fwd[0] == pytest.approx(even.fwd[0])  # ep = 1: every rank runs every expert locally
    n = slot_bytes(moe, 4096, 2)  # one sequence per device
    a2a = collective_time(cluster, "all_to_all", n, 8, 1)
    a2a_hot = collective_time(cluster, "all_to_all", 1.5 * n, 8, 1)
    # The experts' FLOP share of the layer's forward compute runs 1.5x longer on the busiest rank.
    expert_fwd = 0.5 * expert_share(moe) * even.compute_fwd[1]
    assert 0.5 < expert_share(moe) < 1.0
    assert hot.fwd[1] - even.fwd[1] == pytest.approx(2 * (a2a_hot - a2a) + expert_fwd, rel=1e-6)
    assert hot.bwd[1] - even.bwd[1] == pytest.approx(2 * (a2a_hot - a2a) + 2 * expert_fwd, rel=1e-6)
    # A capacity factor caps the busiest rank's load.
    capped = skewed.model_copy(update={"capacity_factor": 1.25, "dropless": False})
    assert load_factor(capped) == 1.25 and load_factor(skewed) == 1.5


def test_recompute_replays_the_forward_all_to_alls():
    cluster = make_cluster("h100-80gb", 8)
    moe = get_model("mixtral-8x7b").layers[1]
    c = _costs(moe, [LayerStrategy(dp=8, ep=8), LayerStrategy(dp=8, ep=8, recompute="selective")], cluster)
    forward_a2a = c.fwd[0] - c.compute_fwd[0]
    assert c.bwd[1] - c.compute_bwd[1] == pytest.approx(c.bwd[0] - c.compute_bwd[0] + forward_a2a)


def test_internode_scale_applies_to_groups_that_span_nodes():
    cluster = make_cluster("h100-80gb", 64)
    n = 64e6
    for size, stride in ((8, 1), (16, 1), (8, 2)):
        uniform = float(all_to_all_times(cluster, n, size, stride))
        assert uniform == pytest.approx(collective_time(cluster, "all_to_all", n, size, stride))
        placed = float(all_to_all_times(cluster, n, size, stride, internode_scale=0.5))
        if size * stride <= 8:  # inside a node: nothing crosses
            assert placed == pytest.approx(uniform)
        else:
            local = 8 // stride
            want = (max(0.5 * (size - local) / size * n / cluster.inter_node.bandwidth,
                        (local - 1) / size * n / cluster.intra_node.bandwidth)
                    + (size - 1) * cluster.inter_node.latency)
            assert placed == pytest.approx(want) and placed < uniform


def test_routing_skew_from_a_trace():
    assert routing_skew(np.full((3, 2, 8), 10.0), ep=4) == pytest.approx(1.0)
    hot = np.zeros((1, 8))
    hot[0, :2] = 5.0  # every slot on the experts of rank 0
    assert routing_skew(hot, ep=4) == pytest.approx(4.0)
    assert routing_skew(hot, ep=1) == pytest.approx(1.0)
    model = with_routing(get_model("tiny-moe"), skew=1.3, internode_scale=0.6)
    moe = [layer for layer in model.layers if layer.num_experts]
    assert moe and all(layer.routing_skew == 1.3 and layer.a2a_internode_scale == 0.6 for layer in moe)
    assert all(layer.routing_skew == 1.0 for layer in model.layers if not layer.num_experts)


def test_bad_moe_input_is_one_line(tmp_path, capsys):
    # Top-k larger than the expert count, in a Hugging Face config.
    cfg = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "num_local_experts": 4,
           "num_experts_per_tok": 6}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert cli_main(["plan", "--model", str(tmp_path / "config.json"), "--gpus", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "top_k=6 must be in 1..num_experts=4" in err and len(err.splitlines()) == 1
    # A capacity factor <= 0, in a plan file.
    plan = manual_plan(get_model("tiny-moe"), make_cluster("h100-80gb", 8), Workload(global_batch=8, seq_len=128),
                       dp=8, ep=4, micro_batch_size=1)
    data = json.loads(plan.to_json())
    data["model"]["config"]["capacity_factor"] = 0.0
    with pytest.raises(PlanError) as bad:
        Plan.from_json(json.dumps(data))
    assert "capacity_factor=0.0 must be > 0" in str(bad.value) and len(str(bad.value).splitlines()) == 1
    with pytest.raises(ValueError, match="capacity_factor=-1.0 must be > 0"):
        TransformerConfig(name="x", vocab_size=8, hidden=8, num_layers=1, num_heads=1, num_kv_heads=1,
                          ffn_hidden=8, num_experts=2, top_k=1, capacity_factor=-1.0)
    # An expert count not divisible by the expert-parallel degree: a hand-made plan, and a plan file.
    assert cli_main(["plan", "--model", "tiny-moe", "--gpus", "6", "--gpus-per-node", "6", "--global-batch", "6",
                     "--seq-len", "128", "--ep", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "ep=3 must divide the number of experts (4)" in err and len(err.splitlines()) == 1
    data = json.loads(plan.to_json())
    data["layers"][1]["ep"] = 8
    data["model"]["layers"][1]["num_experts"] = 6
    with pytest.raises(PlanError, match=r"layer 1 \(block0\) has 6 experts, not divisible by its expert-parallel "
                                        r"degree ep=8") as bad:
        Plan.from_json(json.dumps(data))
    assert len(str(bad.value).splitlines()) == 1


def test_qwen_moe_preset_plans():
    model = ModelSpec.from_config(get_model("qwen1.5-moe-a2.7b").config)
    moe = model.layers[1]
    assert moe.num_experts == 60 and moe.top_k == 4
    # 2048 * 1408 * 3 per expert x 60, plus the shared expert and its gate, the router, attention, norms.
    assert moe.expert_params == 60 * 3 * 2048 * 1408
    assert 13e9 < model.num_params < 15e9  # Qwen1.5-MoE-A2.7B: 14.3B parameters


def test_collective_list_matches_the_priced_all_to_alls():
    """`ep_collectives` lists what `moe_times` prices (balanced routing): 3 all-to-alls forward, 2
    backward, 3 more under recompute (the runtime issues exactly these, tests/dist)."""
    from tessera.cost.moe import ep_collectives, moe_times

    cluster = make_cluster("h100-80gb", 16)
    moe = get_model("mixtral-8x7b").layers[1]
    for s in (LayerStrategy(dp=16, ep=8), LayerStrategy(dp=8, tp=2, ep=4, recompute="selective"),
              LayerStrategy(dp=16, ep=1)):
        tokens = 4096.0
        listed = ep_collectives(moe, s, tokens, 2, aux_loss=False)
        fwd = sum(collective_time(cluster, c.op, c.nbytes, c.group, c.stride) for c in listed if c.phase == "forward")
        bwd = sum(collective_time(cluster, c.op, c.nbytes, c.group, c.stride) for c in listed if c.phase == "backward")
        f, b = moe_times(moe, StrategyTable.build([s]), cluster, tokens, 2, 1e15)
        assert float(f[0]) == pytest.approx(fwd) and float(b[0]) == pytest.approx(bwd)
        token_a2a = [c for c in listed if c.op == "all_to_all" and c.what not in ("counts", "counts (recompute)")]
        assert len(token_a2a) == (0 if s.ep == 1 else 6 if s.recompute != "none" else 4)
    aux = ep_collectives(moe, LayerStrategy(dp=16, ep=8), 4096.0, 2, aux_loss=True)
    assert aux[0].op == "all_reduce" and aux[0].group == 16 and aux[0].nbytes == 8 * moe.num_experts


def test_searched_mixtral_plan_builds_at_64_ranks():
    """Under the fake process group, in a subprocess (tests/dist/moe_fake_build.py)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, str(root / "tests" / "dist" / "moe_fake_build.py")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert "CHECK mixtral_64_searched_plan_builds ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_expert_layout_matches_the_cost_model():
    """The runtime's expert placement (runtime/expert_parallel.py) and the cost model's expert
    shard degree agree, and the ep group's stride is tp, as the all-to-all is priced."""
    from tessera.cost.memory import expert_shard
    from tessera.runtime.expert_parallel import ExpertLayout

    cases = ((8, 1, 1, 8, 1, 0), (8, 1, 2, 4, 3, 4), (4, 2, 1, 2, 2, 0), (16, 1, 1, 4, 0, 0))
    for dp, sp, tp, ep, zero, dp_shard in cases:
        s = LayerStrategy(dp=dp, sp="ulysses" if sp > 1 else "none", sp_degree=sp, tp=tp, ep=ep, zero=zero,
                          dp_shard=dp_shard)
        layout = ExpertLayout.of(s)
        assert layout.expert_shard == int(expert_shard(s.shard_degree, dp, sp, ep))
        shape = layout.mesh_shape(pp=1)
        assert shape[1] * shape[2] == dp * sp // ep and shape[3:] == (ep, tp)
        # Stage rank r = q * tp + t: the ep peers of rank 0 are 0, tp, 2 tp, ... and hold all experts.
        peers = [q * tp for q in range(ep)]
        experts = sorted(e for r in peers for e in layout.local_experts(8 * ep, layout.ep_rank(r)))
        assert experts == list(range(8 * ep))
