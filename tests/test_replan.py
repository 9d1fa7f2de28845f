"""Planning for devices of unequal speed (Malleus): the cost model, `replan` against enumeration,
and the search on a cluster with a slow device. No torch."""
from __future__ import annotations

import itertools

import pytest

from tessera.cost import evaluate
from tessera.cost.hetero import replica_groups
from tessera.plan import Plan
from tessera.search import manual_plan, search
from tessera.search.replan import best_shares, best_split, replan, with_speeds
from tessera.spec.hf_config import resolve_model_config
from tessera.spec.model import ModelSpec
from tessera.spec.presets import make_cluster
from tessera.spec.presets.clusters import local_cpu_cluster
from tessera.spec.workload import Workload

TINY = ModelSpec.from_config(resolve_model_config("tiny-llama"))


def _plan(dp: int, pp: int = 1, G: int = 24, mbs: int | None = None) -> Plan:
    mbs = mbs or G // (dp * 2)
    return manual_plan(TINY, local_cpu_cluster(dp * pp), Workload(global_batch=G, seq_len=128, dtype="fp32"),
                       dp=dp, pp=pp, micro_batch_size=mbs)


def test_uneven_speeds_and_shares_in_the_cost_model():
    plan = _plan(4)
    even = evaluate(plan).step_time_s
    assert evaluate(with_speeds(plan, {2: 1.0})).step_time_s == even  # 1.0 is dropped: the same plan
    slow = with_speeds(plan, {2: 0.5})
    assert evaluate(slow).step_time_s > 1.5 * even  # the replica with rank 2 sets the step
    groups = {(g.rows_ratio, g.speeds): g.count for g in replica_groups(slow)}
    assert groups == {(1.0, (1.0,)): 3, (1.0, (0.5,)): 1}
    # fewer rows on the slow replica, more elsewhere: faster than equal shares at these speeds
    moved = slow.model_copy(update={"batch_shares": (8, 8, 2, 6)})
    moved._check()
    assert evaluate(moved).step_time_s < evaluate(slow).step_time_s


def test_batch_shares_are_validated():
    plan = _plan(4)
    for shares, why in (((8, 8, 8), "3 entries for 4"), ((8, 8, 8, 8), "sum to 32"),
                        ((12, 6, 5, 1), "not a positive multiple")):
        bad = plan.model_dump()
        bad["batch_shares"] = shares
        with pytest.raises(ValueError, match=why):
            Plan.model_validate(bad)


def _enumerated_best_shares(plan: Plan) -> float:
    """min over every share vector (multiples of m, >= m, summing to G) of the worst replica's
    time, by the same affine replica times `best_shares` uses."""
    from tessera.search.replan import max_rows_ratio, replica_times

    m, G, dp = plan.num_micro_batches, plan.workload.global_batch, plan.dp_of_batch
    nominal = G / dp
    cap = int(max_rows_ratio(plan) * nominal / m + 1e-9)
    times = replica_times(plan)
    best = float("inf")
    for units in itertools.product(range(1, min(cap, G // m) + 1), repeat=dp):
        if sum(units) != G // m:
            continue
        best = min(best, max(a + b * u * m / nominal for (a, b), u in zip(times, units)))
    return best


@pytest.mark.parametrize("speeds", [{1: 0.5}, {0: 0.3, 2: 0.7}, {3: 0.9}, {}])
def test_best_shares_is_the_enumerated_optimum(speeds):
    from tessera.search.replan import replica_times

    plan = with_speeds(_plan(4, G=24, mbs=3), speeds)
    shares = best_shares(plan)
    assert sum(shares) == 24 and all(x % plan.num_micro_batches == 0 for x in shares)
    times = replica_times(plan)
    got = max(a + b * x / 6 for (a, b), x in zip(times, shares))
    assert got == pytest.approx(_enumerated_best_shares(plan), rel=1e-12)


def test_replan_split_is_the_enumerated_best_split():
    """llama2-7b on 2 nodes, pp 2 x tp 8, a device of the first stage at half speed: the re-cut
    split is the best of every split the cost model can score."""
    from tessera.plan import PipelineSpec

    model = ModelSpec.from_config(resolve_model_config("llama2-7b"))
    plan = manual_plan(model, make_cluster("h100-80gb", 16, 8), Workload(global_batch=64, seq_len=2048),
                       pp=2, tp=8, dp=1, micro_batch_size=1, zero=1)
    new = replan(plan, {3: 0.5})
    base = with_speeds(plan, {3: 0.5})
    L = len(model.layers)
    every = [evaluate(base.model_copy(update={"pipeline": PipelineSpec(
        degree=2, schedule=plan.pipeline.schedule, stages=((0, c), (c, L)))})).step_time_s for c in range(1, L)]
    assert new.pipeline.stages[0][1] < plan.pipeline.stages[0][1]  # layers left the slow stage
    assert new.prediction.step_time_s == pytest.approx(min(every), rel=1e-12)
    assert best_split(base) == new.pipeline.stages
    assert "re-planned for unequal device speeds" in new.search.explanation[0]


def test_replan_recovers_most_of_a_slow_replica():
    plan = _plan(4, G=32, mbs=4)
    even = evaluate(plan).step_time_s
    new = replan(plan, {2: 1 / 3})
    slow = evaluate(with_speeds(plan, {2: 1 / 3})).step_time_s
    assert new.batch_shares and new.batch_shares[2] < min(new.batch_shares[i] for i in (0, 1, 3))
    assert new.prediction.step_time_s < slow
    # three devices at full speed and one at a third do the work of 3.33: the ideal is even * 4 / 3.33
    assert new.prediction.step_time_s < 1.35 * even * 4 / (3 + 1 / 3)


def test_replan_on_1024_gpus():
    """llama3-70b on 1,024 H100s (pp 8 x tp 8 x dp 16): two slow devices in one stage."""
    model = ModelSpec.from_config(resolve_model_config("llama3-70b"))
    cluster = make_cluster("h100-80gb", 1024, 8)
    plan = manual_plan(model, cluster, Workload(global_batch=1024, seq_len=4096), pp=8, tp=8, dp=16,
                       micro_batch_size=1, zero=1, recompute="full")
    new = replan(plan, {5: 0.5, 133: 0.8})
    before = evaluate(with_speeds(plan, {5: 0.5, 133: 0.8}))
    assert new.prediction.fits and new.prediction.step_time_s < before.step_time_s
    assert new.search.search_time_s < 5.0  # < 1 s on a quiet machine (benchmarks/recovery.py)


def test_search_with_a_slow_device_is_no_worse_than_the_homogeneous_plan_there():
    model = ModelSpec.from_config(resolve_model_config("llama2-7b"))
    cluster = make_cluster("h100-80gb", 16, 8)
    workload = Workload(global_batch=128, seq_len=2048)
    speeds = {3: 0.5}
    homogeneous = search(model, cluster, workload)
    there = evaluate(with_speeds(homogeneous, speeds)).step_time_s
    hetero = search(model, cluster.model_copy(update={"device_speeds": speeds}), workload)
    assert hetero.prediction.step_time_s <= there * (1 + 1e-9)
    assert hetero.cluster.device_speeds == speeds
    assert 0 < hetero.search.step_lower_bound_s <= hetero.prediction.step_time_s
