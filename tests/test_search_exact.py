"""The search against exhaustive enumeration of the same space under the same cost model."""
import itertools

import numpy as np
import pytest

from tessera.cost import evaluate
from tessera.cost.memory import required_memory
from tessera.cost.layer import StepContext, StrategyTable, layer_costs, shape_key, transition_time
from tessera.plan import PipelineSpec, Plan, Schedule
from tessera.search import SearchOptions, search
from tessera.search.space import candidate_strategies
from tessera.spec import ModelSpec, TransformerConfig, Workload
from tessera.spec.presets import make_cluster

SMALL = TransformerConfig(name="small", hidden=1024, num_layers=3, num_heads=16, num_kv_heads=8,
                          ffn_hidden=2816, vocab_size=32000, max_seq_len=4096)
# A small space: tp 1 or 2, ZeRO 0 or 3, recompute none or full; the shipped DP settings.
OPTIONS = dict(max_tp=2, zero_stages=(0, 3), recompute=("none", "full"), allow_offload=False,
               allow_hsdp=False, allow_ulysses=False, allow_cp=False, schedules=("1f1b",))


def _with_memory(cluster, gib):
    # No planner margin: the budgets below are the device memory itself.
    return cluster.model_copy(update={"device": cluster.device.model_copy(update={"memory_bytes": gib * 2**30}),
                                      "memory_margin": 0.0})


def _brute_force_pp1(model, cluster, workload, options):
    """Every assignment of candidate strategies to layers, every micro-batch count, pp = 1:
    step = m * sum(fwd + bwd + re-sharding) + sum(step) and memory as in cost/evaluate.py."""
    n = cluster.num_gpus
    results = []  # (step, peak, m, assignment)
    for m in [d for d in range(1, workload.global_batch + 1) if workload.global_batch % d == 0]:
        B = workload.global_batch // m
        ctx = StepContext(cluster=cluster, workload=workload, stage_size=n, micro_batch_seqs=B)
        per_layer = []
        for layer in model.layers:
            strategies = candidate_strategies(layer, n, B, cluster, options)
            if not strategies:
                break
            costs = layer_costs(layer, StrategyTable.build(strategies), ctx)
            per_layer.append((strategies, costs))
        else:
            for pick in itertools.product(*[range(len(s)) for s, _ in per_layer]):
                t = sum(m * (c.fwd[j] + c.bwd[j]) + c.step[j] for (s, c), j in zip(per_layer, pick))
                lay = [shape_key(per_layer[i][0][j]) for i, j in enumerate(pick)]
                t += sum(m * transition_time(model.layers[i].hidden, lay[i - 1], lay[i], ctx)
                         for i in range(1, len(lay)) if lay[i - 1] != lay[i])
                mem = sum(c.states[j] + c.act[j] for (s, c), j in zip(per_layer, pick))
                mem = required_memory(mem + max(c.buf[j] for (s, c), j in zip(per_layer, pick)), cluster)
                results.append((float(t), float(mem), m, [per_layer[i][0][j] for i, j in enumerate(pick)]))
    return results


@pytest.fixture(scope="module")
def space():
    model = ModelSpec.from_config(SMALL)
    cluster = make_cluster("h100-80gb", 4).model_copy(update={"memory_margin": 0.0})
    workload = Workload(global_batch=8, seq_len=4096)
    options = SearchOptions(pp=1, **OPTIONS)
    return model, cluster, workload, options, _brute_force_pp1(model, cluster, workload, options)


def test_brute_force_objective_is_evaluate(space):
    model, cluster, workload, _, results = space
    rng = np.random.default_rng(0)
    for i in rng.choice(len(results), 5, replace=False):
        t, mem, m, layers = results[i]
        dp = max(s.dp for s in layers)
        plan = Plan(model=model, cluster=cluster, workload=workload, micro_batch_size=workload.global_batch // m // dp,
                    num_micro_batches=m, pipeline=PipelineSpec(degree=1, schedule=Schedule.ONE_F_ONE_B,
                                                               stages=((0, len(layers)),)), layers=tuple(layers))
        pred = evaluate(plan)
        assert pred.step_time_s == pytest.approx(t, rel=1e-9)
        assert pred.peak_memory == pytest.approx(mem, rel=1e-9)


