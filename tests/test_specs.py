"""Model and cluster specs against published figures, and the plan's JSON contract."""
import json

import pytest

from tessera.cost.comm import collective_time, members_per_node
from tessera.plan import LayerStrategy, PipelineSpec, Plan, PlanError
from tessera.spec import Workload
from tessera.spec.presets import UnknownModelError, get_model, make_cluster


@pytest.mark.parametrize("name, params", [
    ("gpt2", 124_439_808),          # HF gpt2: 124,439,808
    ("llama2-7b", 6_738_415_616),   # HF Llama-2-7b-hf: 6,738,415,616
    ("llama3-8b", 8_030_261_248),   # HF Meta-Llama-3-8B: 8,030,261,248
    ("mixtral-8x7b", 46_702_792_704),  # HF Mixtral-8x7B-v0.1: 46,702,792,704
])
def test_parameter_counts_match_published(name, params):
    assert get_model(name).num_params == params


def test_unknown_model_lists_known_ones():
    with pytest.raises(UnknownModelError, match="known models: .*llama2-7b"):
        get_model("llama9-1t")


def test_cluster_rejects_partial_nodes():
    with pytest.raises(ValueError, match="not a multiple of --gpus-per-node 8"):
        make_cluster("h100-80gb", 12, 8)


def test_ring_collectives_follow_alpha_beta():
    c = make_cluster("h100-80gb", 16, 8)
    n = 1e9
    intra = collective_time(c, "all_reduce", n, 8, stride=1)
    bw = c.intra_node.bandwidth
    assert intra == pytest.approx(c.collective_latency + 2 * 7 / 8 * n / bw + 14 * c.intra_node.latency)
    # The same group size laid out across nodes runs at the network's bandwidth.
    assert members_per_node(8, 8, 8) == 1
    assert collective_time(c, "all_reduce", n, 2, stride=8) > collective_time(c, "all_reduce", n, 2, stride=1)


def _plan(**kw):
    m = get_model("llama2-7b")
    n = len(m.layers)
    args = dict(model=m, cluster=make_cluster("h100-80gb", 8), workload=Workload(global_batch=16, seq_len=4096),
                micro_batch_size=2, num_micro_batches=4,
                pipeline=PipelineSpec(degree=2, stages=((0, 17), (17, n))),
                layers=tuple(LayerStrategy(dp=2, tp=2, sp="megatron") for _ in range(n)))
    args.update(kw)
    return Plan(**args)


def test_plan_json_round_trips():
    plan = _plan()
    assert Plan.from_json(plan.to_json()) == plan


def test_plan_refuses_other_version_and_typos():
    text = _plan().to_json()
    data = json.loads(text)
    data["version"] = 0
    with pytest.raises(PlanError, match="version 0 is not supported"):
        Plan.from_json(json.dumps(data))
    with pytest.raises(PlanError, match="tpp"):
        Plan.from_json(text.replace('"tp": 2', '"tpp": 2', 1))


def test_plan_checks_degrees_against_devices():
    n = len(get_model("llama2-7b").layers)
    with pytest.raises(ValueError, match="uses dp\\*cp\\*sp\\*tp=8 devices, its stage has 4"):
        _plan(layers=tuple(LayerStrategy(dp=4, tp=2) for _ in range(n)), micro_batch_size=1)


def test_plan_refuses_other_model():
    with pytest.raises(PlanError, match="made for model 'llama2-7b'"):
        _plan().check_matches(model=get_model("gpt2"))


@pytest.mark.parametrize("peak", [0.0, -1.0, float("nan"), float("inf")])
def test_device_refuses_non_positive_or_non_finite_peaks(peak):
    from tessera.spec.cluster import DeviceSpec

    with pytest.raises(ValueError, match="peak_flops\\[bf16\\] must be a positive number"):
        DeviceSpec(name="x", memory_bytes=1e9, memory_bandwidth=1e9, peak_flops={"bf16": peak})
