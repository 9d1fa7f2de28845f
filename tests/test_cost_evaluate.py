"""Whole-plan predictions: consistency of the breakdown, MFU, and the vectorised collectives."""
import numpy as np
import pytest

from tessera.cost import evaluate
from tessera.cost.comm import collective_time, collective_times
from tessera.cost.evaluate import model_flops_per_step, simulate_plan
from tessera.search import baseline_plans, manual_plan
from tessera.spec import Workload
from tessera.spec.presets import get_model, make_cluster


@pytest.fixture(scope="module")
def setup():
    return get_model("llama2-7b"), make_cluster("h100-80gb", 16), Workload(global_batch=128, seq_len=4096)


def test_breakdown_adds_up_and_mfu_follows_its_definition(setup):
    m, c, w = setup
    plan = manual_plan(m, c, w, tp=2, pp=2, sp="megatron", zero=1, micro_batch_size=2)
    p = plan.prediction
    assert p.compute_s + p.exposed_comm_s + p.bubble_s == pytest.approx(p.step_time_s)
    assert p.tokens_per_s * p.step_time_s == pytest.approx(w.tokens_per_step)
    assert p.mfu == pytest.approx(model_flops_per_step(plan) / (p.step_time_s * 16 * 989e12))
    assert 0.2 < p.mfu < c.compute_efficiency
    assert evaluate(plan) == p  # pure


def test_more_micro_batches_shrink_the_bubble(setup):
    m, c, w = setup
    few = manual_plan(m, c, w, pp=4, tp=2, sp="megatron", micro_batch_size=8).prediction
    many = manual_plan(m, c, w, pp=4, tp=2, sp="megatron", micro_batch_size=1).prediction
    assert many.bubble_s / many.step_time_s < few.bubble_s / few.step_time_s


def test_zero3_pays_gathers_every_micro_batch(setup):
    m, c, w = setup
    z1 = manual_plan(m, c, w, zero=1, micro_batch_size=1, recompute="full").prediction
    z3 = manual_plan(m, c, w, zero=3, micro_batch_size=1, recompute="full").prediction
    assert z3.peak_memory < z1.peak_memory
    assert z3.exposed_comm_s > z1.exposed_comm_s


def test_step_time_is_simulated_makespan_plus_tail(setup):
    m, c, w = setup
    plan = manual_plan(m, c, w, tp=4, pp=2, sp="megatron", schedule="zero_bubble")
    sim, tails = simulate_plan(plan)
    assert plan.prediction.step_time_s == pytest.approx(sim.step_time + max(tails))


def test_manual_plan_refuses_impossible_combinations(setup):
    m, c, w = setup
    with pytest.raises(ValueError, match="must divide the 32 attention heads"):
        manual_plan(m, make_cluster("h100-80gb", 24), Workload(global_batch=24, seq_len=4096), tp=3)
    with pytest.raises(ValueError, match="does not divide 16 GPUs"):
        manual_plan(m, c, w, pp=3)
    with pytest.raises(ValueError, match="needs tp >= 2"):
        manual_plan(m, c, w, sp="megatron")
    with pytest.raises(ValueError, match="not divisible by micro-batch size"):
        manual_plan(m, c, w, micro_batch_size=3)


def test_baselines_are_costed_and_flag_infeasible_ones(setup):
    m, c, w = setup
    # 32 GPUs: on 16, tp 8 x pp 2 without ZeRO holds 70B / 16 x 18 bytes (fp32 gradients): 79 GB.
    plans = {p.name: p for p in baseline_plans(get_model("llama2-70b"), make_cluster("h100-80gb", 32), w)}
    assert {"megatron-default", "fsdp", "ddp", "zero1"} <= set(plans)
    assert not plans["ddp"].prediction.fits  # 70B replicated: ~1.1 TB of states per GPU
    meg = plans["megatron-default"]
    assert meg.layers[1].tp == 8 and meg.prediction.fits


