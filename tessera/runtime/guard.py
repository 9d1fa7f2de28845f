"""The training loop's guard: what `Trainer.train` does around each step to recover and adapt.

    guard = TrainingGuard(trainer)      # collective: the control group, the checkpoint manager
    guard.resume_path()                 # where to resume from (explicit, auto, after a restart)
    ... each step ...
    guard.on_bad_step(loss)             # non-finite: skip, roll back or stop (resilience.py)
    guard.save_checkpoint()             # only finite parameters; asynchronous
    guard.observe(record)               # straggler detection on every logged step (stragglers.py)
    guard.end_of_step(clock)            # watchdog, test faults, SIGTERM agreement, probe and re-plan
    guard.finish() / guard.close()

Collectives of its own (the stop flag, probes, plan broadcast) go over a gloo "control" group,
on the host, so they never wait for the device.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch.distributed as dist

from ..errors import TesseraError
from .resilience import (NonFiniteGuard, StopRequest, TrainingDiverged, Watchdog, inject_faults, parameters_finite,
                         parse_faults, restart_count, write_status)
from .steptime import hook_pipeline_waits, rank_shares
from .stragglers import StragglerMonitor, broadcast_json, gather_floats, matmul_probe, probe_speeds

log = logging.getLogger(__name__)


class TrainingGuard:
    def __init__(self, trainer):
        self.t = trainer
        cfg = trainer.config
        self.world = trainer.world_size
        self.control = dist.new_group(backend="gloo") if self.world > 1 else None
        self.stop = StopRequest()
        self.stop.install()
        self.watchdog = Watchdog(cfg.resilience.hang_timeout_s, trainer.rank)
        self.watchdog.start()
        self.faults = parse_faults(os.environ.get("TESSERA_TEST_FAULTS"))
        self.nonfinite = NonFiniteGuard(cfg.resilience)
        self.manager = None
        if cfg.checkpoint_dir:
            from .checkpoint import CheckpointManager
            from .export import model_files

            self.manager = CheckpointManager(cfg.checkpoint_dir, keep=cfg.checkpoint_keep,
                                             async_save=cfg.checkpoint_async,
                                             model_files=model_files(trainer.plan.model.config, cfg.init_from))
        self.monitor = StragglerMonitor(cfg.stragglers, self.world)
        self.probe_due = False
        self.stopped = False
        self.saved_step = -1
        if trainer.pipeline is not None:
            hook_pipeline_waits()

    # --- resume -----------------------------------------------------------------------------
    def resume_path(self) -> Path | None:
        """The checkpoint to start from: `--resume DIR/step-N` as given; `--resume DIR` or `auto`
        (the checkpoint directory), or any restart by the agent: the newest valid checkpoint,
        falling back past corrupt ones (None: start afresh, for `auto` and restarts only)."""
        from .checkpoint import CheckpointManager

        cfg = self.t.config
        explicit = cfg.resume not in (None, "auto")
        auto = cfg.resume == "auto" or (restart_count() > 0 and cfg.checkpoint_dir)
        if not explicit and not auto:
            return None
        if explicit:
            resume = Path(cfg.resume)
            if resume.name.startswith("step-") and (resume / "manifest.json").exists():
                return resume
            directory = resume
        else:
            if not cfg.checkpoint_dir:
                raise TesseraError("--resume auto needs --checkpoint-dir (where the checkpoints are)")
            directory = Path(cfg.checkpoint_dir)
        manager = self.manager if self.manager and Path(self.manager.directory) == directory else \
            CheckpointManager(directory)
        newest = manager.latest()
        with self.watchdog.relax():
            path = manager.latest_valid()
        if path is None:
            if explicit:
                raise TesseraError(f"no valid checkpoint to resume from in {directory}")
            return None
        self.t.events.write("resume", int(path.name.split("-")[1]), checkpoint=str(path),
                            attempt=restart_count(), skipped_corrupt=str(newest) if newest != path else None)
        if newest != path:
            log.warning("resuming from %s: the newest checkpoint %s failed verification", path, newest)
        return path

    def load(self, path: Path, keep_data_position: bool = False) -> None:
        with self.watchdog.relax():
            self.t.load_checkpoint(path, keep_data_position=keep_data_position)

    # --- non-finite steps ---------------------------------------------------------------------
    def last_checkpoint(self) -> Path | None:
        if self.manager is None:
            return None
        self.manager.wait()
        return self.manager.latest()

    def on_bad_step(self, loss) -> None:
        """The step was not applied (non-finite loss or norm): skip it, roll back, or stop."""
        t = self.t
        last = self.last_checkpoint()
        loss_value, norm = float(loss), float(t.grad_norm)
        action = self.nonfinite.bad_step(t.step, loss_value, norm, last.name if last else None)
        t.events.write("nonfinite", t.step, loss=str(loss_value), grad_norm=str(norm), action=action)
        log.warning("step %d: loss %g, gradient norm %g: not applied (%s)", t.step, loss_value, norm, action)
        if action == "rollback":
            self.load(last, keep_data_position=True)  # past the batch that blew up
            t.events.write("rollback", t.step, checkpoint=str(last))

    def good_step(self) -> None:
        self.nonfinite.good_step()

    # --- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, wait: bool = False) -> bool:
        """Save the current step (collective) if every parameter is finite; the files are written
        in the background unless `wait`."""
        t = self.t
        if self.manager is None or self.saved_step == t.step:
            if wait and self.manager is not None:
                self.manager.wait()
            return False
        if not parameters_finite(t.params, self.control):
            last = self.last_checkpoint()
            if t.config.resilience.on_nonfinite == "rollback" and last is not None:
                t.events.write("nonfinite", t.step, what="parameters", action="rollback")
                self.load(last, keep_data_position=True)
                return False
            raise TrainingDiverged(f"the parameters are not finite at step {t.step}: no checkpoint written; "
                                   + (f"the last checkpoint, {last.name}, holds only finite values" if last
                                      else "no checkpoint was written before"))
        t0 = time.perf_counter()
        self.manager.save(t.step, t.model_parts, t.optimizers, t.extra_state())
        # The training loop's wait for the save (staging; with async saves the write goes on in the
        # background): what checkpointing costs each step, shown apart from the step times.
        t.events.write("checkpoint", t.step, blocking_s=round(time.perf_counter() - t0, 4),
                       asynchronous=self.manager.async_save)
        self.saved_step = t.step
        self.nonfinite.good_checkpoint()
        if wait:
            self.manager.wait()
        return True

    def finish(self) -> None:
        if self.manager is not None:
            with self.watchdog.relax():
                self.manager.wait()

    # --- stragglers ---------------------------------------------------------------------------
    def observe(self, record) -> None:
        t = self.t
        if record.compute_s is None:
            return
        shares = rank_shares(t.plan, self.world)
        if self.monitor.observe(record.step, record.compute_s, shares, t.plan.cluster.device_speeds):
            self.probe_due = True

    def probe_and_replan(self) -> bool:
        """Run the matmul probe on every rank; if it confirms the measured speeds, re-plan and
        switch (module docstring of stragglers.py). Returns whether the plan changed."""
        from ..cost import evaluate
        from ..plan import Plan
        from ..search.replan import replan, with_speeds

        t = self.t
        self.probe_due = False
        rates = gather_floats(matmul_probe(t.device, t.rank, t.step), self.control)
        planned = t.plan.cluster.device_speeds
        speeds = self.monitor.confirm(t.step, rates, planned)
        measured = self.monitor.speeds or []
        probe = probe_speeds(rates)
        slowest = min(range(len(probe)), key=lambda r: probe[r])
        t.events.write("probe", t.step, compute_speed=[round(v, 4) for v in measured],
                       probe_speed=[round(x, 4) for x in probe], probe_flops=rates, slowest_rank=slowest,
                       confirmed=probe[slowest] < t.config.stragglers.threshold, plan_matches=speeds is None)
        if speeds is None or not t.config.stragglers.replan or (not speeds and not planned):
            return False
        payload = None
        if t.rank == 0:
            t0 = time.perf_counter()
            new = replan(t.plan, speeds)
            elapsed = time.perf_counter() - t0
            old = evaluate(with_speeds(t.plan, speeds, keep_shares=True)).step_time_s  # as it runs now
            gain = 1.0 - new.prediction.step_time_s / old
            payload = {"plan": new.to_json(indent=None) if gain >= t.config.stragglers.min_gain else None,
                       "replan_s": elapsed, "gain": gain, "before_s": old, "after_s": new.prediction.step_time_s}
        payload = broadcast_json(payload, self.control)
        t.events.write("replan", t.step, speeds={str(k): v for k, v in speeds.items()}, replan_s=payload["replan_s"],
                       predicted_gain=payload["gain"], predicted_before_s=payload["before_s"],
                       predicted_after_s=payload["after_s"], switched=payload["plan"] is not None)
        if payload["plan"] is None:
            return False
        with self.watchdog.relax():
            how = t.switch_plan(Plan.from_json(payload["plan"]))
        t.events.write("switch", t.step, how=how, batch_shares=list(t.plan.replica_rows()),
                       stages=[list(x) for x in t.plan.pipeline.stages])
        self.monitor.switched(t.step)
        return True

    # --- the end of every step ----------------------------------------------------------------
    def end_of_step(self, clock) -> bool:
        """Returns True when the run must stop now (SIGTERM on any rank: checkpoint saved)."""
        t = self.t
        self.watchdog.kick(t.step)
        if self.faults:
            if self.manager is not None and any(f.corrupt and f.rank == t.rank and f.step == t.step
                                                for f in self.faults):
                self.manager.wait()  # the checkpoint to damage must be complete
            inject_faults(self.faults, t.rank, t.step, t.config.checkpoint_dir)
        if self._agree_stop():
            self.stopped = True
            saved = self.save_checkpoint(wait=True) or self.saved_step == t.step
            where = f"{t.config.checkpoint_dir}/step-{t.step}" if saved else "no checkpoint directory"
            t.events.write("stop", t.step, reason="SIGTERM", checkpoint=where)
            write_status("stopped", f"stopped at step {t.step} on SIGTERM ({where})", t.step)
            return True
        if self.probe_due:
            self.probe_and_replan()
            clock.restart()
        return False

    def _agree_stop(self) -> bool:
        import torch

        flag = torch.tensor([1 if self.stop.requested else 0], dtype=torch.int32)
        if self.control is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control)
        return bool(flag.item())

    def close(self) -> None:
        self.watchdog.stop()
        self.stop.uninstall()
