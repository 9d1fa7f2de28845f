"""One cost model for per-step plans (tessera.adapt.seqcost prices through tessera.cost) and
strategy switching by length group (tessera.adapt.switching)."""
from __future__ import annotations

import numpy as np
import pytest

from tessera.adapt import cost_model, solve_step
from tessera.adapt.seqcost import Layout, SeqCostModel, Strategy, build_cost_model, layout_of_plan, strategy_set
from tessera.adapt.seqpar import MicroBatchSolution, Phase
from tessera.adapt.switching import by_zero, compose, phase_items, reprice, step_lower_bound, to_step_plan
from tessera.cost.evaluate import evaluate
from tessera.errors import TesseraError
from tessera.search.baselines import manual_plan
from tessera.spec.presets import get_model, make_cluster
from tessera.spec.workload import Workload

LLAMA = get_model("llama2-7b")
NODE = make_cluster("h100-80gb", 8)


def _static_equivalent(seq_len, degree, per_group, micro_batches, recompute, shard):
    """A static plan whose step is `micro_batches` x groups of `degree` ranks running `per_group`
    sequences of `seq_len` each, ZeRO-3 over `shard` ranks."""
    dp = 8 // degree
    workload = Workload(global_batch=dp * per_group * micro_batches, seq_len=seq_len)
    extra = dict(sp="ulysses", sp_degree=degree) if degree > 1 else {}
    return manual_plan(LLAMA, NODE, workload, dp=dp, zero=3, dp_shard=shard if shard < dp else 0,
                       recompute=recompute, micro_batch_size=per_group, **extra)


@pytest.mark.parametrize("seq_len,degree,per_group,micro_batches,recompute,shard", [
    (4096, 2, 2, 2, "selective", 4), (8192, 1, 1, 4, "selective", 8), (16384, 4, 1, 1, "none", 2),
    (2048, 1, 4, 3, "full", 8)])
def test_a_static_step_costs_what_the_planner_says(seq_len, degree, per_group, micro_batches, recompute, shard):
    """The per-step model prices a fixed-length step like `cost.evaluate` prices the static plan
    (same layer costs, ZeRO traffic per micro-batch and per step, optimizer), within its fit."""
    plan = _static_equivalent(seq_len, degree, per_group, micro_batches, recompute, shard)
    cost = build_cost_model(LLAMA, NODE, Layout(8, 1, shard), Strategy(3, recompute))
    j = cost.degree_index(degree)
    group = cost.alpha_s[j] + per_group * (cost.lin_s[j] * seq_len + cost.attn_s[j] * seq_len ** 2)
    assert cost.step_time([group] * micro_batches) == pytest.approx(evaluate(plan).step_time_s, rel=0.01)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("degree,shard", [(1, 8), (4, 2)])
