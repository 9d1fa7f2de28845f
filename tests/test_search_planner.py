"""Search behaviour: explanations, restrictions, infeasibility, and monotonicity properties."""
import re

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tessera.errors import TesseraError
from tessera.search import NoFeasiblePlanError, SearchOptions, baseline_plans, manual_plan, search
from tessera.spec import ModelSpec, TransformerConfig, Workload
from tessera.spec.presets import get_model, make_cluster

MID = TransformerConfig(name="mid", hidden=2048, num_layers=8, num_heads=16, num_kv_heads=8,
                        ffn_hidden=5632, vocab_size=32000, max_seq_len=4096)


def _with_memory(cluster, gib):
    return cluster.model_copy(update={"device": cluster.device.model_copy(update={"memory_bytes": gib * 2**30})})


@pytest.fixture(scope="module")
def llama7b_plan():
    return search(get_model("llama2-7b"), make_cluster("h100-80gb", 8), Workload(global_batch=64, seq_len=4096))


def test_search_explains_itself_and_beats_the_baselines(llama7b_plan):
    plan = llama7b_plan
    info = plan.search
    assert info.search_time_s > 0 and info.candidates > 0
    text = "\n".join(info.explanation)
    assert "chosen:" in text and "binding constraint:" in text and "why:" in text
    assert plan.prediction.fits
    for base in baseline_plans(plan.model, plan.cluster, plan.workload):
        if base.prediction.fits:
            assert plan.prediction.step_time_s <= base.prediction.step_time_s * (1 + 1e-9), base.name
            assert plan.search.step_lower_bound_s <= base.prediction.step_time_s  # the proved bound holds


def test_restrictions_are_honoured():
    model, cluster = get_model("llama2-7b"), make_cluster("h100-80gb", 16)
    wl = Workload(global_batch=64, seq_len=4096)
    plan = search(model, cluster, wl, SearchOptions(pp=2, tp=4, schedules=("1f1b",), allow_offload=False,
                                                    allow_recompute=False))
    assert plan.pipeline.degree == 2 and plan.pipeline.schedule.value == "1f1b"
    assert all(s.tp == 4 and not s.offload_optimizer and s.recompute.value == "none" for s in plan.layers)
    # torch's 1F1B refuses fewer micro-batches than stages: 4 sequences over pp=4 x dp=4 give at
    # most 1 micro-batch, so a 1F1B plan needs another split (context parallelism), GPipe not.
    small = Workload(global_batch=4, seq_len=4096)
    for schedules in (("1f1b",), ("1f1b", "gpipe")):
        try:
            plan = search(model, cluster, small, SearchOptions(pp=4, tp=1, schedules=schedules))
        except NoFeasiblePlanError:
            continue
        assert plan.pipeline.schedule.value != "1f1b" or plan.num_micro_batches >= 4
    plan = search(model, cluster, wl, SearchOptions(max_tp=2, micro_batch_sizes=(1,)))
    assert plan.micro_batch_size == 1 and all(s.tp <= 2 for s in plan.layers)


def test_memory_binds_and_the_explanation_says_so():
    model = ModelSpec.from_config(MID)
    plan = search(model, _with_memory(make_cluster("h100-80gb", 8), 6), Workload(global_batch=64, seq_len=4096))
    assert plan.prediction.peak_memory <= 6 * 2**30
    assert any(line.startswith("binding constraint: memory") for line in plan.search.explanation)


def test_a_model_that_fits_nowhere_says_what_it_needs():
    with pytest.raises(NoFeasiblePlanError) as err:
        search(get_model("llama3-405b"), make_cluster("h100-80gb", 8), Workload(global_batch=8, seq_len=4096))
    e = err.value
    assert isinstance(e, TesseraError)
    assert re.fullmatch(r"no plan fits in 80\.0 GiB per GPU: the best candidate needs [\d.]+ GiB \(pp=\d+, tp=\d+.*\); "
                        r"try more GPUs, a shorter sequence, a smaller micro-batch, or enabling offload", str(e))
    assert e.best_peak_bytes > e.device_bytes == 80 * 2**30


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small=st.sampled_from([9, 12, 16, 24]), extra=st.sampled_from([4, 16, 48]),
       seq=st.sampled_from([2048, 4096]))
def test_more_memory_never_gives_a_slower_plan(small, extra, seq):
    model, wl = ModelSpec.from_config(MID), Workload(global_batch=32, seq_len=seq)
    opts = SearchOptions(memory_bins=1024)
    tight = search(model, _with_memory(make_cluster("h100-80gb", 8), small), wl, opts)
    roomy = search(model, _with_memory(make_cluster("h100-80gb", 8), small + extra), wl, opts)
    # Each plan is within the search's tolerance of its own optimum, and optima only improve.
    assert roomy.prediction.step_time_s <= tight.prediction.step_time_s * (1 + opts.optimality_gap)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gpus=st.sampled_from([(8, 16), (16, 32), (8, 32)]), seq=st.sampled_from([2048, 4096]))
def test_more_gpus_never_give_lower_throughput(gpus, seq):
    model, wl = ModelSpec.from_config(MID), Workload(global_batch=64, seq_len=seq)
    few = search(model, make_cluster("h100-80gb", gpus[0]), wl)
    many = search(model, make_cluster("h100-80gb", gpus[1]), wl)
    assert many.prediction.tokens_per_s >= few.prediction.tokens_per_s / (1 + SearchOptions().optimality_gap)


