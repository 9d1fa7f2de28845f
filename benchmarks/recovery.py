"""Recovery by itself, hang detection and straggler re-planning, measured on real processes.

    python benchmarks/recovery.py                      # about 12 minutes on a loaded 2-core machine
    python benchmarks/recovery.py --checkpoints-only   # phase 3 alone

Phase 1 (one `tessera train --nproc 4` run, checkpoints every 5 steps, --hang-timeout 10):
  - kill -9 of one rank: time until the launcher reports it, time until the first step after
    the restart (the job resumes from its latest valid checkpoint), and whether the steps done
    twice (before the kill and after the resume) have the same losses, bit for bit;
  - SIGSTOP of one rank: time until the job declares itself hung (the other ranks' watchdogs),
    and until it trains again.
Phase 2 (two more runs): one rank runs as a device 4x slower from step 15 on (the test-only
  TESSERA_TEST_SLOW_RANK), in one run with the plan kept (--no-replan), in the other re-planned
  (fewer sequences for the slow rank): tokens/s of each relative to its own before the slowdown,
  the re-plan time, and the share of the lost throughput regained.
Phase 3: an asynchronous checkpoint every 2 steps against none: wall time per step (runs
  alternated, two of each), and the training loop's wait for each save.
Also: the re-plan of llama3-70b on 1,024 H100s (pp 8 x tp 8 x dp 16) with two slow devices.

The emulated slow device is slow in compute time, and on 2 cores shared by 4 ranks and other jobs
most of a step's wall time is waiting for a core, so wall tokens/s hardly see it (and move by tens
of percent with the load): the summary's regained share is taken on the slowest rank's compute
seconds per step (a data-parallel step's time on devices of their own); the wall figure is in the
table. Timings on a machine shared with other jobs move by tens of percent; the last line is
summary: kill_recovered=<0|1> losses_identical=<0|1> hang_detect_s=<x> recovery_s=<y> replan_ms=<z>
         straggler_throughput_regained_pct=<w>
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera.plan import LayerStrategy, PipelineSpec, Plan  # noqa: E402
from tessera.spec import ModelSpec, TransformerConfig, Workload  # noqa: E402
from tessera.spec.presets import local_cpu_cluster  # noqa: E402

MODEL = TransformerConfig(name="bench-llama", hidden=256, num_layers=4, num_heads=4, num_kv_heads=2,
                          ffn_hidden=768, vocab_size=2048, max_seq_len=128)
GLOBAL_BATCH, SEQ_LEN, WORLD = 32, 128, 4
# The slowed device's factor: its compute (CPU seconds) takes this many times longer. On a CPU
# shared by more ranks than cores, a step's wall time is mostly waiting for a core, so the
# slowdown shows less in tokens/s than the factor says.
SLOW = 4.0


def make_plan(path: Path) -> Path:
    spec = ModelSpec.from_config(MODEL)
    plan = Plan(model=spec, cluster=local_cpu_cluster(WORLD),
                workload=Workload(global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, dtype="fp32"),
                micro_batch_size=GLOBAL_BATCH // WORLD, num_micro_batches=1,
                pipeline=PipelineSpec(degree=1, stages=((0, len(spec.layers)),)),
                layers=tuple(LayerStrategy(dp=WORLD) for _ in spec.layers))
    from tessera.cost import evaluate

    plan.model_copy(update={"prediction": evaluate(plan)}).save(path)
    return path


class Run:
    """A `tessera train` launch whose output lines and metrics are followed with timestamps."""

    def __init__(self, out: Path, plan: Path, steps: int, extra: list[str], env: dict):
        self.out = out
        cmd = [sys.executable, "-m", "tessera", "train", "--plan", str(plan), "--nproc", str(WORLD),
               "--steps", str(steps), "--synthetic-data", "--out", str(out), "--lr", "1e-3", *extra]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self.arrivals: list[tuple[float, int]] = []  # (when, records in metrics.jsonl): wall time per step
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self) -> None:
        path, seen = self.out / "metrics.jsonl", 0
        while self.proc.poll() is None:
            try:
                count = path.read_bytes().count(b"\n") if path.exists() else 0
            except OSError:
                count = seen
            if count != seen:
                self.arrivals.append((time.monotonic(), count))
                seen = count
            time.sleep(0.02)

    def wall_per_step(self, skip: int = 3) -> float:
        """Seconds per step between the arrival of record `skip` and the last one: the step, the
        logging and the checkpoint's wait on the training loop, all of it."""
        points = [(t, n) for t, n in self.arrivals if n >= skip]
        if len(points) < 2:
            return float("nan")
        (t0, n0), (t1, n1) = points[0], points[-1]
        return (t1 - t0) / (n1 - n0)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip()))

    def records(self) -> list[dict]:
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line being written
        return out

    def events(self) -> list[dict]:
        path = self.out / "events.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def wait_for(self, predicate, timeout: float, what: str):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            value = predicate()
            if value:
                return value
            if self.proc.poll() is not None:
                raise RuntimeError(f"the run ended (exit {self.proc.returncode}) while waiting for {what}:\n"
                                   + "\n".join(x for _, x in self.lines[-20:]))
            time.sleep(0.1)
        raise RuntimeError(f"timed out waiting for {what}:\n" + "\n".join(x for _, x in self.lines[-20:]))

    def line_after(self, t: float, text: str):
        return next((when for when, line in self.lines if when >= t and text in line), None)

    def step_line_after(self, t: float):
        """When rank 0 printed its first 'step N/M | ...' line at or after `t`."""
        return next((when for when, line in self.lines if when >= t and re.match(r"step \d+/\d+ ", line)), None)

    def rank_pid(self, rank: int) -> int:
        """The pid of the training process of global rank `rank` (a child of the launcher)."""
        children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True,
                                  text=True).stdout.split()
        for pid in children:
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                return int(pid)
        raise RuntimeError(f"no process of rank {rank}")

    def stop(self) -> int:
        try:
            return self.proc.wait(timeout=600)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)


