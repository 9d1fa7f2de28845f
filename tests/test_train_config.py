"""The training command as users drive it, without processes: the typed config and its flags, bad
input in one line, run directories and their metrics, the learning-rate schedules, the held-out
split, evaluation against a direct computation, plans refused on another machine, the quick
profile's cache, the log lines, W&B, and the CLI's help."""
import json
import math
import sys
import types
from pathlib import Path

import pytest

from tessera.cli import main
from tessera.config import (RunConfig, flag_table, load_config, parse_config, to_toml)
from tessera.errors import TesseraError

ROOT = Path(__file__).resolve().parents[1]


def _one_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# ----------------------------------------------------------------------------- the config

def test_examples_load_and_the_resolved_config_round_trips(tmp_path):
    demo = load_config(ROOT / "examples/demo.toml")
    assert (demo.model.name, demo.plan.nproc, demo.eval.every, demo.checkpoint.keep) == ("tiny-llama", 2, 25, 3)
    big = load_config(ROOT / "examples/llama2-7b-64gpu.toml")
    assert (big.model.name, big.data.global_batch, big.data.seq_len) == ("llama2-7b", 512, 4096)
    for config in (demo, big, RunConfig()):
        path = tmp_path / "c.toml"
        path.write_text(to_toml(config, "header"))
        assert load_config(path) == config
    # YAML reads the same
    yaml = tmp_path / "demo.yaml"
    yaml.write_text("model:\n  name: tiny-llama\noptim:\n  betas: [0.9, 0.99]\n  lr: 0.001\n")
    c = load_config(yaml)
    assert c.optim.betas == (0.9, 0.99) and c.optim.lr == 1e-3


def test_a_7b_run_on_64_gpus_plans_from_its_example():
    """The 64-GPU example is a job the planner fits: what each rank would plan on 8 x 8 H100s."""
    from tessera.cli.train import make_local_plan
    from tessera.spec.presets import make_cluster
    from tessera.spec.workload import Workload

    c = load_config(ROOT / "examples/llama2-7b-64gpu.toml")
    plan = make_local_plan(c.model.name, 64, Workload(global_batch=c.data.global_batch, seq_len=c.data.seq_len),
                           cluster=make_cluster("h100-80gb", 64, 8))
    assert plan.world_size == 64 and plan.prediction.fits


@pytest.mark.parametrize("data, message", [
    ({"optim": {"learning_rate": 1e-3}}, "unknown key 'optim.learning_rate'; did you mean 'optim.lr'?"),
    ({"trian": {"steps": 1}}, "unknown key 'trian'; did you mean 'train'?"),
    ({"train": {"steps": "ten"}}, "train.steps must be an integer, got 'ten'"),
    ({"train": {"steps": 10.5}}, "train.steps must be an integer, got 10.5"),
    ({"optim": {"lr": True}}, "optim.lr must be a number, got True"),
    ({"optim": {"decay": "exp"}}, "optim.decay: Input should be 'cosine', 'linear' or 'constant', got 'exp'"),
    ({"optim": {"betas": [0.9, 1.5]}}, "optim.betas must lie in [0, 1), got [0.9, 1.5]"),
    ({"eval": {"fraction": 1.5}}, "eval.fraction: Input should be less than 1, got 1.5"),
    ({"train": 5}, "[train] must be a section of keys, not 5"),
])
def test_bad_config_values_are_named(data, message):
    with pytest.raises(TesseraError) as e:
        parse_config(data, "run.toml: ")
    assert str(e.value) == f"run.toml: {message}"


def test_every_flag_has_help_a_default_and_its_field():
    from tessera.cli import build_parser

    flags = flag_table()
    assert len({f.flag for f in flags}) == len(flags)  # one flag per field
    text = " ".join(build_parser("train")._subparsers._group_actions[0].choices["train"].format_help().split())
    for f in flags:
        assert f.flag in text and f"config: {f.key})" in text, f.key
    assert text.count("(default: ") >= len(flags)


