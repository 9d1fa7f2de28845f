"""The profiler on real processes (gloo): two launches, one subprocess.

1. tests/dist/profile_check.py at 2 ranks measures the hardware and a small model (checks inside);
   here the profiles it wrote are read back the way the planner reads them.
2. `tessera profile hardware` interrupted mid-run leaves the previous file untouched, no leftovers.
3. `tessera profile model` from the command line, one process.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from tessera.cost.comm import collective_time
from tessera.cost.compute import layer_compute_time
from tessera.errors import TesseraError
from tessera.profile.apply import apply_model_profile, load_cluster_profile, load_model_profile
from tessera.spec.model import ModelSpec
from tessera.spec.presets import get_model, local_cpu_cluster
from tessera.spec.workload import Workload

from torchrun_util import ROOT, passed_checks, run_torchrun

sys.path.insert(0, str(ROOT / "tests" / "dist"))


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    out = tmp_path_factory.mktemp("profiles")
    log = run_torchrun(ROOT / "tests" / "dist" / "profile_check.py", 2, str(out), timeout=240)
    assert {"progress_units", "curve_all_reduce_2", "activations_per_token", "tp2_measured", "sp2_measured",
            "zero3_measured", "chain_reference", "head_tp2_measured", "written_without_leftovers",
            "model_window"} <= passed_checks(log)
    return out


def test_planner_reads_the_hardware_profile_and_its_predictions_follow_it(profiles):
    cluster = load_cluster_profile(profiles / "cluster.json", expect_gpus=2)
    preset = local_cpu_cluster(2)
    curve = next(c for c in cluster.collectives if c.collective == "all_reduce" and c.group_size == 2)
    # At a measured size the cost model returns the measured time, not the preset's formula.
    n = curve.message_bytes[2]
    assert collective_time(cluster, "all_reduce", n, 2) == pytest.approx(curve.seconds[2])
    assert collective_time(cluster, "all_reduce", n, 2) != pytest.approx(collective_time(preset, "all_reduce", n, 2), rel=0.05)
    block = get_model("tiny-llama").layers[1]
    fwd_profiled, _ = layer_compute_time(block, 128, 256, 1, cluster, "fp32")
    fwd_preset, _ = layer_compute_time(block, 128, 256, 1, preset, "fp32")
    peak = cluster.device.peak_flops["fp32"]
    assert fwd_profiled == pytest.approx(256 * (block.flops_per_token + block.attn_flops_coeff * 128) / peak)
    assert fwd_profiled != pytest.approx(fwd_preset, rel=0.05)
    with pytest.raises(TesseraError, match="2 devices, not the 4 asked for"):
        load_cluster_profile(profiles / "cluster.json", expect_gpus=4)


def test_model_profile_applies_to_its_model_only(profiles):
    from dist.profile_check import SMALL

    profile = load_model_profile(profiles / "model-profile.json")
    spec = ModelSpec.from_config(SMALL)
    applied = apply_model_profile(spec, profile)
    block = profile.layers[1]
    assert applied.layers[1].linear_time_scale == block.linear_time_scale
    assert applied.layers[1].act_bytes_tp + applied.layers[1].act_bytes_replicated == pytest.approx(
        block.activation_bytes_per_token)
    with pytest.raises(TesseraError, match="measured on model 'profile-test-llama', not 'tiny-llama'"):
        apply_model_profile(get_model("tiny-llama"), profile)


def test_plans_made_with_the_profiles_predict_from_the_measurements(profiles):
    from dist.profile_check import SMALL

    from tessera.search.baselines import manual_plan

    cluster = load_cluster_profile(profiles / "cluster.json", expect_gpus=2)
    spec = ModelSpec.from_config(SMALL)
    measured = apply_model_profile(spec, profiles / "model-profile.json")
    wl = Workload(global_batch=4, seq_len=64, dtype="fp32")
    preset_plan = manual_plan(spec, local_cpu_cluster(2), wl, micro_batch_size=1)
    profiled_plan = manual_plan(measured, cluster, wl, micro_batch_size=1)
    assert profiled_plan.prediction.step_time_s != pytest.approx(preset_plan.prediction.step_time_s, rel=0.05)
    # Activations of one in-flight micro-batch (64 tokens per rank): the measured bytes per token of
    # every layer, and the fp32 logits the training loop holds (not a saved tensor: not measured).
    profile = load_model_profile(profiles / "model-profile.json")
    per_token = sum(profile.for_kind(layer.kind).activation_bytes_per_token for layer in spec.layers)
    per_token += 4 * SMALL.vocab_size
    assert profiled_plan.prediction.stage_memory[0].activations == pytest.approx(64 * per_token)
    # The spec's per-operation counts alone (no profile) predict the same saved bytes.
    assert preset_plan.prediction.stage_memory[0].activations == pytest.approx(64 * per_token, rel=0.02)


def test_interrupted_hardware_profile_leaves_no_half_file(tmp_path):
    target = tmp_path / "cluster.json"
    target.write_text("previous profile")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "tessera",
           "profile", "hardware", "-o", str(target), "--reps", "200", "--max-bytes", "4M"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    seen = b""
    while b"measurements" not in seen:  # rank 0 says when it starts measuring
        line = proc.stdout.readline()
        assert line, f"profile ended before measuring: {seen.decode()[-3000:]}"
        seen += line
    time.sleep(2)
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGINT)
    proc.communicate(timeout=60)
    assert target.read_text() == "previous profile"
    assert [p.name for p in tmp_path.iterdir()] == ["cluster.json"]


def test_profile_model_command_line(tmp_path):
    from dist.profile_check import SMALL

    config = tmp_path / "small.json"
    config.write_text(SMALL.model_dump_json())
    out = tmp_path / "mp.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "tessera", "profile", "model", "--model", str(config), "-o", str(out),
                          "--sizes", "1x32,2x32,1x64", "--reps", "1", "--window", "0.02"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    profile = load_model_profile(out)
    assert profile.model == "profile-test-llama" and profile.window_s == 0.02 and "block0" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "tessera", "profile", "model", "--model", str(config), "-o", str(out),
                          "--sizes", "2by32"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "size '2by32' is not BATCHxSEQ" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "tessera", "profile", "model", "--model", str(config), "-o", str(out),
                          "--window", "-1"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "argument --window: '-1' is not a number of seconds >= 0" in bad.stderr


def test_validate_runs_plans_and_measures_what_the_cost_model_predicts(profiles, tmp_path):
    """`tessera validate` at 2 ranks on two plans made with the profiles: the instrumented memory
    (states + saved activations) matches the prediction; the table, JSON and plot are written."""
    import json

    from dist.profile_check import SMALL

    from tessera.search.baselines import manual_plan

    cluster = load_cluster_profile(profiles / "cluster.json", expect_gpus=2)
    model = apply_model_profile(ModelSpec.from_config(SMALL), profiles / "model-profile.json")
    wl = Workload(global_batch=4, seq_len=64, dtype="fp32")
    paths = []
    for name, kw in {"dp2": {}, "zero3-rc": dict(zero=3, recompute="full")}.items():
        paths.append(tmp_path / f"{name}.json")
        manual_plan(model, cluster, wl, name=name, micro_batch_size=1, **kw).save(paths[-1])
    results, plot = tmp_path / "results.json", tmp_path / "validate.png"
    log = run_torchrun("-m", 2, "tessera", "validate", "--plan", *map(str, paths), "--steps", "1",
                       "--json", str(results), "--plot", str(plot), "--model-profile",
                       str(profiles / "model-profile.json"), timeout=300)
    assert "dp2: 2 ranks, 1 timed steps" in log and "zero3-rc" in log
    assert "machine speed during the runs" in " ".join(log.split())  # rich wraps lines
    assert "measured at the profile's speed (step by step)" in " ".join(log.split())
    data = json.loads(results.read_text())
    assert [r["plan"] for r in data["results"]] == ["dp2", "zero3-rc"] and not data["skipped"]
    for r in data["results"]:
        assert len(r["ranks"]) == 2 and len(r["step_times"]) == 1 and r["measured_step_s"] > 0
        assert abs(r["peak_memory_error"]) < 0.05, r
    # The allocator's peak for each plan: at least its states, and of the cost model's order.
    for r in data["results"]:
        for rank in r["ranks"]:
            states = rank["params"] + rank["grads"] + rank["optimizer"]
            assert states < rank["allocator_peak"] < 10 * max(r["predicted_allocated"]), r
    assert "allocator peak predicted" in " ".join(log.split())
    zero3 = data["results"][1]["ranks"][0]
    dp = data["results"][0]["ranks"][0]
    assert zero3["params"] == pytest.approx(dp["params"] / 2, rel=0.05)  # ZeRO-3 shards over 2 ranks
    assert plot.stat().st_size > 1000
    # The gauge: the profile's first block at its largest size, timed again between the steps.
    block = load_model_profile(profiles / "model-profile.json").layers[1]
    largest = max(block.measurements, key=lambda m: (m.tokens, m.seq_len))
    for r in data["results"]:
        assert r["gauge_profiled_s"] == pytest.approx(largest.forward_s + largest.backward_s) and r["gauge_s"] > 0
        # ... before every step and after the last: one gauge time around each step.
        assert len(r["step_gauge_s"]) == len(r["step_times"]) and min(r["step_gauge_s"]) > 0


def test_profile_model_at_four_ranks_measures_tensor_parallel_at_four(tmp_path):
    """`tessera profile model` under torchrun at 4 ranks: blocks also run tp=4 over all four
    (`LayerSpec.tp_wider`), and a tp=4 plan is costed with those terms, not tp=2's."""
    from tessera.search.baselines import manual_plan
    from tessera.spec.model import TransformerConfig

    config = TransformerConfig(name="profile-tp4-llama", hidden=64, num_layers=2, num_heads=4, num_kv_heads=4,
                               ffn_hidden=128, vocab_size=256, max_seq_len=64)
    path, out = tmp_path / "model.json", tmp_path / "mp.json"
    path.write_text(config.model_dump_json())
    log = run_torchrun("-m", 4, "tessera", "profile", "model", "--model", str(path), "-o", str(out),
                       "--sizes", "1x32,2x32,1x64", "--reps", "1", timeout=300)
    assert "block0 at tp=4:" in log
    block = load_model_profile(out).layers[1]
    [wide] = block.tp_wider
    assert wide.degree == 4 and len(wide.seconds) == len(wide.comm_seconds) == len(block.measurements) == 3
    assert min(wide.seconds) > 0 and min(wide.comm_seconds) > 0 and block.tp_overhead_s is not None
    spec = apply_model_profile(ModelSpec.from_config(config), out)
    assert spec.layers[1].tp_costs(4) == (wide.overhead_s, wide.slowdown)
    assert spec.layers[1].tp_costs(2) == (block.tp_overhead_s, block.tp_slowdown)
    wl, cluster = Workload(global_batch=1, seq_len=64, dtype="fp32"), local_cpu_cluster(4)
    as_tp2 = spec.model_copy(update={"layers": tuple(l.model_copy(update={"tp_wider": ()}) for l in spec.layers)})
    tp4 = manual_plan(spec, cluster, wl, tp=4).prediction.step_time_s
    differs = (wide.overhead_s, wide.slowdown) != (block.tp_overhead_s, block.tp_slowdown)
    assert (tp4 != manual_plan(as_tp2, cluster, wl, tp=4).prediction.step_time_s) == differs
