"""One-process parts of recovery: safe checkpoint loading (nothing unpickled as an arbitrary
object), falling back past a corrupt checkpoint, the non-finite policies, the hang watchdog, RNG
state in a checkpoint. The multi-process parts are in test_resilience_dist.py."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from tessera.errors import TesseraError
from tessera.models.transformer import build_model
from tessera.runtime.checkpoint import CheckpointManager
from tessera.runtime.resilience import (NonFiniteGuard, ResilienceConfig, TrainingDiverged, parse_faults)
from tests.dist.pipeline_checkpoint_common import TINY_LLAMA, make_optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Payload:
    """Unpickling this runs a command (what a tampered checkpoint would carry)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _saved(tmp_path, step=1, extra=None):
    model = build_model(TINY_LLAMA)
    opt = make_optimizer(model.parameters())
    return CheckpointManager(tmp_path).save(step, [model], [opt], extra or {"step": step}), model, opt


def _rehash(ckpt):
    """Recompute the manifest, as an attacker who can write the directory would."""
    import hashlib
    import json

    manifest = json.loads((ckpt / "manifest.json").read_text())
    for rel in manifest["files"]:
        data = (ckpt / rel).read_bytes()
        manifest["files"][rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("target", [".metadata", "extra/rank-00000.pt"])
def test_a_tampered_checkpoint_runs_nothing(tmp_path, target):
    ckpt, model, opt = _saved(tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    if target == ".metadata":
        (ckpt / target).write_bytes(pickle.dumps(_Payload(str(marker))))
    else:
        torch.save({"step": 1, "x": _Payload(str(marker))}, ckpt / target)
    _rehash(ckpt)
    with pytest.raises(TesseraError, match="is refused"):
        CheckpointManager(tmp_path / "ckpt").load([model], [opt])
    assert not marker.exists()


def test_export_reads_metadata_safely(tmp_path):
    from tessera.runtime.safe_dcp import read_metadata

    ckpt, _, _ = _saved(tmp_path / "ckpt")
    assert "model.tok_embeddings.weight" in read_metadata(ckpt).state_dict_metadata
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(str(tmp_path / "pwned"))))
    with pytest.raises(TesseraError, match="holds something other than checkpoint metadata"):
        read_metadata(ckpt)
    assert not (tmp_path / "pwned").exists()


def test_latest_valid_falls_back_past_a_corrupt_checkpoint(tmp_path, caplog):
    model = build_model(TINY_LLAMA)
    opt = make_optimizer(model.parameters())
    manager = CheckpointManager(tmp_path)
    for step in (2, 4):
        manager.save(step, [model], [opt], {"step": step})
    victim = next((tmp_path / "step-4").glob("*.distcp"))
    victim.write_bytes(victim.read_bytes()[:-3] + b"xyz")
    assert manager.latest().name == "step-4"
    assert manager.latest_valid().name == "step-2"
    assert "step-4 is corrupt" in caplog.text
    victim2 = next((tmp_path / "step-2").glob("*.distcp"))
    victim2.write_bytes(b"")
    assert manager.latest_valid() is None


def test_rng_state_round_trips_through_a_checkpoint(tmp_path):
    """The trainer's RNG state (torch, numpy, python) saves as tensors and loads with weights_only."""
    import random

    import numpy as np

    from tessera.runtime.rng import restore_rng_state, rng_state

    torch.manual_seed(3)
    np.random.seed(4)
    random.seed(5)
    state = rng_state()
    want = (torch.rand(3), np.random.rand(3), random.random())
    _, model, opt = _saved(tmp_path, 1, {"step": 1, "rng": state})
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    extra = CheckpointManager(tmp_path).load([model], [opt])
    restore_rng_state(extra["rng"])
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(want[0], got[0]) and np.array_equal(want[1], got[1]) and want[2] == got[2]