def steps_done(run: Run, n: int):
    return len(run.records()) >= n


def phase_faults(tmp: Path, plan: Path) -> dict:
    run = Run(tmp / "faults", plan, steps=60, env={},
              extra=["--checkpoint-dir", str(tmp / "faults" / "ckpt"), "--checkpoint-every", "5",
                     "--hang-timeout", "10", "--max-restarts", "3", "--no-replan"])
    try:
        run.wait_for(lambda: steps_done(run, 12), 300, "step 12")
        assert run.step_line_after(0.0), "no progress lines: the benchmark reads them to time the recovery"
        before = max(r["step"] for r in run.records())
        victim = run.rank_pid(2)
        t_kill, wall_kill = time.monotonic(), time.time()
        os.kill(victim, signal.SIGKILL)
        t_detect = run.wait_for(lambda: run.line_after(t_kill, "was killed"), 120, "the kill to be reported")
        t_resumed = run.wait_for(lambda: run.line_after(t_kill, "resumed from"), 300, "the resume")
        t_recovered = run.wait_for(lambda: run.step_line_after(t_resumed), 300, "a step after the restart")
        run.wait_for(lambda: max(r["step"] for r in run.records()) >= before + 10, 300, "ten steps after the restart")
        # The steps after the checkpoint resumed from were computed twice: the trainer compares
        # the losses logged before the kill with the new ones (its `recomputed` event).
        redone = [e for e in run.events() if e["event"] == "recomputed"]
        twice = redone[0]["steps"] if redone else []
        identical = bool(redone) and all(e["identical"] and e["losses_before"] == e["losses_after"]
                                         and e["grad_norms_before"] == e["grad_norms_after"] for e in redone)

        hung = run.rank_pid(1)
        t_stop, wall_stop = time.monotonic(), time.time()
        os.kill(hung, signal.SIGSTOP)
        t_hang = run.wait_for(lambda: run.line_after(t_stop, "treating the job as hung"), 300, "the hang")
        t_resumed = run.wait_for(lambda: run.line_after(t_hang, "resumed from"), 300, "the resume")
        t_hang_recovered = run.wait_for(lambda: run.step_line_after(t_resumed), 300, "a step after the hang")
        code = run.stop()
        resumes = [e for e in run.events() if e["event"] == "resume"]
        redone = [e for e in run.events() if e["event"] == "recomputed"]  # after the kill and the hang
        identical = bool(redone) and all(e["identical"] and e["losses_before"] == e["losses_after"]
                                         and e["grad_norms_before"] == e["grad_norms_after"] for e in redone)
        twice = [e["steps"] for e in redone]
        # When the restarted ranks had found their checkpoint (started, joined, before loading it).
        loaded = [e["time"] - w for e, w in zip(resumes, (wall_kill, wall_stop))]
        return dict(loaded_s=loaded, kill_detect_s=t_detect - t_kill, recovery_s=t_recovered - t_kill, twice=twice,
                    identical=identical, hang_detect_s=t_hang - t_stop, hang_recovery_s=t_hang_recovered - t_stop,
                    resumed_from=[e["step"] for e in resumes], exit=code, finished=code == 0)
    finally:
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)