# --- the search space ---------------------------------------------------------------------------
def test_interleave_depths_are_every_even_split_of_the_blocks():
    from tessera.search.space import virtual_stage_options

    opts = SearchOptions()
    # GPT-3 175B, 96 blocks (98 layers) on pp = 8: 96 / 8 = 12 blocks per rank.
    assert virtual_stage_options(8, 98, 96, opts) == [2, 3, 4, 6, 12]
    # Llama 3 405B: 126 blocks + embedding + head = 128 layers; pp = 16 runs v = 2, 4 or 8.
    assert virtual_stage_options(16, 128, 126, opts) == [2, 4, 8]
    assert virtual_stage_options(16, 128, 126, SearchOptions(virtual_stages=(2, 3, 9))) == [2, 3]


def test_tp_groups_that_straddle_nodes_are_costed_or_left_out_and_the_plan_says_which(monkeypatch):
    from tessera.search import space

    model = get_model("gpt3-175b")  # 96 heads: tp 3 and 6 divide them, not the 8 GPUs of a node
    cluster, wl = make_cluster("h100-80gb", 48), Workload(global_batch=48, seq_len=2048)
    opts = SearchOptions(schedules=("1f1b",), max_pp=6)
    plan = search(model, cluster, wl, opts)
    assert ("space: tp 3, 6 searched, costed as groups that straddle 8-GPU nodes"
            in "\n".join(plan.search.explanation))
    six = manual_plan(model, cluster, wl, tp=6, pp=8, sp="megatron")  # in the space: costed, not refused
    assert six.prediction.step_time_s > 0
    monkeypatch.setattr(space, "TP_ACROSS_NODES_COSTED", False)
    plan = search(model, cluster, wl, opts)
    assert all(8 % s.tp == 0 and 8 % (s.tp * s.sp_degree) == 0 for s in plan.layers)
    assert "space: tp 3, 6 left out: such groups straddle 8-GPU nodes" in "\n".join(plan.search.explanation)
    with pytest.raises(ValueError, match=r"^tp=6 does not divide the 8 GPUs of a node, so some tensor-parallel "
                                         r"groups would straddle two nodes"):
        manual_plan(model, cluster, wl, tp=6, pp=8, sp="megatron")


def test_ulysses_beyond_the_kv_heads_is_costed_or_left_out(monkeypatch):
    from tessera.search import space

    cfg = MID.model_copy(update={"num_heads": 32, "num_kv_heads": 8, "num_layers": 4})  # 32 heads, 8 KV heads
    model = ModelSpec.from_config(cfg)
    cluster = make_cluster("h100-80gb", 16, 16)  # 16 GPUs per node: a 16-way Ulysses group fits
    wl = Workload(global_batch=16, seq_len=8192)
    plan = search(model, cluster, wl, SearchOptions(max_pp=1))
    assert ("space: Ulysses degrees beyond the 8 KV heads (16) searched, costed with the runtime's KV-head repeats"
            in "\n".join(plan.search.explanation))
    assert manual_plan(model, cluster, wl, sp="ulysses", sp_degree=16).prediction.step_time_s > 0  # accepted
    monkeypatch.setattr(space, "KV_REPEAT_COSTED", False)
    plan = search(model, cluster, wl, SearchOptions(max_pp=1))
    assert all((8 // s.tp) % s.sp_degree == 0 for s in plan.layers)
    assert "space: Ulysses degrees beyond the 8 KV heads (16) left out" in "\n".join(plan.search.explanation)
    with pytest.raises(ValueError, match=r"^ulysses=16 must divide the 8 KV heads of a tensor-parallel rank"):
        manual_plan(model, cluster, wl, sp="ulysses", sp_degree=16)
    with pytest.raises(ValueError, match=r"^ulysses=8 must divide the 4 KV heads of a tensor-parallel rank"):
        manual_plan(model, cluster, wl, tp=2, sp="ulysses", sp_degree=8)
    manual_plan(model, cluster, wl, tp=2, sp="ulysses", sp_degree=4)  # 8 / 2 = 4 KV heads per rank


def test_a_hand_plan_the_space_refuses_is_refused_in_one_line(capsys):
    from tessera.cli import main

    assert main(["plan", "--model", "gpt3-175b", "--gpus", "48", "--global-batch", "48", "--tp", "16"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("tessera plan: error: tp=16 is larger than a node (8 GPUs)")


def test_a_hand_plan_interleave_depth_follows_the_space():
    model, cluster = get_model("llama2-7b"), make_cluster("h100-80gb", 16)  # 32 blocks, 34 layers
    wl = Workload(global_batch=64, seq_len=2048)
    plan = manual_plan(model, cluster, wl, pp=2, schedule="interleaved_1f1b", virtual_stages=4)  # 32 = 2 x 4 x 4
    assert len(plan.pipeline.stages) == 8
    with pytest.raises(ValueError, match=r"^virtual_stages=5: 2 x 5 chunks split neither the 32 blocks nor the 34 "):
        manual_plan(model, cluster, wl, pp=2, schedule="interleaved_1f1b", virtual_stages=5)
