"""`tessera plan` and `tessera show` from the command line: output, files, and one-line errors."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.cli import main
from tessera.plan import Plan
from tessera.spec.presets import make_cluster

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SMALL = ["--model", "llama2-7b", "--gpus", "16", "--global-batch", "64", "--seq-len", "2048"]


def fails(capsys, argv: list[str]) -> str:
    """Run the CLI, expect exit 2 and exactly one line on stderr; return that line."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


# --- errors: one line, exit 2 --------------------------------------------------------------------
def test_unknown_model_lists_the_known_ones(capsys):
    err = fails(capsys, ["plan", "--model", "llama9-1t"])
    assert "unknown model 'llama9-1t'" in err and "llama3-70b" in err and "config.json" in err


def test_missing_config_file_is_named(capsys, tmp_path):
    err = fails(capsys, ["plan", "--model", str(tmp_path / "nowhere" / "config.json")])
    assert "no model preset or Hugging Face config at" in err and "nowhere" in err


def test_config_json_missing_a_field_is_named(capsys, tmp_path):
    config = json.loads((EXAMPLES / "open-llama-3b" / "config.json").read_text())
    del config["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    err = fails(capsys, ["plan", "--model", str(tmp_path), "--tp", "2"])
    assert "missing required field 'hidden_size'" in err


def test_hf_config_plans_like_a_preset(capsys):
    # OpenLLaMA 3B's published config: 3,426,473,600 parameters.
    assert main(["plan", "--model", str(EXAMPLES / "open-llama-3b"), "--cluster",
                 str(EXAMPLES / "cluster-a100-2x8.json"), "--global-batch", "256", "--seq-len", "2048",
                 "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "open-llama-3b: 3.43B parameters, 26 blocks" in out
    assert "lab-a100: 2 nodes x 8 a100-80gb = 16 GPUs" in out and "dp8 tp2" in out


def test_unknown_gpu_lists_the_known_ones(capsys):
    err = fails(capsys, ["plan", "--gpu", "b300"])
    assert "unknown GPU 'b300'" in err and "h100-80gb" in err


def test_gpus_must_fill_whole_nodes(capsys):
    err = fails(capsys, ["plan", "--gpus", "12", "--gpus-per-node", "8"])
    assert "--gpus 12 is not a multiple of --gpus-per-node 8" in err


def test_manual_plan_batch_must_divide(capsys):
    err = fails(capsys, ["plan", *SMALL, "--global-batch", "100", "--tp", "2", "--micro-batch-size", "2"])
    assert "global batch 100 is not divisible by dp 8 x micro-batch size 2 = 16" in err


def test_manual_degrees_must_divide_the_gpus(capsys):
    err = fails(capsys, ["plan", *SMALL, "--tp", "3"])
    assert "pp 1 x tp 3 x sp 1 = 3 does not divide 16 GPUs" in err


def test_ulysses_needs_its_degree(capsys):
    err = fails(capsys, ["plan", *SMALL, "--sp", "ulysses", "--tp", "2"])
    assert "--sp ulysses needs --sp-degree N with N >= 2" in err


def test_context_parallel_hand_plans_and_their_refusals(capsys):
    assert main(["plan", *SMALL, "--seq-len", "4096", "--tp", "2", "--sp", "megatron", "--cp", "4", "--zero", "3",
                 "--json"]) == 0
    plan = Plan.from_json(capsys.readouterr().out)
    assert plan.layers[1].describe().startswith("dp2 tp2+sp cp4") and plan.prediction.fits
    err = fails(capsys, ["plan", *SMALL, "--seq-len", "4004", "--cp", "4"])
    assert "cp=4 needs the sequence of 4004 tokens to split into 2 x cp = 8 equal chunks" in err
    err = fails(capsys, ["plan", "--model", "mixtral-8x7b", "--gpus", "16", "--global-batch", "16",
                         "--seq-len", "4096", "--cp", "2"])
    assert "context parallelism is not combined with expert parallelism" in err
    err = fails(capsys, ["plan", *SMALL, "--cp", "3"])
    assert "pp 1 x tp 1 x sp 1 x cp 3 = 3 does not divide 16 GPUs" in err


def test_learned_positions_cap_the_sequence(capsys):
    err = fails(capsys, ["plan", "--model", "gpt2", "--seq-len", "4096"])
    assert "--seq-len 4096 is longer than gpt2's 1024 learned positions" in err


@pytest.mark.parametrize("content, message", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
    (None, "invalid cluster file .*: num_nodes: Input should be greater than 0"),
    (None, "invalid cluster file .*: speed: Extra inputs are not permitted"),
])
def test_invalid_cluster_file(capsys, tmp_path, content, message):
    import re

    good = json.loads(make_cluster("h100-80gb", 16, 8).model_dump_json())
    if content is None:
        good.update({"num_nodes": 0} if "num_nodes" in message else {"speed": 1})
        content = json.dumps(good)
    path = tmp_path / "cluster.json"
    path.write_text(content)
    err = fails(capsys, ["plan", "--cluster", str(path)])
    assert re.search(message, err), err


def test_cluster_file_excludes_gpu_flags(capsys, tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(make_cluster("h100-80gb", 16, 8).model_dump_json())
    err = fails(capsys, ["plan", "--cluster", str(path), "--gpu", "a100-80gb"])
    assert "--cluster already gives the GPU kind" in err


def test_show_refuses_other_versions_and_invalid_plans(capsys, tmp_path):
    path = tmp_path / "plan.json"
    assert "does not exist" in fails(capsys, ["show", str(path)])
    path.write_text(json.dumps({"version": 99}))
    assert "plan version 99 is not supported" in fails(capsys, ["show", str(path)])
    path.write_text(json.dumps({"version": 1, "name": "x"}))
    assert "invalid plan: model: Field required" in fails(capsys, ["show", str(path)])
    path.write_text("{")
    assert "plan is not valid JSON" in fails(capsys, ["show", str(path)])


# --- planning (needs the search) -----------------------------------------------------------------
def test_default_plan_runs_as_a_module_without_torch_or_matplotlib():
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "tessera", "plan"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "built-in default job: llama2-7b on 8x8 h100-80gb, global batch 512 x 4096" in r.stdout
    for heading in ("pipeline:", "step time", "MFU", "peak memory per GPU", "planned in"):
        assert heading in r.stdout
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and "matplotlib" not in imported


def test_plan_writes_json_that_show_draws(capsys, tmp_path):
    from tessera.cost.evaluate import simulate_plan

    path = tmp_path / "plans" / "plan.json"
    assert main(["plan", *SMALL, "-o", str(path)]) == 0
    out = capsys.readouterr().out
    plan = Plan.load(path)
    assert plan.prediction is not None and plan.workload.global_batch == 64
    assert f"wrote {path}" in out and "layers" in out
    assert main(["show", str(path), "-o", str(tmp_path / "report")]) == 0
    shown = capsys.readouterr().out
    assert "llama2-7b" in shown and "peak memory per GPU" in shown
    files = {p.name: p for p in (tmp_path / "report").iterdir()}
    assert sorted(files) == ["plan.memory.png", "plan.memory.svg", "plan.timeline.png", "plan.timeline.svg"]
    assert all(p.stat().st_size > 5_000 for p in files.values())
    events = simulate_plan(plan)[0].events
    assert files["plan.timeline.svg"].read_text().count('id="event-') == len(events)


def test_json_goes_to_stdout_alone(capsys, tmp_path):
    assert main(["plan", *SMALL, "--json", "-o", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert Plan.from_json(out) == Plan.load(tmp_path / "p.json")


def test_manual_plan_uses_the_same_cost_model(capsys, tmp_path):
    from tessera.cost import evaluate

    path = tmp_path / "manual.json"
    assert main(["plan", *SMALL, "--dp", "4", "--tp", "2", "--pp", "2", "--zero", "1", "-o", str(path)]) == 0
    out = capsys.readouterr().out
    plan = Plan.load(path)
    assert plan.pipeline.degree == 2
    blocks = [s for s, layer in zip(plan.layers, plan.model.layers) if layer.kind == "decoder"]
    assert all((s.dp, s.tp, s.zero) == (4, 2, 1) for s in blocks)
    assert "dp4 tp2 zero1" in out
    assert plan.prediction.step_time_s == pytest.approx(evaluate(plan).step_time_s)


def test_compare_puts_the_plan_beside_the_baselines(capsys):
    from tessera.search import baseline_plans
    from tessera.spec import Workload
    from tessera.spec.presets import get_model

    assert main(["plan", *SMALL, "--compare"]) == 0
    out = capsys.readouterr().out
    assert "compared with baselines" in out and "1.00x" in out
    baselines = baseline_plans(get_model("llama2-7b"), make_cluster("h100-80gb", 16, 8),
                               Workload(global_batch=64, seq_len=2048))
    assert baselines
    rows = {b.name: next(line for line in out.splitlines() if line.startswith(f"│ {b.name} ")) for b in baselines}
    for b in baselines:
        # The search space holds every baseline: none that fits may be faster than the plan.
        row = rows[b.name]
        assert (" yes " in row) == evaluate_fits(b)
        if " yes " in row:
            assert float(re.findall(r"([\d.]+)x", row)[-1]) >= 1.0, row


def evaluate_fits(plan) -> bool:
    from tessera.cost import evaluate

    return (plan.prediction or evaluate(plan)).fits


def test_a_model_that_fits_nowhere_says_what_it_needs(capsys):
    from tessera.search import NoFeasiblePlanError, search
    from tessera.spec import Workload
    from tessera.spec.presets import get_model

    argv = ["--model", "llama3-405b", "--gpus", "8", "--gpu", "a100-40gb", "--global-batch", "8"]
    err = fails(capsys, ["plan", *argv])
    with pytest.raises(NoFeasiblePlanError) as info:
        search(get_model("llama3-405b"), make_cluster("a100-40gb", 8, 8), Workload(global_batch=8, seq_len=4096))
    assert f"{info.value.best_peak_bytes / 2**30:.1f} GiB" in err and "40.0 GiB" in err
    assert info.value.best_peak_bytes > info.value.device_bytes


def test_model_profile_changes_the_prediction_and_must_match_the_model(capsys, tmp_path):
    from tessera.profile.fit import LayerKindProfile, ModelProfile
    from tessera.spec.presets import get_model

    block = get_model("llama2-7b").layers[1]
    paths = {}
    for scale in (1.0, 2.0):
        kind = LayerKindProfile(kind=block.kind, layer=block.name, params=block.params,
                                flops_per_token=block.flops_per_token, attn_flops_coeff=block.attn_flops_coeff,
                                measurements=(), linear_time_scale=scale, attn_time_scale=scale, overhead_s=0.0,
                                fit_r2=1.0, fit_max_rel_err=0.0, activation_fit_max_rel_err=0.0,
                                backward_over_forward=2.0,
                                activation_bytes_per_token=block.act_bytes_tp + block.act_bytes_replicated)
        paths[scale] = tmp_path / f"model-profile-{scale}.json"
        paths[scale].write_text(ModelProfile(model="llama2-7b", device="h100-80gb", dtype="bf16",
                                             reference_flops=1e15, layers=(kind,)).model_dump_json())
    path = paths[2.0]
    manual = ["plan", *SMALL, "--tp", "2", "--json"]
    assert main(manual) == 0
    plain = Plan.from_json(capsys.readouterr().out)
    assert main([*manual, "--model-profile", str(paths[1.0])]) == 0
    measured = Plan.from_json(capsys.readouterr().out)
    assert main([*manual, "--model-profile", str(path)]) == 0
    profiled = Plan.from_json(capsys.readouterr().out)
    # A profile prices the blocks it measured (the FLOPs model times its scales) instead of the
    # per-operation model; blocks twice as slow: compute grows by nearly 2x (the head is unchanged).
    assert measured.prediction.compute_s != plain.prediction.compute_s
    assert 1.7 < profiled.prediction.compute_s / measured.prediction.compute_s < 2.0
    err = fails(capsys, ["plan", "--model", "llama2-13b", "--model-profile", str(path), "--tp", "2"])
    assert "model profile was measured on model 'llama2-7b', not 'llama2-13b'" in err


def test_memory_margin_flag_sets_the_planners_free_share(capsys):
    assert main(["plan", *SMALL, "--memory-margin", "0.3", "--json"]) == 0
    plan = Plan.from_json(capsys.readouterr().out)
    assert plan.cluster.memory_margin == 0.3
    assert plan.prediction.peak_memory <= 0.7 * plan.cluster.device.memory_bytes
    err = fails(capsys, ["plan", *SMALL, "--memory-margin", "1.5"])
    assert "--memory-margin must be a fraction in [0, 1), got 1.5" in err


@pytest.mark.parametrize("flags, message", [
    (["--tp", "0"], "--tp must be a positive integer, not 0"),
    (["--pp", "0"], "--pp must be a positive integer, not 0"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be a positive integer, not 0"),
    (["--gpus", str(10**18)], "1,000,000,000,000,000,000 GPUs is more than the planner supports (at most 1,048,576)"),
    (["--global-batch", str(10**12)], "sequences of global batch is more than the planner supports (at most 4,194,304)"),
])
def test_bad_flags_are_refused_in_one_line(capsys, flags, message):
    assert message in fails(capsys, ["plan", *flags])


def test_a_config_with_a_billion_layers_is_refused_before_it_is_built(capsys, tmp_path):
    config = json.loads((EXAMPLES / "open-llama-3b" / "config.json").read_text())
    config["num_hidden_layers"] = 10**9
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert "1,000,000,002 layers is more than the planner supports (at most 4,096)" in fails(
        capsys, ["plan", "--model", str(tmp_path)])


@pytest.mark.parametrize("field, value, message", [
    (("device", "peak_flops", "bf16"), 0, "peak_flops[bf16] must be a positive number, got 0"),
    (("device", "peak_flops", "bf16"), -1e15, "peak_flops[bf16] must be a positive number, got -1000000000000000.0"),
    (("device", "peak_flops", "bf16"), float("nan"), "peak_flops[bf16] must be a positive number, got nan"),
    (("intra_node", "bandwidth"), 0, "intra_node.bandwidth: Input should be greater than 0"),
    (("inter_node", "bandwidth"), float("nan"), "inter_node.bandwidth: Input should be a finite number"),
    (("device", "memory_bandwidth"), -1.0, "device.memory_bandwidth: Input should be greater than 0"),
])
def test_cluster_file_with_impossible_rates(capsys, tmp_path, field, value, message):
    data = json.loads(make_cluster("h100-80gb", 16, 8).model_dump_json())
    node = data
    for key in field[:-1]:
        node = node[key]
    node[field[-1]] = value
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(data))  # NaN is written as the usual non-standard token
    assert message in fails(capsys, ["plan", "--cluster", str(path), "--tp", "2"])
