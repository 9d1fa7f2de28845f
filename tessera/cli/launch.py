"""Launching the ranks of `tessera train --nproc N`: torchrun's elastic agent, run in this process.

    tessera train --nproc 4 --checkpoint-every 50                            # one node, 3 restarts
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


def runtime_options(config, out: Path) -> dict:
    """TrainConfig fields of the config's [recovery] section and checkpoint mode."""
    from ..runtime.resilience import ResilienceConfig
    from ..runtime.stragglers import StragglerConfig

    r = config.recovery
    return dict(resilience=ResilienceConfig(r.hang_timeout, r.on_nonfinite, r.max_bad_steps),
                checkpoint_async=config.checkpoint.asynchronous, stragglers=StragglerConfig(replan=r.replan),
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
            # Once a rank has exited, the stock monitor stops the others with SIGTERM and waits 30 s
            # before SIGKILL: a stopped rank would hold the restart for all of that.
            _kill_stopped(getattr(self, "_pcontext", None), only_after_an_exit=True)
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

        def _start_workers(self, worker_group):
            result = super()._start_workers(worker_group)
            context = getattr(self, "_pcontext", None)
            if context is not None and hasattr(context, "close"):  # torchrun waits 30 s for SIGTERM
                stock_close = context.close

                def close(death_sig=None, timeout=STOP_GRACE_S):
                    return stock_close(death_sig, min(timeout, STOP_GRACE_S))

                context.close = close
            return result

        def _stop_workers(self, worker_group, *args, **kwargs):
            _kill_stopped(getattr(self, "_pcontext", None))
            try:
                self._shutdown(timeout=STOP_GRACE_S)
            except TypeError:  # another torch: the stock stop
                super()._stop_workers(worker_group, *args, **kwargs)

    return _TesseraAgent


def _process_state(pid: int) -> str:
    """The kernel's one-letter state of `pid` (Linux /proc: R, S, D, T stopped, Z exited...); "X"
    when it is gone or unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return "X"


def _kill_stopped(pcontext, only_after_an_exit: bool = False) -> None:
    """SIGKILL the ranks that are stopped (SIGSTOP, a debugger): they cannot act on SIGTERM, and
    waiting out the grace for them only delays the restart. `only_after_an_exit`: only once some
    rank of the job has exited (the job is going down: a rank stopped for a while on purpose
    alone is left be)."""
    pids = list(pcontext.pids().values()) if pcontext is not None and hasattr(pcontext, "pids") else []
    states = {pid: _process_state(pid) for pid in pids}
    if only_after_an_exit and not any(state in ("Z", "X") for state in states.values()):
        return
    for pid, state in states.items():
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


def launch(config, nproc: int, out: Path, child_argv: list[str]) -> int:
    """Run `python -m tessera <child_argv>` on `nproc` local ranks under the elastic agent (module
    docstring), with the config's nodes, rendezvous and restart budget; returns the exit code for
    `tessera train`."""
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
    p, max_restarts = config.plan, config.recovery.max_restarts
    single = p.nnodes == 1 and p.rdzv_endpoint is None
    # Every node must name the same job: the endpoint is what they share (each node's run
    # directory may differ, e.g. a run id made of its own start time).
    run_id = p.rdzv_id or ("tessera-" + (uuid.uuid4().hex[:12] if single else
                                         hashlib.sha1(p.rdzv_endpoint.encode()).hexdigest()[:12]))
    params = RendezvousParameters(backend="c10d", endpoint="localhost:0" if single else p.rdzv_endpoint,
                                  run_id=run_id, min_nodes=p.nnodes, max_nodes=p.nnodes)
    spec = WorkerSpec(role="tessera", local_world_size=nproc, entrypoint=sys.executable,
                      args=("-m", "tessera", *child_argv), rdzv_handler=get_rendezvous_handler(params),
                      max_restarts=max_restarts, monitor_interval=0.5)
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
        return _outcome(result, signal_name, status_dir, max_restarts, out)
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)


def _outcome(result, signal_name, status_dir: Path, max_restarts: int, out: Path) -> int:
    statuses = _statuses(status_dir)
    kinds = {s.get("kind") for s in statuses.values()}
    for kind, code in (("input", 2), ("diverged", 3)):
        if kind in kinds:
            message = next(s["message"] for _, s in sorted(statuses.items()) if s.get("kind") == kind)
            print(f"tessera train: error: {message}", file=sys.stderr, flush=True)
            return code
    stopped = [s for s in statuses.values() if s.get("kind") == "stopped"]
    if stopped:
        _say(stopped[0]["message"] + f"; continue with: tessera train --resume {out}")
        return 0
    if signal_name is not None:
        _say(f"stopped by {getattr(signal_name, 'name', signal_name)}")
        return 128 + int(signal_name)
    if result is not None and result.is_failed():
        _say(f"error: {_failure_summary(result.failures, status_dir)}; no restarts left "
             f"(--max-restarts {max_restarts})")
        return 1
    return 0
