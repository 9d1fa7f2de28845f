"""Where a step's time goes on one rank: data loading, compute, communication, pipeline bubble.

Measured on every rank, every step (`StepTimer`), gathered to every rank with the step's record:

    data_s     wall seconds in the data loader
    bubble_s   wall seconds waiting for pipeline sends and receives (the p2p waits of
               `torch.distributed.pipelining`'s schedules): the rank has nothing to run
    compute_s  on a CPU device, the CPU seconds the rank's threads spent in the step (the compute
               kernels: a wait in a collective or a receive takes no CPU time); the main thread's
               alone with one intra-op thread (torchrun's default), the process's otherwise
               (gloo's own reductions then count as compute). On CUDA the kernels run on the
               device and their time is not read per step: None.
    comm_s     the rest: wall - data - bubble - compute, the time spent waiting in collectives,
               which includes waiting for a slower rank to arrive (and, on a CPU shared by more
               ranks than cores, for a core). None where compute_s is.

A straggler shows as high compute on its rank and high communication on all the others, whose
collectives wait for it (`stragglers.py` reads exactly that).

MFU of a rank: 3 F(s) x (tokens of its data-parallel replica / ranks of the replica) / (step wall
x peak): the model FLOPs it did, over what its device could have done in the step.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..plan import Plan
from .resilience import SlowDevice

_p2p_wait_s = 0.0  # accumulated by the wrapped pipeline wait below
_hooked = False


def hook_pipeline_waits() -> bool:
    """Time the pipeline schedules' p2p waits (once per process). Returns whether it could."""
    global _hooked
    if _hooked:
        return True
    try:
        from torch.distributed.pipelining import schedules
    except ImportError:
        return False
    original = getattr(schedules, "_wait_batch_p2p", None)
    if original is None:  # another torch: the bubble is counted as communication
        return False

    def timed_wait(*args, **kwargs):
        global _p2p_wait_s
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            _p2p_wait_s += time.perf_counter() - t0

    schedules._wait_batch_p2p = timed_wait
    _hooked = True
    return True


@dataclass
class StepTimes:
    wall_s: float
    data_s: float
    compute_s: float | None
    comm_s: float | None
    bubble_s: float


class StepTimer:
    """`start()` before the batch is fetched, `data()` around the fetch, `compute_starts(step)`
    before the forward, `stop(step)` when the step is done. The test-only slow device
    (`resilience.SlowDevice`) sleeps in `compute_starts`, before the step's collectives, for
    (factor - 1) x the previous step's compute, as a slower device would take longer to reach
    them; the sleep counts as compute."""

    def __init__(self, device: torch.device, rank: int):
        self.cpu = device.type == "cpu"
        self.rank = rank
        self.slow = SlowDevice.from_env()
        self.last: StepTimes | None = None
        self.last_compute = 0.0  # the previous step's compute, without the simulated slowness
        self.slept = 0.0

    def _cpu_clock(self) -> float:
        return time.thread_time() if torch.get_num_threads() == 1 else time.process_time()

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self.c0 = self._cpu_clock()
        self.data_wall = self.data_cpu = 0.0
        self.p2p0 = _p2p_wait_s
        self.slept = 0.0

    def compute_starts(self, step: int) -> None:
        """`step`: the step about to run (1-based)."""
        extra = self.slow.extra_seconds(self.rank, step, self.last_compute)
        if extra:
            time.sleep(extra)  # a slower device: the same work takes longer
            self.slept = extra

    @contextmanager
    def data(self):
        t0, c0 = time.perf_counter(), self._cpu_clock()
        try:
            yield
        finally:
            self.data_wall += time.perf_counter() - t0
            self.data_cpu += self._cpu_clock() - c0

    def stop(self, step: int) -> StepTimes:
        compute = None
        if self.cpu:
            self.last_compute = max(0.0, self._cpu_clock() - self.c0 - self.data_cpu)
            compute = self.last_compute + self.slept
        wall = time.perf_counter() - self.t0
        bubble = _p2p_wait_s - self.p2p0
        comm = None if compute is None else max(0.0, wall - self.data_wall - bubble - compute)
        self.last = StepTimes(wall, self.data_wall, compute, comm, bubble)
        return self.last


def rank_shares(plan: Plan, world: int) -> list[float]:
    """Each rank's share of the step's model FLOPs (they sum to 1): its replica's share of the
    global batch, split over the replica's ranks (pipeline stages count as equal parts)."""
    dp = plan.dp_of_batch
    per_replica = plan.stage_size // dp
    shares = plan.replica_rows()
    out = []
    for rank in range(world):
        replica = (rank % plan.stage_size) // per_replica
        out.append(shares[replica] / plan.workload.global_batch / (per_replica * plan.pipeline.degree))
    return out


def rank_mfu(plan: Plan, world: int, wall_s: float, peak_flops: float | None) -> list[float] | None:
    """Per-rank MFU of one step (module docstring)."""
    if not peak_flops or wall_s <= 0:
        return None
    flops = 3.0 * plan.model.flops_per_token(plan.workload.seq_len) * plan.workload.tokens_per_step
    return [flops * s / (wall_s * peak_flops) for s in rank_shares(plan, world)]
