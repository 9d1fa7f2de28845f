"""What a training rank does to survive failures: its side of recovery by itself.

The job restarts through torchrun's elastic agent (`--max-restarts`, c10d rendezvous; Tessera's own
launcher is `tessera/cli/launch.py`); what each rank adds:

- **Resume from the latest valid checkpoint** when the agent restarts it (`TORCHELASTIC_RESTART_COUNT`
  > 0) or when asked (`--resume auto`): the newest checkpoint whose files match their manifest,
  else the one before it (`CheckpointManager.latest_valid`).
- **Hang detection**: once the first step is done, a watchdog thread exits the rank (code
  `EXIT_HUNG`) when no step has finished for `hang_timeout_s` (three times the slowest step after
  the first ones, if that is longer; twice the timeout until those first steps are done). A rank
  stopped or stuck anywhere leaves the others waiting in a collective; their watchdogs fire, the
  agent sees the failure, stops every rank and restarts.
  Before the first step (imports, build, checkpoint load, which can take long), the process
  groups' timeout catches a rank that never arrives: twice the hang timeout, at least 10 minutes
  (`process_group_timeout`); a collective that waits longer raises on gloo and aborts on NCCL.
- **Preemption**: SIGTERM sets a flag; at the end of the step the ranks agree (one all-reduce of a
  flag on the control group), save a checkpoint and exit 0.
- **No orphans**: each rank asks the kernel to kill it when its parent (the agent) dies
  (`PR_SET_PDEATHSIG`), so killing the launcher, even with SIGKILL, leaves no rank behind.
- **Non-finite losses** (`NonFiniteGuard`): a step whose loss or gradient norm is NaN or infinite
  is not applied; then, as configured, the run skips it, rolls back to the latest valid
  checkpoint (past the batch that caused it), or stops; `max_bad_steps` bad steps in a row (or
  rollbacks) stop it. A checkpoint is written only when every parameter is finite.
- **Status files**: under Tessera's launcher (`TESSERA_STATUS_DIR`), a rank that stops writes one
  JSON line (kind, message, step) there, so the launcher reports the reason once instead of each
  rank's traceback, and does not restart what a restart cannot fix (bad input, divergence).

Test-only options (environment variables, never needed in production):
  TESSERA_TEST_FAULTS="kill@rank=3,step=6[,attempt=0][,corrupt=latest];stop@rank=1,step=9"
      at the end of the given step (on the given restart attempt, default 0) the rank kills itself
      with SIGKILL, or stops itself with SIGSTOP (a hang); `corrupt=latest` first damages a file
      of the newest checkpoint, so that recovery must fall back to the one before.
  TESSERA_TEST_SLOW_RANK="2:3.0[:from_step[:to_step]]"
      rank 2 runs as a device 3x slower: after each step's compute it sleeps twice that compute
      time (counted as compute), and so does its matmul probe (`stragglers.py`).
"""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from ..errors import TesseraError

log = logging.getLogger(__name__)

EXIT_BAD_INPUT = 2  # a TesseraError: the same input fails the same way, never restarted
EXIT_DIVERGED = 3  # non-finite loss under `stop` (or too many bad steps): never restarted
EXIT_HUNG = 4  # the watchdog saw no progress: restarted
NO_RESTART_CODES = (EXIT_BAD_INPUT, EXIT_DIVERGED)

STATUS_DIR_ENV = "TESSERA_STATUS_DIR"
NONFINITE_POLICIES = ("skip", "rollback", "stop")


class TrainingDiverged(TesseraError):
    """The loss or gradient norm is not finite and the policy says stop."""


