"""Per-step sequence-parallel planning (tessera.adapt): brute force, memory, static bound."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.adapt import plan_step, solve_step
from tessera.adapt.seqcost import SeqCostModel, Strategy, cost_model_from_budget
from tessera.adapt.seqmilp import milp_micro_batch
from tessera.adapt.seqpar import Items, best_static, solve_micro_batch_heuristic, solve_static, step_lower_bound
from tessera.errors import TesseraError
from tessera.spec.presets import get_model, make_cluster

from tests.adapt_bruteforce import best_micro_batch, best_step, size_multisets


def toy_cost(cap: float, zero_s: float = 0.0, num_devices: int = 4, recompute: str = "selective",
             scale: float = 1.0) -> SeqCostModel:
    """4 devices; all-to-all cost grows with the degree; quadratic attention; `cap` tokens per
    device; with zero_s > 0, ZeRO-3-like traffic (a third under forward) and a replica all-reduce."""
    degrees = np.array([1, 2, 4])
    lin = scale * 1e-3 / degrees + np.array([0.0, 1e-4, 1.5e-4])
    return SeqCostModel(num_devices=num_devices, degrees=degrees, alpha_s=np.array([0.0, 0.05, 0.12]),
                        lin_s=lin, attn_s=scale * 2e-7 / degrees, cap_tokens=cap * degrees,
                        gather_s=np.array([zero_s / 3]), reduce_s=np.array([zero_s / 3]),
                        replica_s=np.array([zero_s / 2]), overlap_slowdown=1.1 if zero_s else 1.0,
                        strategy=Strategy(3, recompute))


def random_cases(count: int, seed: int):
    rng = np.random.default_rng(seed)
    cases = []
    while len(cases) < count:
        cost = toy_cost(float(rng.choice([3000.0, 6000.0, 1e9])), float(rng.choice([0.0, 0.5])))
        lens = (rng.pareto(1.2, 5) * 300 + 50).astype(int)
        if lens.max() <= 4 * cost.cap_tokens[0] and lens.sum() <= 4 * cost.cap_tokens[0]:
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


def test_recompute_per_group_against_brute_force():
    """Groups of one micro-batch may differ in recompute: a cheap one with little memory beside a
    dear one with plenty; the MILP over the (degree, recompute) classes is optimal."""
    rng = np.random.default_rng(4)
    for _ in range(12):
        lean, roomy = toy_cost(2500.0, recompute="none"), toy_cost(9000.0, recompute="full", scale=1.3)
        lens = (rng.pareto(1.2, 5) * 400 + 100).astype(int)
        if lens.max() > 4 * 9000:
            continue
        items = Items.of_sequences(lens, [lean, roomy])
        optimum = best_micro_batch([lean, roomy], lens, list(range(len(lens))))
        exact = milp_micro_batch(items, np.arange(len(lens)), time_limit_s=60.0)
        assert exact.time_s == pytest.approx(optimum, rel=1e-6)
        assert {g.recompute for g in exact.groups} <= {"none", "full"}


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
    """Every sequence once; aligned power-of-two groups covering all ranks; memory within capacity."""
    seen = sorted(s for mb in plan.micro_batches for g in mb.groups for s in g.sequences)
    assert seen == list(range(len(lens)))
    for mb in plan.micro_batches:
        ranks = sorted(r for g in mb.groups for r in g.ranks)
        assert ranks == list(range(cost.num_devices))
        for g in mb.groups:
            d = g.degree
            assert d & (d - 1) == 0 and g.ranks[0] % d == 0 and list(g.ranks) == list(range(g.ranks[0], g.ranks[0] + d))
            assert sum(lens[s] for s in g.sequences) <= cost.token_capacity(d) * (1 + 1e-9)


LLAMA_16 = cost_model_from_budget(get_model("llama2-7b"), make_cluster("h100-80gb", 16), shard=8)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(min_value=16, max_value=160_000), min_size=1, max_size=96))
def test_memory_bound_is_never_broken_and_never_slower_than_static(lens):
    cost = LLAMA_16.default
    lens = [min(n, cost.longest_fitting) for n in lens]
    plan = plan_step(0, lens, LLAMA_16)
    check_step_plan(plan, cost, lens)
    items = Items.of_sequences(lens, cost)
    for degree in cost.degrees:
        for balance in ("cost", "tokens"):
            static = solve_static(items, int(degree), balance)
            if static is not None:
                assert plan.predicted_time_s <= static.time_s * (1 + 1e-9)


def test_adaptive_beats_static_on_a_long_tailed_batch():
    rng = np.random.default_rng(3)
    lens = np.concatenate([rng.integers(100, 3000, 250), [40_000, 20_000, 10_000]])
    costs = cost_model_from_budget(get_model("llama2-7b"), make_cluster("h100-80gb", 64), shard=8)
    sol = solve_step(lens, costs, time_budget_s=10.0)
    static = best_static(Items.of_sequences(lens, costs.default))
    assert sol.method.startswith("adaptive") and sol.time_s < 0.9 * static.time_s
    sizes = {g.degree for mb in sol.micro_batches for g in mb.groups}
    assert 1 in sizes and max(sizes) >= 8  # short sequences alone, the long one over many ranks


def test_more_micro_batches_cost_their_parameter_traffic():
    """Under ZeRO-3 every micro-batch re-gathers the parameters: the same groups split in two
    micro-batches cost the traffic twice, so the planner does not split what fits in one."""
    cost = toy_cost(1e9, zero_s=2.0)
    one = cost.step_time([1.0])
    two = cost.step_time([0.5, 0.5])
    assert two - one == pytest.approx(cost.micro_batch_time(0.5) * 2 - cost.micro_batch_time(1.0))
    assert two > one + 0.5  # 2 s of traffic per micro-batch, hidden under at most 1 s of compute
    lens = [400, 380, 350, 300, 250, 200]
    sol = solve_step(lens, cost, time_budget_s=10.0)
    assert len(sol.micro_batches) == 1


def test_sequence_too_long_for_all_devices_is_a_clear_error():
    with pytest.raises(TesseraError, match="a document of 50000 tokens does not fit in memory under any plan: "
                                           "the longest that fits is 4000 tokens"):
        plan_step(0, [100, 50_000], toy_cost(cap=1000.0))
