"""`tessera train --config` end to end, as a user drives it with its output redirected to a file.

One process trains 3 steps (a checkpoint and an evaluation at step 2), then the run is resumed at
2 ranks (one torchrun launch) from its directory and continues to step 5: each logged step is a
line in the output file, the save, the resume and the evaluations have their lines, the metrics
file holds each step once with the run id, the resumed run repeats the first run's step 3 exactly,
and the run directory holds the resolved config, which loads back to the same config."""
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


@pytest.mark.dist
def test_train_config_runs_resumes_and_keeps_its_records(tmp_path):
    from tessera.config import load_config

    docs = _documents(tmp_path / "docs")
    config = tmp_path / "run.toml"
    config.write_text(f"""
[model]
name = "tiny-llama"
[data]
path = "{docs}"
global_batch = 4
seq_len = 64
[plan]
cluster = "builtin"
[train]
steps = 3
[optim]
lr = 1e-3
warmup_steps = 1
decay = "linear"
[eval]
every = 2
batches = 1
fraction = 0.25
[checkpoint]
every = 2
final = false
[run]
out = "{tmp_path}/runs/{{name}}/{{id}}"
id = "e2e"
""")
    first = _train(["--config", str(config)], tmp_path / "first.log", tmp_path)
    run = tmp_path / "runs" / "tiny-llama" / "e2e"
    assert [line.split(" |")[0] for line in first.splitlines() if line.startswith("step ")] == \
        ["step 1/3", "step 2/3", "step 3/3"]
    assert f"saved checkpoint of step 2 to {run / 'checkpoints' / 'step-2'}" in first
    assert "eval at step 2: loss " in first and "eval at step 3: loss " in first and "perplexity" in first
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2"]
    before = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if "loss" in r}

    # Resume the run from its directory at 2 ranks: its own config, two fields overridden.
    second = _train(["--resume", str(run), "--steps", "5", "--nproc", "2"], tmp_path / "second.log", tmp_path)
    assert "launching torchrun with 2 processes" in second
    assert f"resumed from {run / 'checkpoints'} at step 2; dropped 2 metrics lines past it" in second
    assert [line.split(" |")[0] for line in second.splitlines() if line.startswith("step ")] == \
        ["step 3/5", "step 4/5", "step 5/5"]
    assert "eval at step 4: loss " in second and "eval at step 5: loss " in second
    assert f"saved checkpoint of step 4 to {run / 'checkpoints' / 'step-4'}" in second

    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {r["run_id"] for r in lines} == {"e2e"}
    steps = [r["step"] for r in lines if "loss" in r]
    assert steps == [1, 2, 3, 4, 5]  # the first run's step 3 (and its evaluation) dropped, trained again
    assert [r["step"] for r in lines if "eval_loss" in r] == [2, 4, 5]
    evals = [r for r in lines if "eval_loss" in r]
    assert all(r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"]), rel=1e-12) for r in evals)
    again = {r["step"]: r for r in lines if "loss" in r}
    # The same data, weights and optimizer state: step 3's loss at 2 ranks is what 1 rank had
    # (its learning rate is not: the schedule now decays over 5 steps).
    assert again[3]["loss"] == pytest.approx(before[3]["loss"], rel=1e-5)

    resolved = load_config(run / "config.toml")
    assert (resolved.train.steps, resolved.plan.nproc, resolved.run.id) == (5, 2, "e2e")
    assert (resolved.data.global_batch, resolved.data.seq_len, resolved.optim.decay) == (4, 64, "linear")
    assert json.loads((run / "plan.json").read_text())["cluster"]["gpus_per_node"] == 2
