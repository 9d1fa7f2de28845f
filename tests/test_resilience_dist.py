"""Recovery by itself on real processes: two torchrun agents on this machine (`--nnodes 2`, c10d
rendezvous on 127.0.0.1) train a plan whose data-parallel mesh spans both "nodes", and in that
one launch

  attempt 0: rank 1 damages the newest checkpoint (step-4) and is killed at step 5: every rank
             restarts from step-2, the newest valid one, and recomputes steps 3-5 bit for bit;
  attempt 1: rank 1 runs as a device 3x slower from step 6: it is named the slowest rank, the
             matmul probe confirms it, the job re-plans (fewer sequences for it) and switches
             without losing a step; then rank 0 stops (SIGSTOP) at step 13: rank 1's watchdog sees
             no progress for the hang timeout, the job restarts again and finishes.

A second, short launch checks that a bad input found by the ranks is one line, once, exit code 2.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.plan import Plan
from tests.dist.pipeline_checkpoint_common import TINY_LLAMA, make_plan
from tests.torchrun_util import ROOT

STEPS = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def _two_node_plan(path: Path) -> Path:
    plan = make_plan(TINY_LLAMA, 2)
    cluster = plan.cluster.model_copy(update={"num_nodes": 2, "gpus_per_node": 1, "name": "local cpu 2x1"})
    Plan.model_validate({**plan.model_dump(), "cluster": cluster.model_dump()}).save(path)
    return path


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    out = tmp_path_factory.mktemp("two-nodes")
    plan = _two_node_plan(out / "plan-in.json")
    cmd = [sys.executable, "-m", "tessera", "train", "--plan", str(plan), "--nproc", "1", "--nnodes", "2",
           "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--steps", str(STEPS), "--synthetic-data",
           "--out", str(out), "--checkpoint-dir", str(out / "ckpt"), "--checkpoint-every", "2",
           "--hang-timeout", "5", "--lr", "3e-3", "--warmup", "1"]
    env = _env(TESSERA_TEST_FAULTS="kill@rank=1,step=5,corrupt=latest;stop@rank=0,step=13,attempt=1",
               TESSERA_TEST_SLOW_RANK="1:3.0:6")
    nodes = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    try:
        logs = [p.communicate(timeout=540)[0] for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    return out, [p.returncode for p in nodes], logs


def test_two_nodes_recover_from_a_kill_a_corrupt_checkpoint_and_a_hang(two_nodes):
    out, codes, logs = two_nodes
    assert codes == [0, 0], "\n".join(x[-3000:] for x in logs)
    both = "\n".join(logs)
    assert "rank 1 was killed (SIGKILL); restarting every rank from the latest valid checkpoint" in both
    assert "made no progress for" in both and "treating the job as hung" in both
    assert "Traceback" not in both and "ChildFailedError" not in both

    events = _lines(out / "events.jsonl")
    resumes = [e for e in events if e["event"] == "resume"]
    assert resumes[0]["step"] == 2 and resumes[0]["skipped_corrupt"].endswith("step-4")  # fell back
    assert len(resumes) == 2 and resumes[1]["step"] >= 10

    # steps computed before the kill and again after it: the same losses, bit for bit; the metrics
    # file holds each step once (the lines past the checkpoint resumed from are replaced)
    redone = [e for e in events if e["event"] == "recomputed"]
    assert redone[0]["steps"] == [3, 4, 5] and redone[0]["identical"], redone
    assert redone[0]["losses_before"] == redone[0]["losses_after"]
    assert redone[0]["grad_norms_before"] == redone[0]["grad_norms_after"]
    assert [r["step"] for r in _lines(out / "metrics.jsonl")] == list(range(1, STEPS + 1))

    # per-rank times of every step; rank 1 slower once slowed, the others wait for it
    records = _lines(out / "metrics.jsonl")
    assert all(len(r["compute_s"]) == 2 and len(r["comm_s"]) == 2 and len(r["data_s"]) == 2 for r in records)
    assert all(r["bubble_s"] == [0.0, 0.0] and len(r["rank_mfu"]) == 2 for r in records)

    # On a loaded 2-core machine step-time noise can trigger a probe before rank 1 is slowed; the
    # probe is there to catch that: it does not confirm, and nothing is re-planned on it.
    probes = [e for e in events if e["event"] == "probe"]
    confirmed = [p for p in probes if p["confirmed"]]
    assert confirmed and confirmed[0]["slowest_rank"] == 1 and confirmed[0]["step"] >= 6, probes
    assert confirmed[0]["probe_speed"][1] < 0.8 and confirmed[0]["compute_speed"][1] < 0.8
    switch = next(e for e in events if e["event"] == "switch")
    assert switch["step"] >= confirmed[0]["step"]
    replan = next(e for e in events if e["event"] == "replan" and e["switched"])
    assert switch["how"] == "rebalanced" and switch["batch_shares"][1] < switch["batch_shares"][0]
    assert sum(switch["batch_shares"]) == 8 and replan["predicted_gain"] > 0.05
    assert replan["step"] < 13  # before the hang: the job went on under the new plan


def test_no_training_process_is_left(two_nodes):
    out, _, _ = two_nodes
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(out) not in ps


def test_bad_input_found_by_the_ranks_is_one_line_once(tmp_path):
    """Token ids beyond the model's vocabulary are found when the ranks load the data."""
    import numpy as np

    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "tokens.npy", np.arange(5000, dtype=np.int64) % 1000)  # the model has 256 ids
    plan = tmp_path / "plan.json"
    make_plan(TINY_LLAMA, 2).save(plan)
    proc = subprocess.run([sys.executable, "-m", "tessera", "train", "--plan", str(plan), "--nproc", "2",
                           "--steps", "2", "--data", str(data), "--out", str(tmp_path / "run")],
                          env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    errors = [x for x in proc.stderr.splitlines() if x.startswith("tessera train: error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and "vocabulary of 256" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    assert "restarting" not in proc.stderr  # bad input is not retried
