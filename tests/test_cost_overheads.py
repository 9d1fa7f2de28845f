"""Measured fixed costs in the cost model: `call_overhead_s` on every plan, `tp_overhead_s` on TP only."""
import pytest

from tessera.search import manual_plan
from tessera.spec import Workload
from tessera.spec.presets import get_model, local_cpu_cluster

CALL, TP = 2e-3, 5e-3  # seconds per layer per micro-batch, forward + backward


def _with_overheads(model, call=0.0, tp=0.0):
    layers = tuple(l.model_copy(update=dict(call_overhead_s=call, tp_overhead_s=tp)) for l in model.layers)
    return model.model_copy(update={"layers": layers})


@pytest.mark.parametrize("tp", [1, 2])
def test_overheads_add_exactly_to_a_one_micro_batch_step(tp):
    # pp=1, dp=1, one micro-batch: the step is the sum of every layer's forward and backward.
    model, cluster = get_model("tiny-llama"), local_cpu_cluster(tp)
    work = Workload(global_batch=1, seq_len=128)
    base = manual_plan(model, cluster, work, tp=tp, micro_batch_size=1).prediction
    n = len(model.layers)
    call = manual_plan(_with_overheads(model, call=CALL), cluster, work, tp=tp, micro_batch_size=1).prediction
    assert call.step_time_s - base.step_time_s == pytest.approx(n * CALL, rel=1e-9)
    both = manual_plan(_with_overheads(model, call=CALL, tp=TP), cluster, work, tp=tp, micro_batch_size=1).prediction
    expected = n * (CALL + (TP if tp > 1 else 0.0))  # tp_overhead_s only where tp > 1
    assert both.step_time_s - base.step_time_s == pytest.approx(expected, rel=1e-9)


def test_overheads_split_one_third_forward_two_thirds_backward():
    from tessera.cost.evaluate import _per_layer_costs, plan_context

    model, cluster = get_model("tiny-llama"), local_cpu_cluster(2)
    work = Workload(global_batch=1, seq_len=128)
    base = manual_plan(model, cluster, work, tp=2)
    over = manual_plan(_with_overheads(model, call=CALL, tp=TP), cluster, work, tp=2)
    for b, o in zip(_per_layer_costs(base, plan_context(base)), _per_layer_costs(over, plan_context(over))):
        assert float(o.fwd[0] - b.fwd[0]) == pytest.approx((CALL + TP) / 3, rel=1e-9)
        assert float(o.bwd[0] - b.bwd[0]) == pytest.approx(2 * (CALL + TP) / 3, rel=1e-9)


SP, Z3 = 7e-3, 3e-3