def phase_straggler(tmp: Path, plan: Path, slow_from: int = 15, steps: int = 50) -> dict:
    """Two runs with rank 3 slowed SLOW times from step `slow_from`: one that keeps its plan (--no-replan: the
    throughput while slow) and one that re-plans. Each run's tokens/s after the slowdown is taken
    relative to its own before it, so that load from other jobs that differs between the runs cancels:
    regained = (after - during) / (1 - during), in those ratios."""
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    out: dict = {}
    for name, extra in (("kept", ["--no-replan"]), ("replanned", [])):
        run = Run(tmp / f"straggler-{name}", plan, steps=steps, env={"TESSERA_TEST_SLOW_RANK": f"3:{SLOW}:{slow_from}"},
                  extra=["--hang-timeout", "120", *extra])
        try:
            out[name + "_exit"] = run.stop()
        finally:
            if run.proc.poll() is None:
                os.killpg(run.proc.pid, signal.SIGKILL)
        out[name] = _straggler_run(run.records(), run.events(), slow_from, steps)
    kept, new = out["kept"], out["replanned"]
    switch, events = new["switch"], new["events"]
    replan = next((e for e in events if e["event"] == "replan" and e["switched"]), None)
    during, after = kept["ratio"], new["ratio"]
    regained = 100.0 * (after - during) / (1.0 - during) if during < 1 else float("nan")
    # The same on the slowest rank's compute seconds per step (the step time of devices that are
    # not shared; on this machine most of a step's wall time is waiting for a core).
    c_during, c_after = kept["crit_before"] / kept["crit_after"], new["crit_before"] / new["crit_after"]
    c_regained = 100.0 * (c_after - c_during) / (1.0 - c_during) if c_during < 1 else float("nan")
    # What no plan gets back: the slow device's lost capacity. With the probe's speeds v, at best
    # throughput is sum(v) / N of before, so at most (sum(v)/N - during) / (1 - during) is regainable
    # ((N - 1) / N = 75% for one much slower device among 4).
    speeds = next((e["probe_speed"] for e in events if e["event"] == "probe"), None)
    ceiling = sum(min(v, 1.0) for v in speeds) / len(speeds) if speeds else float("nan")
    regainable = 100.0 * (ceiling - c_during) / (1.0 - c_during) if c_during < 1 else float("nan")
    return dict(crit=(new["crit_before"], kept["crit_after"], new["crit_after"]), crit_regained_pct=c_regained,
                regainable_pct=regainable,
                before=new["before"], during=kept["after"], during_before=kept["before"], after=new["after"],
                during_ratio=during, after_ratio=after, regained_pct=regained, slow_from=slow_from,
                switch_step=switch["step"] if switch else None, shares=switch["batch_shares"] if switch else None,
                replan_ms=1e3 * replan["replan_s"] if replan else float("nan"),
                detected_after_steps=(switch["step"] - slow_from) if switch else None,
                probe=next((e["probe_speed"] for e in events if e["event"] == "probe"), None))


