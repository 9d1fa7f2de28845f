"""Runs that keep their own records: one directory per run, and what is written into it.

    runs/<name>/<run-id>/
        config.toml      the resolved config (every field; `tessera train --config` reruns it)
        plan.json        the plan it executes
        metrics.jsonl    one line per logged step: {"run_id", "step", "loss", ...}; evaluations as
                         {"run_id", "step", "eval_loss", "eval_perplexity", "eval_tokens"}
        checkpoints/     step-N/ (the latest `checkpoint.keep` of them, 3 by default)
        tensorboard/     when asked for and installed

The run id defaults to the start time (YYYYmmdd-HHMMSS). A resumed run (`--resume` of the run
directory, of its checkpoints or of one step-N in them) keeps its directory and id: its metrics
file continues, the lines after the checkpoint's step are dropped first (`MetricsFile`), so a step
appears once however often the run was interrupted. No torch import at module level.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import TesseraError

log = logging.getLogger(__name__)

CONFIG_FILE = "config.toml"
PLAN_FILE = "plan.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS = "checkpoints"


def new_run_id(now: float | None = None) -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(now))


def _safe(text: str) -> str:
    """A name usable as one path component (a model given as a path becomes its last part)."""
    text = Path(text.rstrip("/")).name if "/" in text else text
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text) or "run"


def run_dir_of(path: str | Path) -> Path | None:
    """The run directory a resume path belongs to: the run directory itself (it holds
    config.toml), its checkpoints folder, or one step-N in that; None for a checkpoint elsewhere."""
    p = Path(path)
    if (p / CONFIG_FILE).is_file():
        return p
    for folder in (p, p.parent):
        if folder.name == CHECKPOINTS and (folder.parent / CONFIG_FILE).is_file():
            return folder.parent
    return None


def checkpoint_source(resume: str, checkpoint_dir: str) -> str:
    """What the trainer loads from: a run directory resumes from its checkpoints."""
    return checkpoint_dir if (Path(resume) / CONFIG_FILE).is_file() else resume


@dataclass(frozen=True)
class RunPaths:
    """Where one run's records go."""

    dir: Path
    run_id: str
    checkpoints: Path

    @property
    def config(self) -> Path:
        return self.dir / CONFIG_FILE

    @property
    def plan(self) -> Path:
        return self.dir / PLAN_FILE

    @property
    def metrics(self) -> Path:
        return self.dir / METRICS_FILE

    @property
    def tensorboard(self) -> Path:
        return self.dir / "tensorboard"


def resolve_run(config, model_name: str, now: float | None = None):
    """(config with run.name, run.id, run.out, checkpoint.dir filled in, RunPaths).

    A resume of a run directory continues it (same directory, same id); otherwise `run.out` is
    filled with {name} and {id} and must not already hold a run's metrics."""
    run, ckpt = config.run, config.checkpoint
    resumed = run_dir_of(ckpt.resume) if ckpt.resume else None
    name = run.name or _safe(model_name)
    if resumed is not None and "{" in run.out:  # continue the run where it lives
        from ..config import load_config

        previous = load_config(resumed / CONFIG_FILE)
        run_id = run.id or previous.run.id or resumed.name
        out = resumed
        checkpoints = Path(ckpt.dir or previous.checkpoint.dir or resumed / CHECKPOINTS)
    else:
        run_id = run.id or new_run_id(now)
        try:
            out = Path(run.out.format(name=name, id=run_id))
        except (KeyError, IndexError, ValueError):
            raise TesseraError(f"run.out '{run.out}' may use {{name}} and {{id}} only") from None
        if run.id is None and "{id}" in run.out:  # a fresh default id: never another run's directory
            n = 1
            while out.exists():
                n += 1
                out = Path(run.out.format(name=name, id=f"{run_id}-{n}"))
            if n > 1:
                run_id = f"{run_id}-{n}"
        checkpoints = Path(ckpt.dir) if ckpt.dir else out / CHECKPOINTS
        metrics = out / METRICS_FILE
        continuing = ckpt.resume and resumed == out
        if metrics.is_file() and metrics.stat().st_size and not continuing:
            raise TesseraError(f"run directory {out} already holds a run's metrics; continue it with "
                               f"--resume {out}, or give another --out or --run-id")
    config = config.replace(**{"run.name": name, "run.id": run_id, "run.out": str(out),
                               "checkpoint.dir": str(checkpoints)})
    return config, RunPaths(dir=out, run_id=run_id, checkpoints=checkpoints)


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class MetricsFile:
    """The run's metrics.jsonl: every line carries the run id; `truncate_after(step)` drops the
    lines of steps after a resumed checkpoint's, so that the continued file has each step once."""

    def __init__(self, path: str | Path, run_id: str | None):
        self.path, self.run_id = Path(path), run_id
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = self.path.open("a")

    def write(self, fields: dict) -> None:
        line = {"run_id": self.run_id, **fields} if self.run_id is not None else fields
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()

    def truncate_after(self, step: int) -> int:
        """Drop the lines of steps > `step`; returns how many were dropped."""
        self.file.close()
        kept, dropped = [], 0
        for line in self.path.read_text().splitlines():
            try:
                later = int(json.loads(line).get("step", 0)) > step
            except (ValueError, AttributeError):
                later = False  # a torn last line from a crash: drop it too
                dropped += 1
                continue
            if later:
                dropped += 1
            else:
                kept.append(line)
        if dropped:
            write_text_atomic(self.path, "".join(f"{line}\n" for line in kept))
        self.file = self.path.open("a")
        return dropped

    def close(self) -> None:
        self.file.close()


def perplexity(loss: float) -> float:
    """exp(mean cross-entropy in nats), inf past exp's range."""
    return math.exp(loss) if loss < 700 else float("inf")


def agree_across_ranks(value):
    """Rank 0's `value` on every rank of a torchrun job (each rank passes its own; one rank: itself).

    Starts the default process group if torchrun started several ranks and none exists yet (the
    trainer then uses it), with the backend the trainer would choose."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or "RANK" not in os.environ:
        return value
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