def test_vectorised_collectives_match_the_scalar_reference():
    c = make_cluster("h100-80gb", 64)
    sizes = np.array([1, 2, 8, 16, 64, 4])
    strides = np.array([1, 1, 1, 8, 1, 2])
    nbytes = np.array([1e6, 1e8, 3e7, 1e9, 5e8, 0.0])
    for coll in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        got = collective_times(c, coll, nbytes, sizes, strides)
        want = [collective_time(c, coll, n, s, st) for n, s, st in zip(nbytes, sizes, strides)]
        assert got == pytest.approx(want)


def test_ulysses_and_expert_all_to_alls_are_charged():
    from tessera.cost.layer import StepContext, StrategyTable, layer_costs
    from tessera.plan import LayerStrategy

    c = make_cluster("h100-80gb", 8)
    ctx = StepContext(cluster=c, workload=Workload(global_batch=8, seq_len=4096), stage_size=8, micro_batch_seqs=8)
    block = get_model("llama2-7b").layers[1]
    t = StrategyTable.build([LayerStrategy(dp=2, sp="ulysses", sp_degree=4)])
    costs = layer_costs(block, t, ctx)
    tokens = 8 / 2 * 4096 / 4  # per device
    a2a = 4 * collective_time(c, "all_to_all", tokens * 4096 * 2, 4, 1)  # q, k, v, out (MHA: kv = q)
    assert costs.fwd[0] - costs.compute_fwd[0] == pytest.approx(a2a)
    moe = get_model("mixtral-8x7b").layers[1]
    t = StrategyTable.build([LayerStrategy(dp=8), LayerStrategy(dp=8, ep=8)])
    costs = layer_costs(moe, t, ctx)
    msg = 4096 * moe.top_k * moe.hidden * 2  # one sequence per device, dropless (cost/moe.py)
    counts = collective_time(c, "all_to_all", 8 * moe.num_experts, 8, 1)
    comm = costs.fwd - costs.compute_fwd  # EP also reshapes the expert GEMMs: compare the communication
    assert comm[1] - comm[0] == pytest.approx(2 * collective_time(c, "all_to_all", msg, 8, 1) + counts)


def test_time_shared_cores_fill_pipeline_bubbles(setup):
    """With more ranks than cores (a CPU profile), an idle pipeline rank lends its cores: the step
    is no faster than all the work spread over the cores nor than the critical path alone."""
    m, c, w = setup
    shared = c.model_copy(update={"oversubscription": 2.0})
    for kwargs in (dict(pp=4, tp=2, sp="megatron", micro_batch_size=8), dict(tp=2, zero=1)):
        own = manual_plan(m, c, w, **kwargs)
        plan = manual_plan(m, shared, w, **kwargs)
        sim, tails = simulate_plan(plan)
        mean_busy = float(np.mean([b + t for b, t in zip(sim.busy, tails)]))
        expected = max((sim.step_time + max(tails)) / 2.0, mean_busy)
        assert plan.prediction.step_time_s == pytest.approx(expected)
        if own.pipeline.degree > 1:
            assert plan.prediction.step_time_s < own.prediction.step_time_s  # bubbles filled
            assert plan.prediction.bubble_s < own.prediction.bubble_s
        else:
            assert plan.prediction.step_time_s == pytest.approx(own.prediction.step_time_s)


def test_shared_layer_costs_reuse_costs_without_changing_a_prediction(setup):
    import importlib

    ev = importlib.import_module("tessera.cost.evaluate")  # the module (the package exports the function)

    m, c, w = setup
    plans = [manual_plan(m, c, w, tp=2, pp=2, sp="megatron", zero=1, micro_batch_size=2),
             manual_plan(m, c, w, zero=3, micro_batch_size=1, recompute="full")]
    alone = [evaluate(p) for p in plans]
    with ev.shared_layer_costs():
        with ev.shared_layer_costs():  # nested: the outer memo
            shared = [evaluate(p) for p in plans] + [evaluate(p) for p in plans]
        contexts = len(ev._shared["contexts"])
    assert shared == alone + alone
    assert contexts == 2  # one (cluster, workload, stage, micro-batch) context per plan, reused the 2nd time
    assert ev._shared is None  # dropped with the block