def test_group_capacity_is_the_planner_memory_limit(recompute, degree, shard):
    """The most tokens a group holds is where the static planner's memory (states, activations,
    the largest buffer, fragmentation, the reserve once, the margin) stops fitting. (A static plan
    shards over its data-parallel ranks only; the shard groups here match its states.)"""
    cost = build_cost_model(LLAMA, NODE, Layout(8, 1, shard), Strategy(3, recompute))
    cap = int(cost.token_capacity(degree))
    fits = _static_equivalent(cap // 8 * 8, degree, 1, 1, recompute, shard)
    over = _static_equivalent(int(cap * 1.01) // 8 * 8, degree, 1, 1, recompute, shard)
    assert evaluate(fits).fits and not evaluate(over).fits


def test_working_modes_keep_what_they_gather():
    """Mode 2 keeps the gathered parameters (more state memory, no gathers per micro-batch),
    mode 1 also the unsharded gradients (no reduce-scatter per micro-batch)."""
    layout = Layout(64, 1, 8)
    cluster = make_cluster("h100-80gb", 64)
    z3, z2, z1 = (build_cost_model(LLAMA, cluster, layout, Strategy(z, "selective")) for z in (3, 2, 1))
    params = LLAMA.num_params
    # mode 2 keeps the gathered bf16 weights (FSDP2's sharded parameter is the fp32 master, counted
    # with the optimizer state in both); mode 1 also the unsharded fp32 gradients
    assert z2.state_bytes - z3.state_bytes == pytest.approx(2 * params, rel=1e-6)
    assert z1.state_bytes - z2.state_bytes == pytest.approx(4 * params * 7 / 8, rel=1e-6)
    assert z3.cap_tokens[0] > z2.cap_tokens[0] > z1.cap_tokens[0]
    t = 0.05  # a short micro-batch: the traffic shows
    assert z3.micro_batch_time(t) > z2.micro_batch_time(t) > z1.micro_batch_time(t) == t


def test_switching_costs_are_charged_where_the_runtime_moves_states():
    """Toy traffic: a gather when a mode-2 phase follows a mode-3 one, a reduce-scatter when a
    mode-1 phase is followed by a mode-2 one, the replica all-reduce once, the optimizer once."""
    def toy(zero):
        return SeqCostModel(num_devices=4, degrees=np.array([1, 2, 4]), alpha_s=np.zeros(3), lin_s=np.ones(3),
                            attn_s=np.zeros(3), cap_tokens=np.full(3, 1e9), gather_s=np.array([2.0]),
                            reduce_s=np.array([3.0]), replica_s=np.array([5.0]), zero=zero,
                            overlap_slowdown=1.0, optimizer_s=0.25, strategy=Strategy(zero, "none"))
    from tessera.adapt.seqcost import StrategySet

    costs = StrategySet(layout=Layout(4), models=(toy(3), toy(2), toy(1)))
    mb = lambda t: MicroBatchSolution([], t, t)  # noqa: E731
    # compute 1 s per micro-batch: 1/3 forward, 2/3 backward; everything longer is exposed
    three, two, one = Phase(0, [mb(1.0)]), Phase(1, [mb(1.0)]), Phase(2, [mb(1.0)])
    z3 = 1.0 + (2 - 1 / 3) + (5 - 2 / 3)  # gather under forward; gather + reduce-scatter under backward
    z2_entry = 1.0 + (2 - 1 / 3) + (3 - 2 / 3)  # gathers once, reduce-scatters every micro-batch
    z1_exit = 1.0 + (2 - 1 / 3) + (3 - 2 / 3)  # gathers once, reduce-scatters once at its end
    assert compose([three], costs) == pytest.approx(z3 + 5 + 0.25)
    assert compose([three, two], costs) == pytest.approx(z3 + z2_entry + 5 + 0.25)
    assert compose([one, two], costs) == pytest.approx(z1_exit + 1.0 + (3 - 2 / 3) + 5 + 0.25)  # two: kept, no gather
    assert compose([two, one], costs) == pytest.approx(z2_entry + 1.0 + (3 + 5 - 2 / 3) + 0.25)


def test_long_and_short_documents_switch_strategies():
    """A long document runs fastest without recompute on many ranks; the short ones beside it
    fill the memory of one rank each and want recompute: the switching plan mixes them and beats
    the plan of one strategy. Every group fits its own strategy's memory."""
    cluster = make_cluster("h100-80gb", 64)
    rng = np.random.default_rng(0)
    lens = np.concatenate([rng.integers(200, 2500, 400), [120_000, 40_000]])
    layout = Layout(64, 1, 8)
    one = strategy_set(LLAMA, cluster, layout, Strategy(3, "selective"), switching=False)
    many = strategy_set(LLAMA, cluster, layout, Strategy(3, "selective"), switching=True)
    fixed = solve_step(lens, one, time_budget_s=10.0)
    switched = solve_step(lens, many, time_budget_s=10.0)
    assert switched.method.startswith("switching") and switched.time_s < 0.95 * fixed.time_s
    used = {g.recompute for m in switched.micro_batches for g in m.groups}
    assert len(used) >= 2 or len(switched.phases) >= 2
    for phase in switched.phases:
        models = {many.models[k].strategy.recompute: many.models[k]
                  for k in by_zero(many)[many.models[phase.strategy].zero]}
        for m in phase.micro_batches:
            for g in m.groups:
                assert lens[g.sequences].sum() <= models[g.recompute].token_capacity(g.degree)
    items = [phase_items(lens, many, ks) for ks in by_zero(many).values()]
    assert step_lower_bound(items, many) <= switched.time_s
    plan = to_step_plan(7, lens, switched, many)
    assert plan.strategy == "switching" and plan.micro_batches and all(p.zero for p in plan.phases)


def test_reprice_keeps_groups_and_refuses_those_that_do_not_fit():
    from tessera.adapt.seqpar import GroupSolution

    cluster = make_cluster("h100-80gb", 64)
    costs = strategy_set(LLAMA, cluster, Layout(64, 1, 8), Strategy(3, "selective"), switching=True)
    z3 = costs.default
    lens = np.array([4_000, 16_000])  # both fit one rank under mode 3; the second not under mode 1
    groups = [GroupSolution(1, [i], z3.group_time([n], 1), "selective") for i, n in enumerate(lens)]
    phase = Phase(0, [MicroBatchSolution(groups, 0.0, max(g.time_s for g in groups))])
    z1 = by_zero(costs)[1]
    assert z3.token_capacity(1) > 16_000 > costs.models[z1[0]].token_capacity(1)
    assert reprice(phase, z1, costs, lens) is None
    alone = Phase(0, [MicroBatchSolution(groups[:1], 0.0, groups[0].time_s)])
    moved = reprice(alone, z1, costs, lens)
    assert moved.strategy == z1[0] and moved.micro_batches[0].groups[0].sequences == [0]
    assert moved.micro_batches[0].slowest_s == pytest.approx(groups[0].time_s)  # same compute


def test_cost_model_of_a_plan_and_what_it_refuses():
    cluster = make_cluster("h100-80gb", 64)
    workload = Workload(global_batch=64, seq_len=32768)
    plan = manual_plan(LLAMA, cluster, workload, tp=2, zero=3, dp_shard=8, recompute="selective")
    layout = layout_of_plan(plan)
    assert (layout.tp, layout.shard, layout.units) == (2, 8, 32)
    costs = cost_model(LLAMA, cluster, plan, switching=True)
    assert costs.default.strategy == Strategy(3, "selective") and costs.default.tp == 2
    assert costs.default.degrees.tolist() == [1, 2, 4, 8, 16]  # 32 heads over 2 TP ranks: 16 each
    with pytest.raises(TesseraError, match="without pipeline parallelism"):
        cost_model(LLAMA, cluster, manual_plan(LLAMA, cluster, workload, pp=2, zero=1))
    with pytest.raises(TesseraError, match="does not run expert parallelism, context parallelism or offload"):
        layout_of_plan(manual_plan(LLAMA, cluster, workload, cp=2, zero=1))


def test_profiled_overheads_reach_the_groups():
    """A model profile's per-call Ulysses overhead and slowdown (LayerSpec.sp_overhead_s,
    sp_slowdown) price every group of two or more units, as the planner's layer costs do."""
    cluster = make_cluster("h100-80gb", 8)
    measured = LLAMA.model_copy(update={"layers": tuple(
        layer.model_copy(update={"sp_overhead_s": 0.002, "sp_slowdown": 0.1}) if layer.num_heads else layer
        for layer in LLAMA.layers)})
    blocks = sum(1 for layer in LLAMA.layers if layer.num_heads)
    plain = build_cost_model(LLAMA, cluster, Layout(8, 1, 8), Strategy(3, "none"))
    slow = build_cost_model(measured, cluster, Layout(8, 1, 8), Strategy(3, "none"))
    assert slow.alpha_s[0] == pytest.approx(plain.alpha_s[0])  # one unit: no Ulysses
    assert slow.alpha_s[2] - plain.alpha_s[2] == pytest.approx(blocks * 0.002, rel=0.02)
    assert slow.attn_s[2] == pytest.approx(1.1 * plain.attn_s[2], rel=0.02)
