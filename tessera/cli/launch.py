"""Launching the ranks of `tessera train --nproc N`: torchrun's elastic agent, run in this process.

    tessera train --nproc 4 --checkpoint-dir ckpt --checkpoint-every 50      # one node, 3 restarts
    tessera train --nproc 8 --nnodes 2 --rdzv-endpoint HOST:29400 ...        # the same on each node

The agent (`torch.distributed.elastic`, what `torchrun` runs) starts the ranks, watches them and,
when one fails, stops every rank of the job and starts them again after a c10d rendezvous, up to
`--max-restarts` times; across nodes the other nodes' agents join the new rendezvous and restart
theirs. The restarted ranks resume from the latest valid checkpoint (`runtime/resilience.py`).
What Tessera adds to the stock agent (`_TesseraAgent`):

- a failure a restart cannot fix is not restarted: bad input (exit 2) and divergence (exit 3);
- ranks that stop on purpose are given `STOP_GRACE_S` seconds, not torchrun's 30, before SIGKILL
  (a hung rank ignores SIGTERM);
- each rank writes how it ended to a status directory, and the launcher prints each reason once:
  a bad input is one line with exit code 2, not every rank's traceback under a ChildFailedError;
- the agent runs in this process, and every rank dies with its parent (`bind_to_parent`), so
  killing `tessera train`, even with SIGKILL, leaves no rank behind. SIGTERM to it reaches the
  ranks, which save a checkpoint and exit.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import uuid
from pathlib import Path

from ..errors import TesseraError

STOP_GRACE_S = 10
MAX_NODES = 1 << 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("recovery, nodes and stragglers")
    g.add_argument("--max-restarts", type=int, default=3,
                   help="restarts of the whole job after a rank dies or hangs (default 3); each resumes "
                        "from the latest valid checkpoint of --checkpoint-dir")
    g.add_argument("--hang-timeout", type=float, default=300.0, metavar="S",
                   help="a rank that finishes no step for S seconds is hung and the job restarts "
                        "(default 300; collectives time out at twice that)")
    g.add_argument("--on-nonfinite", choices=("skip", "rollback", "stop"), default="skip",
                   help="a NaN/inf loss or gradient norm: the step is not applied, then skip it, roll back "
                        "to the latest checkpoint, or stop (default skip)")
    g.add_argument("--max-bad-steps", type=int, default=3,
                   help="non-finite steps (or rollbacks) in a row before stopping (default 3)")
    g.add_argument("--no-replan", action="store_true",
                   help="report stragglers but keep the plan (default: re-plan around a slow device)")
    g.add_argument("--sync-checkpoints", action="store_true",
                   help="write checkpoints before the next step starts (default: in the background)")
    g.add_argument("--nnodes", type=int, default=1, help="nodes of the job; run the same command on each")
    g.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="c10d rendezvous endpoint shared by the nodes (with --nnodes > 1)")
    g.add_argument("--rdzv-id", default=None, help="job id of the rendezvous (default: from the run directory)")


def check(args) -> None:
    """Refuse bad recovery and node flags in one line, before anything starts."""
    from ..runtime.resilience import ResilienceConfig

    if args.max_restarts < 0:
        raise TesseraError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    ResilienceConfig(args.hang_timeout, args.on_nonfinite, args.max_bad_steps)
    if not 1 <= args.nnodes <= MAX_NODES:
        raise TesseraError(f"--nnodes must be between 1 and {MAX_NODES}, got {args.nnodes}")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise TesseraError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
    if args.rdzv_endpoint is not None:
        host, _, port = args.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise TesseraError(f"--rdzv-endpoint must be HOST:PORT with a port in 1..65535, got {args.rdzv_endpoint!r}")
    if args.rdzv_id is not None and not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", args.rdzv_id):
        raise TesseraError(f"--rdzv-id must be 1-128 letters, digits, '.', '_' or '-', got {args.rdzv_id!r}")


def child_flags(args) -> list[str]:
    """The recovery flags each rank gets."""
    flags = ["--hang-timeout", repr(args.hang_timeout), "--on-nonfinite", args.on_nonfinite,
             "--max-bad-steps", str(args.max_bad_steps)]
    flags += [f for f, on in (("--no-replan", args.no_replan), ("--sync-checkpoints", args.sync_checkpoints)) if on]
    return flags


def runtime_options(args, out: Path) -> dict:
    """TrainConfig fields from the recovery flags."""
    from ..runtime.resilience import ResilienceConfig
    from ..runtime.stragglers import StragglerConfig

    return dict(resilience=ResilienceConfig(args.hang_timeout, args.on_nonfinite, args.max_bad_steps),
                checkpoint_async=not args.sync_checkpoints, stragglers=StragglerConfig(replan=not args.no_replan),
                events_path=str(out / "events.jsonl"))


# --- the agent --------------------------------------------------------------------------------


def _agent_class():
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from ..runtime.resilience import NO_RESTART_CODES

    class _TesseraAgent(LocalElasticAgent):
        """The stock agent, but no restart for what a restart cannot fix, and a short grace."""

        status_dir: Path

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
                codes = {f.exitcode for f in result.failures.values()}
                attempt = getattr(self, "attempts", 0)
                if codes & set(NO_RESTART_CODES):
                    self._remaining_restarts = 0
                elif self._remaining_restarts > 0:
                    _say(f"{_failure_summary(result.failures, self.status_dir, attempt)}; restarting every rank from the "
                         f"latest valid checkpoint ({self._remaining_restarts - 1} restarts left after this one)")
            return result

        def _restart_workers(self, worker_group):
            # Every restart counts, also one for another node's failure (torchrun's count does not):
            # the ranks resume from a checkpoint whenever this is not the first attempt.
            self.attempts = getattr(self, "attempts", 0) + 1
            os.environ["TESSERA_ATTEMPT"] = str(self.attempts)
            return super()._restart_workers(worker_group)

        def _stop_workers(self, worker_group, *args, **kwargs):
            _kill_stopped(getattr(self, "_pcontext", None))
            try:
                self._shutdown(timeout=STOP_GRACE_S)
            except TypeError:  # another torch: the stock stop
                super()._stop_workers(worker_group, *args, **kwargs)

    return _TesseraAgent


def _kill_stopped(pcontext) -> None:
    """SIGKILL the ranks that are stopped (SIGSTOP, a debugger): they cannot act on SIGTERM, and
    waiting out the grace for them only delays the restart."""
    pids = pcontext.pids().values() if pcontext is not None and hasattr(pcontext, "pids") else ()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue
        if state in ("T", "t"):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _failure_summary(failures: dict, status_dir: Path, attempt: int | None = None) -> str:
    """One line: which ranks failed and why (their status files, else their exit codes)."""
    statuses = _statuses(status_dir, attempt)
    parts = []  # (order, text): ranks killed by a signal first (the cause), then what they left behind
    for rank, f in sorted(failures.items()):
        status = statuses.get(rank)
        if f.exitcode < 0:
            parts.append((0, f"rank {rank} was killed ({_signal_name(-f.exitcode)})"))
        elif status and status.get("kind") in ("hung", "crash"):
            parts.append((1 if status["kind"] == "hung" else 2, _first_sentence(status["message"])))
        else:
            parts.append((3, f"rank {rank} exited with code {f.exitcode}"))
    texts = [text for _, text in sorted(parts, key=lambda x: x[0])]
    return "; ".join(texts[:3]) + (f" (and {len(texts) - 3} more)" if len(texts) > 3 else "")


def _first_sentence(text: str, limit: int = 200) -> str:
    cut = text.find(". ")
    text = text if cut < 0 else text[:cut]
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _statuses(status_dir: Path, attempt: int | None = None) -> dict[int, dict]:
    """rank -> how it ended (`resilience.write_status`), of restart `attempt` (default: the last one seen)."""
    out = {}
    for path in sorted(status_dir.glob("rank-*.json")):
        try:
            record = json.loads(path.read_text())
            out[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if attempt is None and out:
        attempt = max(int(r.get("attempt", 0)) for r in out.values())
    return {rank: r for rank, r in out.items() if int(r.get("attempt", 0)) == attempt}


def _say(message: str) -> None:
    print(f"tessera train: {message}", file=sys.stderr, flush=True)


def _quiet_torch_elastic() -> None:
    """The agent's own log lines (and its tracebacks) give way to the launcher's one-line reports."""
    if os.environ.get("TESSERA_DEBUG"):
        return
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def launch(args, nproc: int, out: Path, child_argv: list[str]) -> int:
    """Run `python -m tessera <child_argv>` on `nproc` local ranks under the elastic agent (module
    docstring); returns the exit code for `tessera train`."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    status_dir = Path(tempfile.mkdtemp(prefix="tessera-status-"))
    os.environ["TESSERA_STATUS_DIR"] = str(status_dir)
    os.environ["TESSERA_AGENT_PID"] = str(os.getpid())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Each attempt's rank 0 hosts a fresh store: the agent's shared one keeps the previous attempt's
    # addresses across a restart (pytorch/pytorch#135712).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    single = args.nnodes == 1 and args.rdzv_endpoint is None
    run_id = args.rdzv_id or ("tessera-" + (uuid.uuid4().hex[:12] if single else
                                           hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:12]))
    params = RendezvousParameters(backend="c10d", endpoint="localhost:0" if single else args.rdzv_endpoint,
                                  run_id=run_id, min_nodes=args.nnodes, max_nodes=args.nnodes)
    spec = WorkerSpec(role="tessera", local_world_size=nproc, entrypoint=sys.executable,
                      args=("-m", "tessera", *child_argv), rdzv_handler=get_rendezvous_handler(params),
                      max_restarts=args.max_restarts, monitor_interval=0.5)
    agent = _agent_class()(spec=spec, logs_specs=DefaultLogsSpecs(log_dir=str(status_dir / "logs")),
                           start_method="spawn", exit_barrier_timeout=60)
    agent.status_dir = status_dir
    _quiet_torch_elastic()
    signal_name = None
    os.environ["TESSERA_ATTEMPT"] = "0"
    try:
        result = agent.run()
    except SignalException as e:
        signal_name, result = e.sigval, None
    except Exception as e:  # noqa: BLE001 - the rendezvous closed (another node gave up), timed out...
        if os.environ.get("TESSERA_DEBUG"):
            raise
        _say(f"error: the job's rendezvous failed ({type(e).__name__}: {_first_sentence(str(e)) or 'closed'}); "
             "another node may have stopped the job")
        shutil.rmtree(status_dir, ignore_errors=True)
        return 1
    finally:
        spec.rdzv_handler.shutdown()
    try:
        return _outcome(result, signal_name, status_dir, args.max_restarts)
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)


def _outcome(result, signal_name, status_dir: Path, max_restarts: int) -> int:
    statuses = _statuses(status_dir)
    kinds = {s.get("kind") for s in statuses.values()}
    for kind, code in (("input", 2), ("diverged", 3)):
        if kind in kinds:
            message = next(s["message"] for _, s in sorted(statuses.items()) if s.get("kind") == kind)
            print(f"tessera train: error: {message}", file=sys.stderr, flush=True)
            return code
    stopped = [s for s in statuses.values() if s.get("kind") == "stopped"]
    if stopped:
        _say(stopped[0]["message"] + "; continue with --resume auto")
        return 0
    if signal_name is not None:
        _say(f"stopped by {getattr(signal_name, 'name', signal_name)}")
        return 128 + int(signal_name)
    if result is not None and result.is_failed():
        _say(f"error: {_failure_summary(result.failures, status_dir)}; no restarts left "
             f"(--max-restarts {max_restarts})")
        return 1
    return 0
