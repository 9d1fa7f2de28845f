"""`tessera train --adaptive` end to end: per-step sequence-parallel groups on real torchrun ranks.

The plan's cluster has so little device memory that a long document does not fit on one rank, and
so slow a link that sequence parallelism costs: the step planner must run long documents on groups
of 2 or 4 ranks and short ones alone.
Whatever the groups, the losses equal a single-process run of the same data (packed rows with
per-document masks)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.adapt.seqcost import cost_model_from_plan
from tessera.search import manual_plan
from tessera.spec import LinkSpec, Workload
from tessera.spec.presets import get_model, local_cpu_cluster

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()


def _documents(directory: Path) -> None:
    import random

    rng = random.Random(0)
    directory.mkdir()
    for i in range(24):
        n = rng.choice([4, 8, 16, 60, 120])
        (directory / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(n)))


def _train(*args: str, out: Path) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "tessera", "train", "--steps", "3", "--lr", "1e-3", "--warmup", "1",
           "--out", str(out), "--no-final-checkpoint", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.dist
def test_adaptive_groups_train_like_one_process(tmp_path):
    docs = tmp_path / "docs"
    _documents(docs)
    model = get_model("tiny-llama")
    workload = Workload(global_batch=4, seq_len=64, dtype="fp32")
    # Room for the activations of ~24 tokens per rank beside the model states (under the strategy
    # that holds the most), so longer documents need SP, and a slow link, so that SP costs and
    # short documents are better off alone.
    link = LinkSpec(bandwidth=1e7, latency=50e-6)
    base = local_cpu_cluster(4).model_copy(update={"intra_node": link, "inter_node": link})
    plan = manual_plan(model, base, workload, dp=4, micro_batch_size=1, name="data-parallel")
    lo, hi = 0.0, base.device.memory_bytes
    for _ in range(60):
        mid = (lo + hi) / 2
        trial = plan.model_copy(update={"cluster": base.model_copy(
            update={"device": base.device.model_copy(update={"memory_bytes": mid})})})
        lo, hi = (mid, hi) if max(c.cap_tokens[0] for c in cost_model_from_plan(trial, True)) < 24 else (lo, mid)
    plan = plan.model_copy(update={"cluster": base.model_copy(
        update={"device": base.device.model_copy(update={"memory_bytes": hi})})})
    plan.save(tmp_path / "plan.json")

    adaptive = _train("--plan", str(tmp_path / "plan.json"), "--adaptive", "--nproc", "4", "--data", str(docs),
                      out=tmp_path / "adaptive")
    single = _train("--model", "tiny-llama", "--global-batch", "4", "--seq-len", "64", "--data", str(docs),
                    "--cluster", "builtin", out=tmp_path / "single")
    assert [r["step"] for r in adaptive] == [1, 2, 3]
    for a, s in zip(adaptive, single):
        assert a["loss"] == pytest.approx(s["loss"], rel=1e-5), (a, s)
    degrees = {d for r in adaptive for mb in r["sp_groups"] for d in mb}
    assert degrees & {2, 4} and 1 in degrees, f"expected mixed group sizes, got {[r['sp_groups'] for r in adaptive]}"
    assert all(sum(mb) == 4 for r in adaptive for mb in r["sp_groups"])


def test_adaptive_refuses_a_pipelined_plan(tmp_path, capsys):
    from tessera.cli import main

    plan = manual_plan(get_model("tiny-llama"), local_cpu_cluster(2), Workload(global_batch=4, seq_len=64),
                       pp=2, zero=1, micro_batch_size=2)
    plan.save(tmp_path / "plan.json")
    assert main(["train", "--plan", str(tmp_path / "plan.json"), "--adaptive", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tessera train: error: adaptive sequence parallelism needs a plan without pipeline")
    assert "pipeline.degree is 2" in err and len(err.splitlines()) == 1
