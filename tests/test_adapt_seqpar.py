"""Per-step sequence-parallel planning (tessera.adapt): brute force, memory, static bound."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.adapt import cost_model, plan_step, solve_step
from tessera.adapt.seqcost import SeqCostModel, activation_bytes_per_token, cost_model_from_budget
from tessera.adapt.seqmilp import milp_micro_batch
from tessera.adapt.seqpar import Items, best_static, solve_micro_batch_heuristic, solve_static, step_lower_bound
from tessera.cost.compute import layer_compute_time
from tessera.errors import TesseraError
from tessera.spec.presets import get_model, make_cluster

from tests.adapt_bruteforce import best_micro_batch, best_step, size_multisets


def toy_cost(budget: float, zero_s: float = 0.0, num_devices: int = 4) -> SeqCostModel:
    """4 devices; all-to-all cost grows with the degree; quadratic attention; 1 byte per token;
    with zero_s > 0, ZeRO-3-like traffic (a third under forward) and a gradient sync per step."""
    degrees = np.array([1, 2, 4])
    return SeqCostModel(num_devices=num_devices, degrees=degrees, lin_s_per_token=1e-3, attn_s_per_token2=2e-7,
                        a2a_alpha_s=np.array([0.0, 0.05, 0.12]), a2a_beta_s_per_token=np.array([0.0, 1e-4, 1.5e-4]),
                        act_bytes_per_token=1.0, budget_bytes=budget, zero_fwd_s=zero_s / 3,
                        zero_bwd_s=2 * zero_s / 3, step_sync_s=zero_s / 2,
                        overlap_slowdown=1.1 if zero_s else 1.0)


def random_cases(count: int, seed: int):
    rng = np.random.default_rng(seed)
    cases = []
    while len(cases) < count:
        cost = toy_cost(float(rng.choice([3000.0, 6000.0, 1e9])), float(rng.choice([0.0, 0.5])))
        lens = (rng.pareto(1.2, 5) * 300 + 50).astype(int)
        if lens.max() <= 4 * cost.budget_bytes and lens.sum() <= 4 * cost.budget_bytes:
            cases.append((cost, lens))
    return cases


def test_size_multisets_are_the_power_of_two_partitions():
    assert size_multisets(4) == [(4,), (2, 2), (2, 1, 1), (1, 1, 1, 1)]
    assert all(sum(s) == 8 for s in size_multisets(8)) and len(size_multisets(8)) == 10


def test_milp_and_heuristic_against_brute_force_on_one_micro_batch():
    gaps = []
    for cost, lens in random_cases(30, seed=0):
        items = Items.of_sequences(lens, cost)
        idx = np.arange(len(lens))
        optimum = best_micro_batch(cost, lens, list(range(len(lens))))
        exact = milp_micro_batch(items, idx, time_limit_s=60.0)  # optimal, whatever the machine load
        assert exact.time_s == pytest.approx(optimum, rel=1e-6)
        heuristic, _ = solve_micro_batch_heuristic(items, idx)
        assert heuristic.time_s >= optimum * (1 - 1e-9)
        gaps.append(heuristic.time_s / optimum)
    assert max(gaps) < 1.05, gaps
    assert np.mean(np.isclose(gaps, 1.0, rtol=1e-6)) >= 0.8, gaps


def test_whole_step_against_brute_force_over_micro_batch_splits():
    ratios = []
    for cost, lens in random_cases(10, seed=1):
        optimum = best_step(cost, lens)
        sol = solve_step(lens, cost, time_budget_s=30.0)  # the MILP refines every micro-batch, whatever the load
        assert sol.time_s >= optimum * (1 - 1e-9)
        assert step_lower_bound(Items.of_sequences(lens, cost)) <= optimum * (1 + 1e-9)
        ratios.append(sol.time_s / optimum)
    assert max(ratios) < 1.10, ratios
    assert np.mean(np.isclose(ratios, 1.0, rtol=1e-6)) >= 0.7, ratios


def check_step_plan(plan, cost: SeqCostModel, lens) -> None:
    """Every sequence once; aligned power-of-two groups covering all ranks; memory within budget."""
    seen = sorted(s for mb in plan.micro_batches for g in mb.groups for s in g.sequences)
    assert seen == list(range(len(lens)))
    for mb in plan.micro_batches:
        ranks = sorted(r for g in mb.groups for r in g.ranks)
        assert ranks == list(range(cost.num_devices))
        for g in mb.groups:
            d = g.degree
            assert d & (d - 1) == 0 and g.ranks[0] % d == 0 and list(g.ranks) == list(range(g.ranks[0], g.ranks[0] + d))
            tokens = sum(lens[s] for s in g.sequences)
            assert cost.act_bytes_per_token * tokens / d <= cost.budget_bytes * (1 + 1e-9)


LLAMA_16 = cost_model_from_budget(get_model("llama2-7b"), make_cluster("h100-80gb", 16), shard=8)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(min_value=16, max_value=160_000), min_size=1, max_size=96))
def test_memory_bound_is_never_broken_and_never_slower_than_static(lens):
    cost = LLAMA_16
    longest = float(cost.token_capacity(cost.degrees[-1]))
    lens = [min(n, int(longest)) for n in lens]
    plan = plan_step(0, lens, None, None, cost)
    check_step_plan(plan, cost, lens)
    items = Items.of_sequences(lens, cost)
    for degree in cost.degrees:
        for balance in ("cost", "tokens"):
            static = solve_static(items, int(degree), balance)
            if static is not None:
                assert plan.predicted_time_s <= static.time_s * (1 + 1e-9)


def test_adaptive_beats_static_on_a_long_tailed_batch():
    rng = np.random.default_rng(3)
    lens = np.concatenate([rng.integers(100, 3000, 250), [120_000, 60_000, 30_000]])
    cost = cost_model_from_budget(get_model("llama2-7b"), make_cluster("h100-80gb", 64), shard=8)
    sol = solve_step(lens, cost)
    static = best_static(Items.of_sequences(lens, cost))
    assert sol.method.startswith("adaptive") and sol.time_s < 0.9 * static.time_s
    sizes = {g.degree for mb in sol.micro_batches for g in mb.groups}
    assert 1 in sizes and max(sizes) >= 8  # short sequences alone, the long one over many ranks


def test_sequence_too_long_for_all_devices_is_a_clear_error():
    with pytest.raises(TesseraError, match="does not fit in memory even over all 4 devices"):
        plan_step(0, [100, 50_000], None, None, toy_cost(budget=1000.0))


def test_cost_model_matches_the_layer_primitives():
    model, cluster = get_model("llama2-7b"), make_cluster("h100-80gb", 64)
    cost = cost_model(model, cluster, 40e9, recompute="selective")
    n, d = 8192, 4
    expected = 0.0
    for layer in model.layers:
        rc = "selective" if layer.kind.value == "decoder" else "none"
        expected += sum(layer_compute_time(layer, n, n, d, cluster, "bf16", rc))
    got = cost.compute_time([n])[0] / d
    assert got == pytest.approx(expected, rel=1e-9)
    # all-to-all: zero at degree 1, dearer per token once a group spans nodes (degree 16 > 8 per node)
    per_rank = cost.a2a_beta_s_per_token * cost.degrees
    assert per_rank[0] == 0 and per_rank[4] > 2 * per_rank[3]
    assert cost.budget_bytes == 40e9
    full, sel, none = (activation_bytes_per_token(model.layers, (rc,) * len(model.layers)) for rc in ("full", "selective", "none"))
    assert full < sel < none


def test_cost_model_from_a_static_plan():
    from tessera.search.baselines import manual_plan
    from tessera.spec.workload import Workload

    model, cluster = get_model("llama2-7b"), make_cluster("h100-80gb", 64)
    workload = Workload(global_batch=64, seq_len=32768)
    plan = manual_plan(model, cluster, workload, sp="ulysses", sp_degree=8, zero=3, recompute="selective")
    cost = cost_model(model, cluster, plan)
    peak = max(plan.prediction.stage_memory, key=lambda m: m.total)
    states = peak.params + peak.grads + peak.optimizer + peak.buffers
    assert cost.budget_bytes == pytest.approx(cluster.device.memory_bytes - cluster.device.reserved_bytes - states)
    assert 0 < cost.zero_fwd_s < cost.zero_bwd_s  # ZeRO-3 gathers under every micro-batch, + reduce-scatter
    assert cost.step_sync_s == 0  # one shard group over all 64 ranks: no replicas to all-reduce
    assert cost.act_bytes_per_token == pytest.approx(
        activation_bytes_per_token(model.layers, tuple(s.recompute.value for s in plan.layers)))
    step_plan = plan_step(3, [500, 40_000, 1200], model, cluster, plan)
    assert step_plan.step == 3 and step_plan.predicted_time_s > 0
    with pytest.raises(TesseraError, match="without pipeline or tensor parallelism"):
        cost_model(model, cluster, manual_plan(model, cluster, workload, tp=2, zero=1))