def _straggler_run(records: list[dict], events: list[dict], slow_from: int, steps: int) -> dict:
    """Median tokens/s and slowest rank's compute seconds before the slowdown (after warm-up) and
    once settled after it (three steps past a switch of plan)."""
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    tps = {r["step"]: r["tokens_per_s"] for r in records}
    crit = {r["step"]: max(r["compute_s"]) for r in records if r.get("compute_s")}
    switch = next((e for e in events if e["event"] == "switch"), None)
    first_after = (switch["step"] + 3) if switch else slow_from + 3
    early, late = range(5, slow_from), range(first_after, steps + 1)
    before, after = med([tps[s] for s in early if s in tps]), med([tps[s] for s in late if s in tps])
    return dict(before=before, after=after, ratio=after / before, switch=switch, events=events,
                crit_before=med([crit[s] for s in early if s in crit]), crit_after=med([crit[s] for s in late if s in crit]))


def phase_checkpoints(tmp: Path, plan: Path, steps: int = 20, rounds: int = 2) -> dict:
    """Wall time per step without checkpoints and with an asynchronous one every 2 steps, the runs
    alternated (`rounds` of each) so that the other jobs' load falls on both alike; and how long the
    training loop waited for each save (its `checkpoint` events)."""
    walls: dict[str, list[float]] = {"none": [], "async": []}
    blocking: list[float] = []
    for i in range(rounds):
        for name in ("none", "async"):
            out = tmp / f"ck-{name}-{i}"
            extra = ["--checkpoint-dir", str(out / "ckpt"), "--checkpoint-every", "2"] if name == "async" else []
            run = Run(out, plan, steps=steps, env={}, extra=["--hang-timeout", "120", "--no-replan", *extra])
            run.stop()
            walls[name].append(run.wall_per_step())
            blocking += [e["blocking_s"] for e in run.events() if e["event"] == "checkpoint"]
    none, with_ck = statistics.fmean(walls["none"]), statistics.fmean(walls["async"])
    return dict(none=none, async_=with_ck, overhead_pct=100.0 * (with_ck / none - 1.0), runs=walls,
                blocking_s=statistics.fmean(blocking) if blocking else float("nan"),
                blocking_pct=100.0 * (statistics.fmean(blocking) / 2) / none if blocking else float("nan"))


def replan_1024() -> tuple[float, float]:
    """Milliseconds of the re-plan, wall and CPU (this process), best of 3."""
    from tessera.search import manual_plan
    from tessera.search.replan import replan
    from tessera.spec.hf_config import resolve_model_config
    from tessera.spec.presets import make_cluster

    model = ModelSpec.from_config(resolve_model_config("llama3-70b"))
    plan = manual_plan(model, make_cluster("h100-80gb", 1024, 8), Workload(global_batch=1024, seq_len=4096),
                       pp=8, tp=8, dp=16, micro_batch_size=1, zero=1, recompute="full")
    best, best_cpu = float("inf"), float("inf")
    for _ in range(3):
        t0, c0 = time.perf_counter(), time.process_time()
        replan(plan, {5: 0.5, 133: 0.8})
        best, best_cpu = min(best, time.perf_counter() - t0), min(best_cpu, time.process_time() - c0)
    return 1e3 * best, 1e3 * best_cpu