@pytest.mark.parametrize("kwargs, charged", [
    (dict(), CALL),
    (dict(tp=2), CALL + TP),
    (dict(sp="ulysses", sp_degree=2), CALL + SP),
    (dict(zero=3), CALL + Z3),
    (dict(zero=2), CALL),  # the ZeRO-3 overhead is FSDP2 resharding's: not charged to ZeRO-2
])
def test_each_parallel_overhead_is_charged_only_where_its_strategy_runs(kwargs, charged):
    from tessera.cost.evaluate import _per_layer_costs, plan_context

    model, cluster = get_model("tiny-llama"), local_cpu_cluster(2)
    work = Workload(global_batch=2, seq_len=128)
    blocks = {l.name for l in model.layers[1:-1]}
    layers = tuple(l.model_copy(update=dict(call_overhead_s=CALL, tp_overhead_s=TP, sp_overhead_s=SP,
                                            zero3_overhead_s=Z3)) if l.name in blocks else l
                   for l in model.layers)
    over = model.model_copy(update={"layers": layers})
    base_plan = manual_plan(model, cluster, work, micro_batch_size=1, **kwargs)
    over_plan = manual_plan(over, cluster, work, micro_batch_size=1, **kwargs)
    pairs = zip(model.layers, _per_layer_costs(base_plan, plan_context(base_plan)),
                _per_layer_costs(over_plan, plan_context(over_plan)))
    for layer, b, o in pairs:
        expected = charged if layer.name in blocks else 0.0
        assert float(o.compute_fwd[0] - b.compute_fwd[0]) == pytest.approx(expected / 3, rel=1e-9, abs=1e-15)
        assert float(o.compute_bwd[0] - b.compute_bwd[0]) == pytest.approx(2 * expected / 3, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("kwargs, factor", [
    (dict(), 1.0),
    (dict(tp=2), 1.25),
    (dict(sp="ulysses", sp_degree=2), 1.5),
    (dict(tp=2, sp="ulysses", sp_degree=2), 1.75),
    (dict(zero=3), 1.0),
])
def test_tp_and_ulysses_slowdowns_scale_the_compute_where_they_run(kwargs, factor):
    from tessera.cost.evaluate import _per_layer_costs, plan_context

    model, cluster = get_model("tiny-llama"), local_cpu_cluster(4)
    work = Workload(global_batch=4, seq_len=128)
    layers = tuple(l.model_copy(update=dict(tp_slowdown=0.25, sp_slowdown=0.5)) for l in model.layers)
    slow = model.model_copy(update={"layers": layers})
    base_plan = manual_plan(model, cluster, work, micro_batch_size=1, recompute="full", **kwargs)
    slow_plan = manual_plan(slow, cluster, work, micro_batch_size=1, recompute="full", **kwargs)
    for b, o in zip(_per_layer_costs(base_plan, plan_context(base_plan)),
                    _per_layer_costs(slow_plan, plan_context(slow_plan))):
        for field in ("compute_fwd", "compute_bwd", "wgrad"):  # full recompute replays the slower forward too
            assert float(getattr(o, field)[0]) == pytest.approx(factor * float(getattr(b, field)[0]), rel=1e-9)


@pytest.mark.parametrize("tp, over, slow", [(2, TP, 0.25), (4, 3 * TP, 1.5)])
def test_wider_tp_degrees_use_the_terms_measured_at_the_largest_degree_below(tp, over, slow):
    from tessera.cost.evaluate import _per_layer_costs, plan_context
    from tessera.spec.model import TPDegreeCost

    model, cluster = get_model("tiny-llama"), local_cpu_cluster(tp)
    work = Workload(global_batch=1, seq_len=128)
    wide = (TPDegreeCost(degree=4, overhead_s=3 * TP, slowdown=1.5),)
    layers = tuple(l.model_copy(update=dict(tp_overhead_s=TP, tp_slowdown=0.25, tp_wider=wide)) for l in model.layers)
    measured = model.model_copy(update={"layers": layers})
    assert [l.tp_costs(d) for l in layers[:1] for d in (1, 2, 4, 8)] == [(0.0, 0.0), (TP, 0.25), (3 * TP, 1.5),
                                                                       (3 * TP, 1.5)]
    base = manual_plan(model, cluster, work, tp=tp, micro_batch_size=1)
    plan = manual_plan(measured, cluster, work, tp=tp, micro_batch_size=1)
    for b, o in zip(_per_layer_costs(base, plan_context(base)), _per_layer_costs(plan, plan_context(plan))):
        # compute x (1 + slowdown), then the fixed overhead, 1/3 forward
        assert float(o.compute_fwd[0]) == pytest.approx((1 + slow) * float(b.compute_fwd[0]) + over / 3, rel=1e-9)


def test_tp_wider_degrees_must_ascend():
    from tessera.spec.model import TPDegreeCost

    layer = get_model("tiny-llama").layers[1]
    with pytest.raises(ValueError, match=r"tp_wider degrees must ascend without repeats, got \[8, 4\]"):
        type(layer).model_validate(layer.model_dump() | {"tp_wider": [
            TPDegreeCost(degree=8, overhead_s=0.0, slowdown=0.0).model_dump(),
            TPDegreeCost(degree=4, overhead_s=0.0, slowdown=0.0).model_dump()]})
