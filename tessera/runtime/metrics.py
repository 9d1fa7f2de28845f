"""Per-step training metrics: throughput, MFU, memory, and the plan's prediction beside them.

MFU (model FLOPs utilisation, PaLM appendix B): achieved model FLOP/s over the peak of all ranks,

    MFU = 3 * F(s) * tokens_per_s / (world * peak)

with F(s) the forward FLOPs per token at sequence length s (`ModelSpec.flops_per_token`; training
is forward + backward = 3x forward, recompute not counted) and `peak` the device's dense peak for
the dtype that actually runs (fp32 on CPU).
"""
from __future__ import annotations

import logging
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..plan import Plan

log = logging.getLogger(__name__)


@dataclass
class StepRecord:
    step: int
    loss: float
    lr: float
    grad_norm: float
    step_time_s: float
    tokens_per_s: float
    mfu: float | None
    peak_memory_bytes: list[float] = field(default_factory=list)  # per rank
    predicted_step_time_s: float | None = None
    # Adaptive runs: the sequence-parallel group sizes of each micro-batch of the step plan.
    sp_groups: list[list[int]] | None = None
    # MoE models: token-slots per expert of each MoE block, all-to-all bytes and router losses per
    # step (runtime/expert_parallel.py `moe_step_stats`).
    moe: dict | None = None
    # Predicted compute of the busiest and of the mean data-parallel rank (balanced loaders) or
    # sequence-parallel unit (adaptive runs) in the step, seconds.
    rank_time_max_s: float | None = None
    rank_time_mean_s: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def peak_memory_bytes(device: torch.device) -> float:
    """Peak bytes this process used: accelerator allocations, or the resident set on CPU."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(rss if sys.platform == "darwin" else rss * 1024)


def train_flops_per_token(plan: Plan) -> float:
    return 3.0 * plan.model.flops_per_token(plan.workload.seq_len)


def model_flops_utilisation(plan: Plan, tokens_per_s: float, world_size: int, dtype: str) -> float | None:
    peak = plan.cluster.device.peak_flops.get(dtype)
    if not peak:
        return None
    return train_flops_per_token(plan) * tokens_per_s / (world_size * peak)


@dataclass
class PendingRecord:
    """A logged step whose figures may still be on their way (`Trainer.pending_record`)."""

    step: int
    loss: torch.Tensor | float
    grad_norm: torch.Tensor | float
    lr: float
    span: StepSpan
    peaks: list[torch.Tensor]
    work: object  # the peak-memory all-gather in flight
    step_plan: object = None  # an adaptive run's step plan
    moe: dict | None = None
    rank_times_s: list[float] | None = None  # predicted compute per rank (balanced loader)


class StepSpan:
    """One step's duration: wall seconds on CPU; on CUDA the time between CUDA events at the end
    of the previous step and of this one (the device's timeline, host stalls included), read
    once the device has passed the second."""

    def __init__(self, seconds: float | None = None, events: tuple | None = None):
        self._seconds, self.events = seconds, events

    def seconds(self) -> float:
        if self._seconds is None:
            start, end = self.events
            end.synchronize()
            self._seconds = start.elapsed_time(end) / 1e3
        return self._seconds


class StepClock:
    """`start()` before a step, `stop()` after it is queued: its `StepSpan`, without a host wait."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.last = None  # CUDA: the event at the end of the previous step

    def restart(self) -> None:
        """Forget the previous step's end: the next step is timed from its own start."""
        self.last = None

    def start(self) -> None:
        if self.cuda:
            if self.last is None:
                self.last = torch.cuda.Event(enable_timing=True)
                self.last.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> StepSpan:
        if not self.cuda:
            return StepSpan(seconds=time.perf_counter() - self.t0)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        span, self.last = StepSpan(events=(self.last, end)), end
        return span


class MetricsWriter:
    """The run's records of each logged step and evaluation: one JSON line each, carrying the run
    id (`runs.MetricsFile`), TensorBoard scalars and Weights & Biases, each only when asked for and
    installed."""

    def __init__(self, path: str | Path | None, tensorboard_dir: str | Path | None = None,
                 run_id: str | None = None, wandb: dict | None = None):
        from .runs import MetricsFile

        self.file = MetricsFile(path, run_id) if path is not None else None
        self.tb = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(tensorboard_dir))
            except ImportError:
                log.info("tensorboard is not installed: metrics go to the JSONL file only")
        self.wandb = None
        if wandb is not None:
            try:
                import wandb as wandb_module
            except ImportError:
                log.info("wandb is not installed: metrics go to the JSONL file only")
            else:
                # `id` + resume="allow": a resumed run continues the same W&B run.
                self.wandb = wandb_module.init(resume="allow", **wandb)

    def truncate_after(self, step: int) -> int:
        """A resumed run: drop the JSONL lines of steps after `step` (see `runs.MetricsFile`)."""
        return self.file.truncate_after(step) if self.file is not None else 0

    def write(self, record: StepRecord) -> None:
        if self.file is not None:
            self.file.write(record.to_dict())
        scalars = {f"train/{key}": getattr(record, key)
                   for key in ("loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "mfu")
                   if getattr(record, key) is not None}
        if record.peak_memory_bytes:
            scalars["train/peak_memory_gib"] = max(record.peak_memory_bytes) / 2**30
        self._scalars(scalars, record.step)

    def write_eval(self, step: int, loss: float, perplexity: float, tokens: int) -> None:
        if self.file is not None:
            self.file.write({"step": step, "eval_loss": loss, "eval_perplexity": perplexity, "eval_tokens": tokens})
        self._scalars({"eval/loss": loss, "eval/perplexity": perplexity}, step)

    def _scalars(self, scalars: dict, step: int) -> None:
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