def test_nonfinite_policies():
    skip = NonFiniteGuard(ResilienceConfig(on_nonfinite="skip", max_bad_steps=2))
    assert skip.bad_step(5, float("nan"), float("nan"), "step-4") == "skip"
    skip.good_step()
    assert skip.bad_step(7, float("nan"), 1.0, "step-4") == "skip"
    with pytest.raises(TrainingDiverged, match="2 non-finite steps in a row: stopped; the last checkpoint, "
                                               "step-4, holds only finite values"):
        skip.bad_step(8, float("inf"), float("inf"), "step-4")
    with pytest.raises(TrainingDiverged, match=r"the loss is nan .* at step 3: stopped \(--on-nonfinite stop\)"):
        NonFiniteGuard(ResilienceConfig(on_nonfinite="stop")).bad_step(3, float("nan"), 0.0, None)
    back = NonFiniteGuard(ResilienceConfig(on_nonfinite="rollback", max_bad_steps=1))
    assert back.bad_step(3, float("nan"), 0.0, "step-2") == "rollback"
    with pytest.raises(TrainingDiverged, match="rollbacks in a row did not help"):
        back.bad_step(3, float("nan"), 0.0, "step-2")
    with pytest.raises(TrainingDiverged, match="no checkpoint to roll back to"):
        NonFiniteGuard(ResilienceConfig(on_nonfinite="rollback")).bad_step(1, float("nan"), 0.0, None)
    for bad, msg in (({"hang_timeout_s": 0}, "--hang-timeout"), ({"on_nonfinite": "ignore"}, "--on-nonfinite"),
                     ({"max_bad_steps": 0}, "--max-bad-steps"), ({"hang_timeout_s": float("inf")}, "--hang-timeout")):
        with pytest.raises(TesseraError, match=msg):
            ResilienceConfig(**bad)


def test_watchdog_exits_a_rank_that_makes_no_progress(tmp_path):
    """A rank whose steps stop for longer than the hang timeout exits with EXIT_HUNG and says why."""
    code = ("import time; from tessera.runtime.resilience import Watchdog\n"
            "w = Watchdog(0.5, rank=3); w.start(); w.kick(1); time.sleep(0.3); w.kick(2); time.sleep(30)")
    env = {**os.environ, "PYTHONPATH": ROOT, "TESSERA_STATUS_DIR": str(tmp_path), "RANK": "3"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 4, proc.stderr
    status = (tmp_path / "rank-00003.json").read_text()
    assert '"kind": "hung"' in status and "no progress for" in status and "after step 2" in status


def test_watchdog_deadline_allows_the_first_steps_more():
    from tessera.runtime.resilience import Watchdog

    w = Watchdog(10.0, rank=0)
    assert w.deadline_s == 20.0  # warm-up: the first steps after a (re)start are slow
    for step in (1, 2, 3):
        w.kick(step)
    assert w.deadline_s == 10.0
    w.slowest_step = 5.0
    assert w.deadline_s == 15.0


def test_fault_specs():
    faults = parse_faults("kill@rank=3,step=6,corrupt=latest;stop@rank=1,step=9,attempt=1")
    assert [(f.action, f.rank, f.step, f.attempt, f.corrupt) for f in faults] == [
        ("kill", 3, 6, 0, "latest"), ("stop", 1, 9, 1, "")]
    with pytest.raises(TesseraError, match="unknown fault"):
        parse_faults("explode@rank=1,step=1")


class _NaNAtCall:
    """The trainer's loss, but NaN on the calls listed (a batch that blows up)."""

    def __init__(self, inner, bad_calls):
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "bad", set(bad_calls))
        object.__setattr__(self, "calls", 0)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        setattr(self.inner, name, value)

    def __call__(self, logits, labels):
        object.__setattr__(self, "calls", self.calls + 1)
        loss = self.inner(logits, labels)
        return loss * float("nan") if self.calls in self.bad else loss