@dataclass(frozen=True)
class ResilienceConfig:
    hang_timeout_s: float = 300.0  # no finished step for this long: the rank is hung
    on_nonfinite: str = "skip"  # skip | rollback | stop
    max_bad_steps: int = 3  # non-finite steps in a row (or rollbacks in a row) before stopping

    def __post_init__(self) -> None:
        if not (self.hang_timeout_s > 0 and math.isfinite(self.hang_timeout_s)):
            raise TesseraError(f"--hang-timeout must be a positive number of seconds, got {self.hang_timeout_s}")
        if self.on_nonfinite not in NONFINITE_POLICIES:
            raise TesseraError(f"--on-nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, "
                               f"got {self.on_nonfinite!r}")
        if self.max_bad_steps < 1:
            raise TesseraError(f"--max-bad-steps must be at least 1, got {self.max_bad_steps}")

    @property
    def process_group_timeout(self) -> timedelta:
        """The collectives' deadline (module docstring): start-up waits far longer than a step."""
        return timedelta(seconds=max(2 * self.hang_timeout_s, 600.0))


def restart_count() -> int:
    """How many times this node's ranks were restarted (0 on the first attempt): Tessera's launcher
    counts every restart (`TESSERA_ATTEMPT`); torchrun's own count leaves out the restarts a node
    makes because another node failed (a membership change), so across nodes it may differ."""
    try:
        return int(os.environ.get("TESSERA_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


# --- the rank's process ---------------------------------------------------------------------------


def process_group_store(timeout: timedelta):
    """The store `init_process_group` should use, or None for torchrun's own (env://).

    torchrun's c10d rendezvous shares the agent's TCPStore with the ranks, and that store outlives
    a restart: the ranks of the next attempt would read the previous attempt's addresses and fail
    to connect (pytorch/pytorch#135712). Restarted ranks on a shared store therefore use it under
    a prefix of their attempt on one node (Tessera's launcher instead turns the sharing off; across
    nodes, set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun)."""
    single_node = os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or restart_count() == 0
            or "TESSERA_ATTEMPT" in os.environ or not single_node):  # counts may differ across nodes
        return None
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"tessera/attempt-{restart_count()}", store)


def init_rank_process_group(backend: str, timeout: timedelta) -> None:
    """The default process group of a torchrun rank, with the collectives' deadline `timeout`, on a
    fresh store after a restart where torchrun shares its own (`process_group_store`)."""
    import torch.distributed as dist

    store = process_group_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


def bind_to_parent() -> None:
    """Die with the parent (the torchrun agent): the kernel sends SIGKILL when it exits (Linux),
    and a parent that died before this ran is noticed here. Call it early in each rank."""
    expected = os.environ.get("TESSERA_AGENT_PID")
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            log.debug("prctl(PR_SET_PDEATHSIG) is not available")
    if (expected and str(os.getppid()) != expected) or os.getppid() == 1:
        os._exit(1)  # the launcher is already gone: nothing to train for


class StopRequest:
    """SIGTERM (preemption) asks the rank to checkpoint and stop at the end of the step."""

    def __init__(self) -> None:
        self.requested = False
        self.installed = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self.previous = signal.signal(signal.SIGTERM, self._handle)
        self.installed = True

    def uninstall(self) -> None:
        if self.installed:
            signal.signal(signal.SIGTERM, self.previous)
            self.installed = False

    def _handle(self, signum, frame) -> None:
        if not self.requested:
            log.warning("SIGTERM: saving a checkpoint and stopping at the end of this step")
        self.requested = True