def test_bad_input_answers_in_one_line(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text('[optim]\nlearning_rate = 0.1\n')
    assert _one_line(capsys, ["train", "--config", str(config)]) == \
        f"tessera train: error: {config}: unknown key 'optim.learning_rate'; did you mean 'optim.lr'?"
    config.write_text('[train]\nsteps = "ten"\n')
    assert _one_line(capsys, ["train", "--config", str(config), "--nproc", "2"]) == \
        f"tessera train: error: {config}: train.steps must be an integer, got 'ten'"
    config.write_text('[data]\nsynthetic = true\n')
    assert _one_line(capsys, ["train", "--config", str(config), "--data", str(tmp_path)]) == (
        f"tessera train: error: --data {tmp_path} conflicts with data.synthetic = true in {config}: "
        "synthetic data reads no files; give one of them")
    with pytest.raises(SystemExit):
        main(["train", "--steps", "x"])
    assert "argument --steps: 'x' is not an integer" in capsys.readouterr().err

    # A plan fixes its model and batch; one made for GPUs is refused on this CPU, before any launch.
    plan = tmp_path / "h100.json"
    assert main(["plan", "--model", "tiny-llama", "--gpus", "2", "-o", str(plan)]) == 0
    capsys.readouterr()
    config.write_text(f'[plan]\nfile = "{plan}"\n')
    assert _one_line(capsys, ["train", "--config", str(config), "--global-batch", "16"]) == (
        f"tessera train: error: --global-batch 16 conflicts with plan.file = \"{plan}\" in {config}, "
        "whose global batch is 8; give one of them")
    for argv in (["train", "--plan", str(plan), "--nproc", "2"], ["train", "--config", str(config), "--nproc", "2"]):
        assert _one_line(capsys, argv).startswith(
            f"tessera train: error: plan {plan} was made for 1x2 h100-80gb (bf16), but this machine has no GPU")
    cpu_bf16 = tmp_path / "cpu-bf16.json"
    assert main(["plan", "--model", "tiny-llama", "--cluster", str(_cpu_cluster(tmp_path, 2)), "--dtype", "bf16",
                 "-o", str(cpu_bf16)]) == 0
    capsys.readouterr()
    assert "but a CPU computes in fp32" in _one_line(capsys, ["train", "--plan", str(cpu_bf16), "--nproc", "2"])
    one_gpu = tmp_path / "h100x1.json"
    assert main(["plan", "--model", "tiny-llama", "--gpus", "1", "-o", str(one_gpu)]) == 0
    capsys.readouterr()
    assert "was made for 1x1 h100-80gb (bf16), but this machine has no GPU" in \
        _one_line(capsys, ["validate", "--plan", str(one_gpu)])


def _cpu_cluster(tmp_path: Path, ranks: int) -> Path:
    from tessera.spec.presets.clusters import local_cpu_cluster

    path = tmp_path / f"cpu{ranks}.json"
    path.write_text(local_cpu_cluster(ranks).model_dump_json())
    return path


def test_a_model_too_big_for_this_host_is_refused_before_it_is_built(capsys):
    from tessera.runtime.machine import check_model_fits_host
    from tessera.spec.presets import get_model

    with pytest.raises(TesseraError, match=r"llama2-7b \(6.74B parameters\) cannot profile on this machine: it builds "
                                           r"the whole model on each of 1 rank, about 25.1 GiB, and 8.0 GiB"):
        check_model_fits_host(get_model("llama2-7b"), 1, "profile", available=8 * 2**30)
    check_model_fits_host(get_model("tiny-llama"), 2, "train", available=8 * 2**30)
    err = _one_line(capsys, ["train", "--model", "llama3-405b", "--nproc", "2"])
    assert "cannot train on this machine: it needs 16 bytes per parameter" in err


# ----------------------------------------------------------------------------- plans and this machine

def test_plans_for_another_machine_are_refused():
    from tessera.runtime.machine import Machine, check_plan_fits_machine, preset_gpu
    from tessera.search import manual_plan
    from tessera.spec.presets import get_model, local_cpu_cluster, make_cluster
    from tessera.spec.workload import Workload

    model = get_model("tiny-llama")
    h100 = manual_plan(model, make_cluster("h100-80gb", 16, 8), Workload(global_batch=16, seq_len=128), dp=16)
    cpu = manual_plan(model, local_cpu_cluster(2), Workload(global_batch=8, seq_len=128, dtype="fp32"), dp=2)
    gpu = Machine("cuda", "NVIDIA H100 80GB HBM3", 79.6 * 2**30)
    assert preset_gpu(gpu) == "h100-80gb" and preset_gpu(Machine("cuda", "NVIDIA A100-SXM4-40GB", 40 * 2**30)) == "a100-40gb"
    check_plan_fits_machine(h100, gpu, 8)
    check_plan_fits_machine(cpu, Machine("cpu"), 2)
    cases = [(h100, Machine("cpu"), 8, "but this machine has no GPU"),
             (cpu, gpu, 2, "but this machine has NVIDIA H100 80GB HBM3 GPUs (80 GiB)"),
             (h100, Machine("cuda", "NVIDIA A100-SXM4-80GB", 80 * 2**30), 8, "NVIDIA A100-SXM4-80GB GPUs"),
             (h100, gpu, 4, "the plan was made for nodes of 8 ranks, but 4 run on this node")]
    for plan, machine, local, message in cases:
        with pytest.raises(TesseraError, match="the plan was made for"):
            check_plan_fits_machine(plan, machine, local)
        with pytest.raises(TesseraError) as e:
            check_plan_fits_machine(plan, machine, local)
        assert message in str(e.value)


def test_the_cpu_plans_from_its_cached_quick_profile(tmp_path, monkeypatch):
    from tessera.profile.measure import quick
    from tessera.runtime.machine import Machine, cluster_for_this_machine
    from tessera.spec.presets import get_model, local_cpu_cluster

    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    model = get_model("tiny-llama")
    cluster_2, model_2 = quick.profile_paths(model, 2)
    assert cluster_2.parent != quick.profile_paths(model, 4)[0].parent  # another rank count: another profile
    assert quick.profile_paths(get_model("tiny-gpt2"), 2)[1] != model_2
    calls = []

    def measure(spec, world, under, again=False):
        calls.append((spec.name, world, under, again))
        return quick.QuickProfile(local_cpu_cluster(world), None, "measured")

    target = cluster_for_this_machine("auto", Machine("cpu"), 2, 2, model, False, measure=measure)
    assert target.cluster.num_gpus == 2 and calls == [("tiny-llama", 2, False, False)]
    cluster_for_this_machine("measure", Machine("cpu"), 2, 2, model, False, measure=measure)
    assert calls[-1][-1] is True
    assert "rough built-in" in cluster_for_this_machine("builtin", Machine("cpu"), 2, 2, model, False).note
    gpu = cluster_for_this_machine("auto", Machine("cuda", "NVIDIA H100 80GB HBM3", 80 * 2**30), 16, 8, model, True)
    assert gpu.cluster.device.name == "h100-80gb" and gpu.cluster.num_nodes == 2
    with pytest.raises(TesseraError, match="is not a preset GPU: profile it"):
        cluster_for_this_machine("auto", Machine("cuda", "Some GPU", 24 * 2**30), 1, 1, model, False)


def test_plan_defaults_follow_the_model_and_the_profile(tmp_path, capsys):
    def workload(*argv):
        assert main(["plan", *argv, "--json"]) == 0
        w = json.loads(capsys.readouterr().out)["workload"]
        return w["global_batch"], w["seq_len"], w["dtype"]

    assert workload("--model", "tiny-llama", "--gpus", "8") == (8, 128, "bf16")
    assert workload("--model", "gpt2", "--gpus", "8") == (512, 1024, "bf16")
    assert workload("--model", "tiny-llama", "--cluster", str(_cpu_cluster(tmp_path, 2))) == (8, 128, "fp32")


# ----------------------------------------------------------------------------- run records

def test_run_directories_ids_and_metrics(tmp_path):
    from tessera.runtime.runs import MetricsFile, resolve_run, run_dir_of

    config = RunConfig().replace(**{"run.out": f"{tmp_path}/runs/{{name}}/{{id}}"})
    c1, p1 = resolve_run(config, "tiny-llama", now=0)
    p1.dir.mkdir(parents=True)
    c2, p2 = resolve_run(config, "tiny-llama", now=0)  # the same second: another directory
    assert p2.run_id == f"{p1.run_id}-2" and p2.dir.name == p2.run_id
    assert c1.run.id == p1.run_id and c1.checkpoint.dir == str(p1.dir / "checkpoints")

    metrics = MetricsFile(p1.metrics, p1.run_id)
    for step in (1, 2, 3):
        metrics.write({"step": step, "loss": 1.0})
    metrics.write({"step": 2, "eval_loss": 2.0})
    metrics.file.write('{"step": 4, "lo')  # a torn last line
    metrics.file.flush()
    assert metrics.truncate_after(2) == 2
    metrics.write({"step": 3, "loss": 0.5})
    metrics.close()
    lines = [json.loads(line) for line in p1.metrics.read_text().splitlines()]
    assert [(r["run_id"], r["step"]) for r in lines] == [(p1.run_id, s) for s in (1, 2, 2, 3)]

    with pytest.raises(TesseraError, match="already holds a run's metrics; continue it with --resume"):
        resolve_run(config.replace(**{"run.id": p1.run_id}), "tiny-llama")
    (p1.dir / "config.toml").write_text(to_toml(c1))
    (p1.dir / "checkpoints" / "step-2").mkdir(parents=True)
    for resume in (p1.dir, p1.dir / "checkpoints", p1.dir / "checkpoints" / "step-2"):
        assert run_dir_of(resume) == p1.dir
        c3, p3 = resolve_run(config.replace(**{"checkpoint.resume": str(resume)}), "tiny-llama")
        assert (p3.dir, p3.run_id) == (p1.dir, p1.run_id)  # a resumed run continues its own records
    assert run_dir_of(tmp_path) is None


def test_learning_rate_schedules():
    from tessera.runtime.optim import OptimConfig, lr_lambda

    def factors(decay):
        f = lr_lambda(OptimConfig(warmup_steps=2, total_steps=12, min_lr_ratio=0.1, decay=decay))
        return [f(s) for s in range(13)]

    for decay in ("cosine", "linear", "constant"):
        f = factors(decay)
        assert f[:2] == [0.5, 1.0] and f[2] == 1.0
        assert f[12] == pytest.approx({"cosine": 0.1, "linear": 0.1, "constant": 1.0}[decay])
    assert factors("linear")[7] == pytest.approx(1 - 0.9 * 0.5)
    assert factors("cosine")[7] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_the_held_out_split_is_the_end_of_the_stream_and_never_trained_on():
    import numpy as np

    from tessera.runtime.data import TokenLoader, TokenStream, split_windows

    assert split_windows(100, 0.05, "train") == (0, 95) and split_windows(100, 0.05, "eval") == (95, 5)
    assert split_windows(100, 0.0, "train") == (0, 100)
    stream = TokenStream([np.arange(64 * 40 + 1, dtype=np.int64)], "s")  # token = position
    train = TokenLoader(stream, 64, 4, holdout=0.1, split="train")
    held = TokenLoader(stream, 64, 4, holdout=0.1, split="eval", shuffle=False)
    seen = {int(t) // 64 for _ in range(30) for t in next(train).tokens[:, 0]}
    assert seen == set(range(36))
    assert {int(t) // 64 for t in held.batch_at(0).tokens[:, 0]} == {36, 37, 38, 39}
    with pytest.raises(TesseraError, match="its held-out eval split has 4 windows of 64 tokens, fewer than one "
                                           "global batch of 8 x 64"):
        TokenLoader(stream, 64, 8, holdout=0.1, split="eval")


@pytest.mark.parametrize("adaptive", [False, True])
def test_evaluation_is_the_mean_loss_over_held_out_targets(tmp_path, adaptive):
    """`Trainer.evaluate` on one process equals the model's cross-entropy over the same batches
    (two micro-batches of a plan, or the adaptive path's rows)."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT / "tests" / "dist"))
    from runtime_common import LLAMA, S, make_plan

    from tessera.runtime.trainer import SyntheticLoader, TrainConfig, Trainer

    plan = make_plan(LLAMA, 1, S(dp=1), num_micro_batches=1 if adaptive else 2)
    trainer = Trainer(TrainConfig(plan=plan, steps=1, synthetic_data=True, eval_every=1, eval_batches=2,
                                  adaptive=adaptive))
    try:
        loss, tokens = trainer.evaluate()
        w = plan.workload
        held = SyntheticLoader(LLAMA.vocab_size, w.seq_len, w.global_batch, 0, 1, 7_919)
        with torch.no_grad():
            sums = [F.cross_entropy(trainer.model_parts[0](b.tokens).flatten(0, 1), b.labels.flatten(), reduction="sum")
                    for b in (held.batch_at(0), held.batch_at(w.global_batch))]
        assert tokens == 2 * w.global_batch * w.seq_len
        assert loss == pytest.approx(float(sum(sums)) / tokens, rel=1e-5)
    finally:
        trainer.close()


# ----------------------------------------------------------------------------- logs

def test_log_lines_and_weights_and_biases(tmp_path, monkeypatch):
    from tessera.cli.train_log import LineLog, event_line, make_log, step_line
    from tessera.runtime.metrics import MetricsWriter, StepRecord

    r = StepRecord(step=12, loss=6.12341, lr=3e-4, grad_norm=1.0, step_time_s=1.5, tokens_per_s=812.4, mfu=0.234,
                   peak_memory_bytes=[1.3 * 2**30, 1.2 * 2**30], predicted_step_time_s=1.2)
    assert step_line(r, 100) == ("step 12/100 | loss 6.1234 | 812 tok/s | MFU 23.4% | step 1.50 s, predicted "
                                 "1.20 s (+25%) | peak mem 1.30 GiB")
    assert event_line("resume", {"step": 50, "path": "ckpt", "dropped_lines": 1}) == \
        "resumed from ckpt at step 50; dropped 1 metrics line past it"
    assert event_line("save", {"step": 50, "path": "ckpt/step-50"}) == "saved checkpoint of step 50 to ckpt/step-50"
    assert isinstance(make_log("auto", 10), LineLog) and type(make_log("auto", 10)) is LineLog  # not a terminal

    calls = []
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or types.SimpleNamespace(
        log=lambda scalars, step: calls.append(("log", step, scalars)), finish=lambda: calls.append(("finish",))))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    writer = MetricsWriter(tmp_path / "m.jsonl", run_id="r1", wandb={"project": "p", "id": "r1"})
    writer.write(r)
    writer.write_eval(12, 5.0, math.exp(5.0), 256)
    writer.close()
    assert calls[0] == ("init", {"resume": "allow", "project": "p", "id": "r1"})
    assert calls[1][:2] == ("log", 12) and calls[1][2]["train/loss"] == r.loss
    assert calls[2] == ("log", 12, {"eval/loss": 5.0, "eval/perplexity": math.exp(5.0)}) and calls[3] == ("finish",)
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert lines[0]["run_id"] == "r1" and lines[1] == {"run_id": "r1", "step": 12, "eval_loss": 5.0,
                                                        "eval_perplexity": math.exp(5.0), "eval_tokens": 256}


def test_the_tool_describes_itself(capsys):
    from tessera import __version__

    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"tessera {__version__}"
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "fits in memory" in text and "tessera train --config examples/demo.toml" in text
    assert "module" not in text and "add_arguments" not in text


# ----------------------------------------------------------------------------- examples that show what they say

def test_varlen_benchmark_falls_back_to_the_shipped_lengths(monkeypatch):
    import importlib.util

    import numpy as np

    spec = importlib.util.spec_from_file_location("varlen_bench", ROOT / "benchmarks" / "varlen.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "SHARED_LENGTHS", ROOT / "no-such-file.txt")
    path = bench.default_lengths()
    assert path == ROOT / "benchmarks" / "data" / "wikipedia-lengths-10240.txt"
    lengths = bench.load_lengths(path)
    assert len(lengths) == 10240 and np.all(lengths > 0)  # 20 batches of 512: the default run


def test_a_long_pipeline_timeline_adds_zooms(tmp_path):
    from tessera.cost.evaluate import simulate_plan
    from tessera.report.plots import plot_timeline
    from tessera.search import manual_plan
    from tessera.spec.presets import get_model, make_cluster
    from tessera.spec.workload import Workload

    plan = manual_plan(get_model("llama2-70b"), make_cluster("h100-80gb", 64, 8),
                       Workload(global_batch=64, seq_len=4096), tp=8, pp=8, dp=1, schedule="1f1b")
    result, tails = simulate_plan(plan)
    assert plan.num_micro_batches == 64
    drawing = plot_timeline(result.events, 8, tmp_path / "t", tails=tails)
    svg = (tmp_path / "t.svg").read_text()
    assert "zoom: start of the step" in svg and "zoom: end of the step" in svg
    assert svg.count('id="event-') == drawing.event_boxes == len(result.events)  # ids once, in the whole step


def test_rope_models_train_past_their_table_and_learned_positions_refuse(tmp_path):
    """A workload longer than `max_seq_len` (64 here): a RoPE model's table grows to the sequence
    and trains; a learned-position model is refused in one line."""
    import math

    sys.path.insert(0, str(ROOT / "tests" / "dist"))
    from runtime_common import GPT2, LLAMA, S, make_plan

    from tessera.errors import TesseraError
    from tessera.runtime.trainer import TrainConfig, Trainer

    trainer = Trainer(TrainConfig(plan=make_plan(LLAMA, 1, S(), global_batch=2, seq_len=96), steps=1,
                                  synthetic_data=True))
    try:
        assert trainer.plan.model.config.max_seq_len == 96
        (record,) = trainer.train()
        assert math.isfinite(record.loss)
    finally:
        trainer.close()
    with pytest.raises(TesseraError, match="learned positions for 64 tokens; the workload's sequences have 96"):
        Trainer(TrainConfig(plan=make_plan(GPT2, 1, S(), global_batch=2, seq_len=96), steps=1, synthetic_data=True))