def _train(tmp_path, policy: str, bad_calls, steps: int = 6):
    import json

    from tessera.runtime.resilience import ResilienceConfig
    from tessera.runtime.trainer import TrainConfig, Trainer
    from tests.dist.pipeline_checkpoint_common import make_plan

    cfg = TrainConfig(plan=make_plan(TINY_LLAMA, 1), steps=steps, synthetic_data=True, seed=0,
                      checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2, metrics_path=str(tmp_path / "m.jsonl"),
                      events_path=str(tmp_path / "events.jsonl"),
                      resilience=ResilienceConfig(on_nonfinite=policy, max_bad_steps=2, hang_timeout_s=600))
    trainer = Trainer(cfg)
    trainer.loss_fn = _NaNAtCall(trainer.loss_fn, bad_calls)
    error = None
    try:
        records = trainer.train()
    except TrainingDiverged as e:
        records, error = [], str(e)
    finally:
        trainer.close()
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()] \
        if (tmp_path / "events.jsonl").exists() else []
    saves = [e for e in events if e["event"] == "checkpoint"]
    assert all(e["blocking_s"] >= 0 for e in saves)  # the loop's wait for each save
    return trainer, records, [e for e in events if e["event"] != "checkpoint"], error


def _checkpoints_finite(directory) -> list[str]:
    import torch.distributed.checkpoint as dcp  # noqa: F401

    from tessera.runtime.checkpoint import CheckpointManager

    names = []
    for path in CheckpointManager(directory).checkpoints():
        model = build_model(TINY_LLAMA)
        CheckpointManager(directory).load([model], None, path=path)
        assert all(torch.isfinite(p).all() for p in model.parameters()), path
        names.append(path.name)
    return names


def test_nonfinite_step_is_skipped_rolled_back_or_stops(tmp_path):
    """A NaN loss at step 3: never applied, never in a checkpoint; then skip, roll back, or stop."""
    trainer, records, events, error = _train(tmp_path / "skip", "skip", {3})
    assert error is None and trainer.step == 6
    assert [r.step for r in records] == [1, 2, 4, 5, 6] and all(r.loss == r.loss for r in records)
    assert [(e["event"], e["step"], e.get("action")) for e in events] == [("nonfinite", 3, "skip")]
    saved = [json.loads(x) for x in (tmp_path / "skip" / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in saved if e["event"] == "checkpoint"] == [2, 4, 6]
    assert _checkpoints_finite(tmp_path / "skip" / "ckpt") == ["step-2", "step-4", "step-6"]

    trainer, records, events, error = _train(tmp_path / "back", "rollback", {3})
    assert error is None and trainer.step == 6
    assert [(e["event"], e["step"]) for e in events] == [("nonfinite", 3), ("rollback", 2)]
    # rolled back to step 2 and went on past the bad batch: steps 3.. again, on later batches
    assert [r.step for r in records] == [1, 2, 3, 4, 5, 6]
    assert trainer.loader.step == 7  # batches drawn: 6 steps + the one that blew up
    _checkpoints_finite(tmp_path / "back" / "ckpt")

    trainer, records, events, error = _train(tmp_path / "stop", "stop", {3})
    assert error.startswith("the loss is nan (gradient norm nan) at step 3: stopped (--on-nonfinite stop); "
                            "the last checkpoint, step-2, holds only finite values")
    assert _checkpoints_finite(tmp_path / "stop" / "ckpt") == ["step-2"]

    _, _, _, error = _train(tmp_path / "again", "skip", {3, 4})
    assert "2 non-finite steps in a row: stopped" in error


def test_switch_plan_reshards_through_dcp_without_losing_a_step(tmp_path):
    """A plan with other layer strategies: the state goes through a DCP checkpoint into the model
    rebuilt under the new plan; the weights are the same and the next step's loss is the one the
    old plan would have computed."""
    from tessera.runtime.trainer import TrainConfig, Trainer
    from tests.dist.pipeline_checkpoint_common import global_batch, make_plan

    def trainer(plan):
        return Trainer(TrainConfig(plan=plan, steps=4, seed=0, metrics_path=str(tmp_path / "m.jsonl")))

    old, new_plan = make_plan(TINY_LLAMA, 1), make_plan(TINY_LLAMA, 1, zero=3)
    a, b = trainer(old), trainer(old)
    try:
        for step in range(2):
            a.train_step(*global_batch(step))
            b.train_step(*global_batch(step))
        assert a.switch_plan(new_plan) == "resharded" and a.plan == new_plan and a.step == b.step
        for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            assert torch.equal(full.detach(), q.detach()), name
        assert a.train_step(*global_batch(2)) == pytest.approx(b.train_step(*global_batch(2)), rel=1e-6)
    finally:
        a.close()
        b.close()