class Watchdog(threading.Thread):
    """Exits the process (`EXIT_HUNG`) when `kick` has not been called for the deadline (see the
    module docstring); `kick` after every step, `relax` around waits that are not steps."""

    def __init__(self, hang_timeout_s: float, rank: int, on_fire=None):
        super().__init__(name="tessera-watchdog", daemon=True)
        self.timeout = hang_timeout_s
        self.rank = rank
        self.on_fire = on_fire
        self.last = time.monotonic()
        self.slowest_step = 0.0
        self.kicks = 0
        self.step = 0
        self.relaxed = 0
        self._halt = threading.Event()

    @property
    def deadline_s(self) -> float:
        """The hang timeout, or three times the slowest step if longer; twice the timeout over the
        first steps of the process (their time is not measured: warm-up, first collectives, a
        checkpoint loaded just before), so that a restart is not taken for a hang."""
        warming_up = self.kicks < 3
        return max(self.timeout * (2 if warming_up else 1), 3 * self.slowest_step)

    def kick(self, step: int) -> None:
        """A step is done: the watchdog is armed from the first one on."""
        now = time.monotonic()
        if self.kicks >= 2:  # the first steps warm up (lazy imports, first collectives): not a measure
            self.slowest_step = max(self.slowest_step, now - self.last)
        self.kicks += 1
        self.step = step
        self.last = now

    def relax(self):
        """A context in which the rank is not hung however long it takes (a checkpoint load)."""
        watchdog = self

        class _Relaxed:
            def __enter__(self):
                watchdog.relaxed += 1

            def __exit__(self, *exc):
                watchdog.relaxed -= 1
                watchdog.last = time.monotonic()

        return _Relaxed()

    def run(self) -> None:
        while not self._halt.wait(min(1.0, self.timeout / 10)):
            if self.relaxed or not self.kicks:
                continue
            waited = time.monotonic() - self.last
            if waited > self.deadline_s:
                message = (f"rank {self.rank} made no progress for {waited:.0f} s after step {self.step} "
                           f"(--hang-timeout {self.timeout:g} s): treating the job as hung")
                log.error(message)
                write_status("hung", message, self.step)
                if self.on_fire is not None:
                    self.on_fire()
                os._exit(EXIT_HUNG)

    def stop(self) -> None:
        self._halt.set()


def write_status(kind: str, message: str, step: int | None = None, **extra) -> None:
    """One JSON object for the launcher (`TESSERA_STATUS_DIR/rank-<r>.json`), when it asked."""
    directory = os.environ.get(STATUS_DIR_ENV)
    if not directory:
        return
    rank = int(os.environ.get("RANK", "0"))
    record = {"kind": kind, "message": message, "step": step, "rank": rank,
              "attempt": restart_count(), "time": time.time(), **extra}
    path = Path(directory) / f"rank-{rank:05d}.json"
    try:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)
    except OSError:
        log.debug("could not write %s", path)


def run_worker(train_fn) -> int:
    """Run a rank's training and map how it ended to an exit code and a status (for the
    launcher): a TesseraError is bad input (2) unless it is a divergence (3); anything else is a
    crash the agent restarts, reported in one line instead of a traceback."""
    try:
        code = int(train_fn() or 0)
    except TrainingDiverged as e:
        write_status("diverged", str(e))
        _say(str(e))
        return EXIT_DIVERGED
    except (TesseraError, ValueError, FileNotFoundError) as e:
        if os.environ.get("TESSERA_DEBUG"):
            raise
        write_status("input", str(e))
        _say(str(e), only_rank0=True)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - a lost peer, an I/O error...: the agent restarts
        if os.environ.get("TESSERA_DEBUG"):
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        message = f"rank {os.environ.get('RANK', 0)} failed: {type(e).__name__}: {first}"
        write_status("crash", message)
        _say(message)
        return 1
    return code


def _say(message: str, only_rank0: bool = False) -> None:
    """Print a rank's one line, unless Tessera's launcher reports it (it prints each reason once)."""
    if os.environ.get(STATUS_DIR_ENV):
        return
    if only_rank0 and os.environ.get("RANK", "0") != "0":
        return
    print(f"tessera train: error: {message}", file=sys.stderr, flush=True)


# --- non-finite losses --------------------------------------------------------------------------


def all_finite(*tensors) -> bool:
    """Whether every value is finite (one host read for all of them)."""
    import torch

    from torch._subclasses.fake_tensor import is_fake

    flags = [torch.isfinite(torch.as_tensor(t)).all() for t in tensors if t is not None]
    if any(is_fake(f) or f.is_meta for f in flags):
        return True  # a dry run's values do not exist: it steps, as the plan does
    return bool(torch.stack([f.to(flags[0].device) for f in flags]).all()) if flags else True


def parameters_finite(params, group=None) -> bool:
    """Whether every rank's parameters are all finite (collective on `group`)."""
    import torch
    import torch.distributed as dist

    ok = True
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.numel() and not bool(torch.isfinite(local.detach()).all()):
            ok = False
            break
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag) == 0