def test_search_with_context_parallelism_finds_the_brute_force_optimum():
    """cp 1, 2 or 4 (with tp 1 or 2, ZeRO 0 or 3) on a long sequence and a small batch: the search
    equals the enumerated optimum at a tight and a roomy memory budget."""
    model = ModelSpec.from_config(SMALL.model_copy(update={"num_layers": 1, "max_seq_len": 32768}))
    cluster = make_cluster("h100-80gb", 4).model_copy(update={"memory_margin": 0.0})
    workload = Workload(global_batch=2, seq_len=32768)
    options = SearchOptions(pp=1, **{**OPTIONS, "allow_cp": True, "recompute": ("none",)})
    results = _brute_force_pp1(model, cluster, workload, options)
    assert {s.cp for r in results for s in r[3]} == {1, 2, 4}
    peaks = sorted(r[1] for r in results)
    for gib in (peaks[len(peaks) // 4] / 2**30 * 1.001, 80.0):
        feasible = [r for r in results if r[1] <= gib * 2**30]
        plan = search(model, _with_memory(cluster, gib), workload, options)
        assert plan.prediction.step_time_s == pytest.approx(min(r[0] for r in feasible), rel=1e-9)


def test_search_finds_the_brute_force_optimum_at_every_memory_budget(space):
    model, cluster, workload, options, results = space
    peaks = np.array(sorted({round(r[1] / 2**20) for r in results}))  # MiB, distinct
    # Budgets half-way between distinct peaks (away from ties), from tight to roomy.
    mids = (peaks[:-1] + peaks[1:]) / 2
    gaps = np.diff(peaks)
    mids = mids[gaps > 0.002 * peaks[1:]]
    budgets = mids[np.linspace(0, len(mids) - 1, 6).round().astype(int)]
    checked = 0
    for mib in budgets:
        limit = mib * 2**20
        feasible = [r for r in results if r[1] <= limit]
        plan = search(model, _with_memory(cluster, mib / 1024), workload, options)
        best = min(r[0] for r in feasible)
        assert plan.prediction.step_time_s == pytest.approx(best, rel=1e-9)
        assert plan.prediction.peak_memory <= limit
        # The bound the search proves holds and is within its tolerance of the plan.
        lower = plan.search.step_lower_bound_s
        assert lower <= best * (1 + 1e-12)
        assert plan.prediction.step_time_s <= lower * (1 + options.optimality_gap) * (1 + 1e-12)
        checked += 1
    assert checked == 6


def _brute_force_pipeline(model, cluster, workload, options, pp):
    """Every split, micro-batch count and per-layer assignment with pipeline degree `pp`, each
    scored by `evaluate` (schedule simulator included)."""
    n = cluster.num_gpus // pp
    L = len(model.layers)
    best = None
    for m in [d for d in range(1, workload.global_batch + 1) if workload.global_batch % d == 0]:
        B = workload.global_batch // m
        cands = [candidate_strategies(layer, n, B, cluster, options) for layer in model.layers]
        if not all(cands):
            continue
        for cut in itertools.combinations(range(1, L), pp - 1):
            stages = tuple(zip((0,) + cut, cut + (L,)))
            for layers in itertools.product(*cands):
                dp = max(s.dp for s in layers)
                plan = Plan(model=model, cluster=cluster, workload=workload, micro_batch_size=B // dp,
                            num_micro_batches=m, layers=layers,
                            pipeline=PipelineSpec(degree=pp, schedule=Schedule.ONE_F_ONE_B, stages=stages))
                pred = evaluate(plan)
                if pred.fits and (best is None or pred.step_time_s < best):
                    best = pred.step_time_s
    return best


@pytest.mark.parametrize("gib", [4.0, 80.0])
def test_pipelined_search_matches_brute_force(gib):
    cfg = SMALL.model_copy(update={"num_layers": 2})
    model = ModelSpec.from_config(cfg)
    cluster = _with_memory(make_cluster("h100-80gb", 4), gib)
    workload = Workload(global_batch=4, seq_len=4096)
    options = SearchOptions(pp=2, **{**OPTIONS, "recompute": ("none",)})
    best = _brute_force_pipeline(model, cluster, workload, options, 2)
    plan = search(model, cluster, workload, options)
    assert plan.prediction.step_time_s >= best * (1 - 1e-9)
    # The rank programs approximate the makespan's coupling of the ranks (planner.py, Exactness):
    # what is proved is the lower bound the plan carries; it must hold.
    assert 0 < plan.search.step_lower_bound_s <= best * (1 + 1e-12)
    assert plan.prediction.step_time_s <= best * 1.003  # what the search achieves on these instances


def test_context_estimates_bound_every_plan_of_their_micro_batch_count(space):
    """The planner's context estimate (FLOPs at the best GEMM rate + each micro-batch's kernel
    launches) is below every enumerated plan with that many micro-batches, and grows with m."""
    from tessera.cost.compute import fixed_seconds_per_micro_batch
    from tessera.search.planner import _Search

    model, cluster, workload, options, results = space
    contexts = _Search(model, cluster, workload, options)._contexts()
    assert len(contexts) == 4  # m = 1, 2, 4, 8
    checked = 0
    for c in contexts:
        steps = [r[0] for r in results if r[2] == c.m]
        if steps:  # no strategy splits one sequence over the 4 GPUs
            assert c.estimate <= min(steps)
            checked += 1
    assert checked >= 3
    fixed = sum(fixed_seconds_per_micro_batch(layer, cluster) for layer in model.layers)
    assert fixed > 0
    by_m = sorted((c.m, c.estimate) for c in contexts)
    for (m1, e1), (m2, e2) in zip(by_m, by_m[1:]):
        assert e2 - e1 == pytest.approx((m2 - m1) * fixed)


def test_search_with_a_tied_head_finds_the_constrained_brute_force_optimum():
    """An LM head tied to the embedding: the runtime shares the weight only when the two layers
    have one parameter layout (dp, ulysses, tp, ZeRO shard degree, cp), and the cost model prices
    the table once only then, so the search gives them one. It equals the enumerated optimum of
    the assignments that do, at a tight and a roomy budget."""
    tied = SMALL.model_copy(update={"num_layers": 1, "tie_embeddings": True})
    model = ModelSpec.from_config(tied)
    assert model.layers[-1].tied_params
    cluster = make_cluster("h100-80gb", 4).model_copy(update={"memory_margin": 0.0})
    workload = Workload(global_batch=8, seq_len=4096)
    options = SearchOptions(pp=1, **OPTIONS)
    key = lambda s: (s.dp, s.sp_degree, s.tp, s.shard_degree, s.cp)  # noqa: E731
    results = [r for r in _brute_force_pp1(model, cluster, workload, options) if key(r[3][0]) == key(r[3][-1])]
    peaks = sorted(r[1] for r in results)
    for gib in (peaks[len(peaks) // 3] / 2**30 * 1.001, 80.0):
        feasible = [r for r in results if r[1] <= gib * 2**30]
        plan = search(model, _with_memory(cluster, gib), workload, options)
        assert key(plan.layers[0]) == key(plan.layers[-1])
        assert plan.prediction.step_time_s == pytest.approx(min(r[0] for r in feasible), rel=1e-9)
        assert plan.search.step_lower_bound_s <= min(r[0] for r in feasible) * (1 + 1e-12)
