"""`tessera train --config` end to end, as a user drives it with its output redirected to a file.

One process trains 3 steps (a checkpoint and an evaluation at step 2), then the run is resumed from
its directory at 2 ranks under a 2-stage pipeline plan (one torchrun launch) and continues to step
5: each logged step is a line in the output file, the save, the resume and the evaluations have
their lines, the metrics file holds each step once with the run id, the resumed run repeats the
first run's step 3 and its evaluation, and the run directory holds the resolved config."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()


def _documents(directory: Path) -> Path:
    import random

    rng = random.Random(0)
    directory.mkdir()
    for i in range(40):
        n = rng.choice([20, 60, 120, 200])
        (directory / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(n)))
    return directory


def _train(args: list[str], log: Path, cwd: Path) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    with open(log, "w") as out:  # not a terminal: plain lines, as under Slurm or nohup
        proc = subprocess.run([sys.executable, "-m", "tessera", "train", *args], cwd=cwd, env=env,
                              stdout=out, stderr=subprocess.STDOUT, timeout=600)
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    return text


def _config(path: Path, docs: Path, runs: Path, plan: str, every: int) -> Path:
    path.write_text(f"""
[model]
name = "tiny-llama"
[data]
path = "{docs}"
global_batch = 4
seq_len = 64
[plan]
{plan}
[train]
steps = 3
[optim]
lr = 1e-3
warmup_steps = 1
decay = "linear"
[eval]
every = {every}
batches = 1
fraction = 0.25
[checkpoint]
every = 2
final = false
[run]
out = "{runs}/{{name}}/{{id}}"
id = "e2e"
""")
    return path


@pytest.mark.dist
def test_train_config_runs_resumes_and_keeps_its_records(tmp_path, capsys):
    from tessera.cli import main
    from tessera.config import load_config
    from tessera.spec.presets.clusters import local_cpu_cluster

    docs = _documents(tmp_path / "docs")
    runs = tmp_path / "runs"
    config = _config(tmp_path / "run.toml", docs, runs, 'cluster = "builtin"', every=2)
    first = _train(["--config", str(config)], tmp_path / "first.log", tmp_path)
    run = runs / "tiny-llama" / "e2e"
    assert [line.split(" |")[0] for line in first.splitlines() if line.startswith("step ")] == \
        ["step 1/3", "step 2/3", "step 3/3"]
    assert f"saved checkpoint of step 2 to {run / 'checkpoints' / 'step-2'}" in first
    assert "eval at step 2: loss " in first and "eval at step 3: loss " in first and "perplexity" in first
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2"]
    before = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    # Resume the run at 2 ranks under another plan, a 2-stage pipeline, evaluating every step.
    cpu2 = tmp_path / "cpu2.json"
    cpu2.write_text(local_cpu_cluster(2).model_dump_json())
    pp2 = tmp_path / "pp2.json"
    assert main(["plan", "--model", "tiny-llama", "--cluster", str(cpu2), "--pp", "2", "--schedule", "1f1b",
                 "--global-batch", "4", "--seq-len", "64", "--micro-batch-size", "1", "-o", str(pp2)]) == 0
    capsys.readouterr()
    config2 = _config(tmp_path / "run2.toml", docs, runs, f'file = "{pp2}"', every=1)
    second = _train(["--config", str(config2), "--resume", str(run), "--steps", "5", "--nproc", "2"],
                    tmp_path / "second.log", tmp_path)
    assert "launching torchrun with 2 processes" in second
    assert f"resumed from {run / 'checkpoints'} at step 2; dropped 2 metrics lines past it" in second
    assert [line.split(" |")[0] for line in second.splitlines() if line.startswith("step ")] == \
        ["step 3/5", "step 4/5", "step 5/5"]
    assert all(f"eval at step {s}: loss " in second for s in (3, 4, 5))
    assert f"saved checkpoint of step 4 to {run / 'checkpoints' / 'step-4'}" in second

    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {r["run_id"] for r in lines} == {"e2e"}
    assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3, 4, 5]  # the first run's step 3 dropped
    assert [r["step"] for r in lines if "eval_loss" in r] == [2, 3, 4, 5]
    assert all(r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"]), rel=1e-12)
               for r in lines if "eval_loss" in r)
    # The same data, weights and optimizer state under another plan and world size: step 3 and the
    # evaluation after it, through the pipeline's forward-only schedule, are what one rank had.
    old = {("eval" if "eval_loss" in r else "step", r["step"]): r for r in before}
    new = {("eval" if "eval_loss" in r else "step", r["step"]): r for r in lines}
    assert new["step", 3]["loss"] == pytest.approx(old["step", 3]["loss"], rel=1e-5)
    assert new["eval", 3]["eval_loss"] == pytest.approx(old["eval", 3]["eval_loss"], rel=1e-5)
    assert new["eval", 3]["eval_tokens"] == old["eval", 3]["eval_tokens"]

    resolved = load_config(run / "config.toml")
    assert (resolved.train.steps, resolved.plan.nproc, resolved.run.id) == (5, 2, "e2e")
    assert (resolved.data.global_batch, resolved.data.seq_len, resolved.optim.decay) == (4, 64, "linear")
    assert resolved.plan.file == str(run / "plan.json")
    assert json.loads((run / "plan.json").read_text())["pipeline"]["degree"] == 2