class NonFiniteGuard:
    """Counts non-finite steps and says what to do with each (the module docstring)."""

    def __init__(self, config: ResilienceConfig):
        self.config = config
        self.bad_in_a_row = 0
        self.rollbacks_in_a_row = 0
        self.total_bad = 0

    def good_step(self) -> None:
        self.bad_in_a_row = 0

    def good_checkpoint(self) -> None:
        self.rollbacks_in_a_row = 0

    def bad_step(self, step: int, loss: float, grad_norm: float, last_checkpoint: str | None) -> str:
        """'skip' or 'rollback'; raises TrainingDiverged when the run must stop."""
        self.bad_in_a_row += 1
        self.total_bad += 1
        policy = self.config.on_nonfinite
        what = f"the loss is {loss:g} (gradient norm {grad_norm:g}) at step {step}"
        clean = (f"the last checkpoint, {last_checkpoint}, holds only finite values" if last_checkpoint
                 else "no checkpoint was written")
        if policy == "stop":
            raise TrainingDiverged(f"{what}: stopped (--on-nonfinite stop); {clean}")
        if policy == "rollback":
            self.rollbacks_in_a_row += 1
            if last_checkpoint is None or self.rollbacks_in_a_row > self.config.max_bad_steps:
                why = "no checkpoint to roll back to" if last_checkpoint is None else \
                      f"{self.rollbacks_in_a_row - 1} rollbacks in a row did not help"
                raise TrainingDiverged(f"{what}: stopped ({why}); {clean}")
            return "rollback"
        if self.bad_in_a_row >= self.config.max_bad_steps:
            raise TrainingDiverged(f"{what}, {self.bad_in_a_row} non-finite steps in a row: stopped; {clean} "
                                   "(lower --lr, or --on-nonfinite rollback)")
        return "skip"


# --- test-only faults ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    action: str  # kill | stop
    rank: int
    step: int
    attempt: int = 0
    corrupt: str = ""  # "latest": damage the newest checkpoint first


def parse_faults(text: str | None) -> list[Fault]:
    """`TESSERA_TEST_FAULTS` (module docstring)."""
    faults = []
    for item in filter(None, (text or "").split(";")):
        action, _, rest = item.strip().partition("@")
        if action not in ("kill", "stop"):
            raise TesseraError(f"TESSERA_TEST_FAULTS: unknown fault {action!r} (kill or stop)")
        fields = dict(kv.split("=", 1) for kv in filter(None, rest.split(",")))
        faults.append(Fault(action, int(fields["rank"]), int(fields["step"]), int(fields.get("attempt", 0)),
                            fields.get("corrupt", "")))
    return faults


def inject_faults(faults: list[Fault], rank: int, step: int, checkpoint_dir: str | None) -> None:
    """Kill or stop this rank at the end of `step` when a test asked for it."""
    for f in faults:
        if f.rank != rank or f.step != step or f.attempt != restart_count():
            continue
        if f.corrupt == "latest" and checkpoint_dir:
            _corrupt_latest(Path(checkpoint_dir))
        log.warning("test fault: %s rank %d at step %d", f.action, rank, step)
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL if f.action == "kill" else signal.SIGSTOP)


def _corrupt_latest(directory: Path) -> None:
    from .checkpoint import CheckpointManager

    latest = CheckpointManager(directory).latest()
    if latest is None:
        return
    victim = sorted(p for p in latest.rglob("*.distcp"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    log.warning("test fault: damaged %s", victim)


@dataclass(frozen=True)
class SlowDevice:
    """`TESSERA_TEST_SLOW_RANK` (module docstring): this rank's extra seconds for `compute_s`."""

    rank: int = -1
    factor: float = 1.0
    from_step: int = 0
    to_step: int = 1 << 62

    @classmethod
    def from_env(cls) -> "SlowDevice":
        text = os.environ.get("TESSERA_TEST_SLOW_RANK")
        if not text:
            return cls()
        parts = text.split(":")
        return cls(int(parts[0]), float(parts[1]), *(int(p) for p in parts[2:4]))

    def extra_seconds(self, rank: int, step: int, compute_s: float) -> float:
        if rank != self.rank or not self.from_step <= step < self.to_step:
            return 0.0
        return max(0.0, (self.factor - 1.0) * compute_s)