def _fmt(xs: list[float]) -> str:
    return ", ".join(f"{x:.3f}" for x in xs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-checkpoints", action="store_true", help="leave out phase 3")
    parser.add_argument("--checkpoints-only", action="store_true", help="only phase 3 (no summary line)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tessera-recovery-"))
    plan = make_plan(tmp / "plan.json")
    if args.checkpoints_only:
        ck = phase_checkpoints(tmp, plan)
        print(f"wall per step: none {_fmt(ck['runs']['none'])}, async every 2 steps {_fmt(ck['runs']['async'])}: "
              f"{ck['overhead_pct']:+.1f}%; the training loop waits {ck['blocking_s']:.3f} s per save "
              f"({ck['blocking_pct']:.1f}% of a step)")
        return 0
    print(f"model {MODEL.name}: {ModelSpec.from_config(MODEL).num_params / 1e6:.1f}M parameters, {WORLD} ranks "
          f"(data parallel), global batch {GLOBAL_BATCH} x {SEQ_LEN}; run files in {tmp}", flush=True)
    faults = phase_faults(tmp, plan)
    print(f"kill -9 of rank 2: reported after {faults['kill_detect_s']:.1f} s, training again after "
          f"{faults['recovery_s']:.1f} s (restarted ranks chose their checkpoint after {faults['loaded_s'][0]:.1f} s, "
          f"resumed from steps {faults['resumed_from']}); steps done twice (after the kill, after the hang) "
          f"{faults['twice']}: losses identical = {faults['identical']}", flush=True)
    print(f"SIGSTOP of rank 1: hang declared after {faults['hang_detect_s']:.1f} s, training again after "
          f"{faults['hang_recovery_s']:.1f} s (checkpoint chosen after {faults['loaded_s'][-1]:.1f} s); the run "
          f"finished with exit code {faults['exit']}", flush=True)
    strag = phase_straggler(tmp, plan)
    print(f"rank 3 slowed {SLOW:g}x from step {strag['slow_from']}: probe speeds {strag['probe']}, re-planned at step "
          f"{strag['switch_step']} ({strag['detected_after_steps']} steps later) in {strag['replan_ms']:.0f} ms, "
          f"sequences per rank {strag['shares']}", flush=True)
    big_ms, big_cpu_ms = replan_1024()
    ck = None if args.skip_checkpoints else phase_checkpoints(tmp, plan)

    rows = [("kill -9 one rank: detected", f"{faults['kill_detect_s']:.1f} s"),
            ("kill -9 one rank: training again", f"{faults['recovery_s']:.1f} s"),
            ("steps done twice: losses and gradient norms", "identical" if faults["identical"] else "DIFFERENT"),
            ("SIGSTOP one rank: hang detected", f"{faults['hang_detect_s']:.1f} s"),
            ("SIGSTOP one rank: training again", f"{faults['hang_recovery_s']:.1f} s"),
            ("tokens/s before the straggler (re-planning run)", f"{strag['before']:,.0f}"),
            ("tokens/s after re-planning", f"{strag['after']:,.0f} ({strag['after_ratio']:.2f}x its before)"),
            (f"tokens/s while {SLOW:g}x slow, plan kept (other run)",
             f"{strag['during']:,.0f} ({strag['during_ratio']:.2f}x its before, {strag['during_before']:,.0f})"),
            ("lost throughput regained (wall tokens/s)", f"{strag['regained_pct']:.0f}%"),
            ("slowest rank's compute per step: before, slow, re-planned",
             " / ".join(f"{x:.3f} s" for x in strag["crit"])),
            ("lost throughput regained (slowest rank's compute)",
             f"{strag['crit_regained_pct']:.0f}% of a regainable {strag['regainable_pct']:.0f}% "
             f"({100 * strag['crit_regained_pct'] / strag['regainable_pct']:.0f}% of what a plan can get back)"),
            ("re-plan in the run (4 ranks)", f"{strag['replan_ms']:.0f} ms"),
            ("re-plan llama3-70b on 1,024 GPUs", f"{big_ms:.0f} ms ({big_cpu_ms:.0f} ms of CPU)")]
    if ck is not None:
        rows += [("wall per step, no checkpoints", f"{ck['none']:.3f} s  (runs {_fmt(ck['runs']['none'])})"),
                 ("wall per step, async checkpoint every 2 steps",
                  f"{ck['async_']:.3f} s ({ck['overhead_pct']:+.1f}%)  (runs {_fmt(ck['runs']['async'])})"),
                 ("training loop's wait per save", f"{ck['blocking_s']:.3f} s ({ck['blocking_pct']:.1f}% of a step, "
                                                    "per step at one save every 2)")]
    width = max(len(a) for a, _ in rows)
    print()
    for a, b in rows:
        print(f"{a:<{width}}  {b}")
    print("(a loaded 2-core machine: timings move with the other jobs)")
    print(f"summary: kill_recovered={int(faults['finished'])} losses_identical={int(faults['identical'])} "
          f"hang_detect_s={faults['hang_detect_s']:.1f} recovery_s={faults['recovery_s']:.1f} "
          f"replan_ms={big_ms:.0f} straggler_throughput_regained_pct={strag['crit_regained_pct']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
