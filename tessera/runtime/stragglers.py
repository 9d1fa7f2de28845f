"""Find the slowest rank, confirm it with a matmul probe, and re-plan around it (Malleus).

Every logged step each rank gets every rank's compute seconds (`steptime.py`, gathered with the
step's record). Over the last `window` logged steps, rank r's speed is

    v_r = m / (c_r / w_r),   m = the median of c_q / w_q over the faster half of the ranks

with c the compute seconds and w the rank's share of the step's FLOPs (`steptime.rank_shares`):
the time a unit of work takes on a typical fast rank over the time it takes on r (the faster
half, so that with two ranks the fast one is 1.0, as the cluster spec counts speeds). Against a
baseline (every rank at 1.0 at the start; after a switch, the speeds of the first window under
the new plan, since part of a step's compute does not scale with its rows), a rank whose speed
moves beyond `threshold` (below 0.8x or above 1.25x) for `patience` logged steps in a row makes
every rank run the same matmuls (`matmul_probe`, as Malleus profiles devices). The probe's rates,
relative to the faster half, are the device speeds: when they differ from what the plan assumes
(by more than 10% for some rank), rank 0 re-plans with them (`search.replan`: layers per stage and
sequences per replica, the strategies unchanged) and broadcasts the plan, and if it predicts a
step at least `min_gain` shorter than the current plan at those speeds, every rank switches to it
at the step boundary (`Trainer.switch_plan`). A device that recovers is seen the same way, and the
plan is re-cut back. Every probe and re-plan is an event in the
run's `events.jsonl` (what `tessera diagnose` shows as evidence).
"""
from __future__ import annotations

import json
import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .resilience import SlowDevice

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StragglerConfig:
    replan: bool = True
    threshold: float = 0.8  # below this fraction of the median speed: slow
    window: int = 3  # logged steps averaged per speed estimate
    patience: int = 2  # logged steps in a row before probing
    min_gain: float = 0.05  # predicted step reduction that makes a switch worth it
    cooldown: int = 5  # logged steps after a probe or switch before the next


def speeds_from_compute(compute_s: list[list[float]], shares: list[float]) -> list[float] | None:
    """Per-rank speed over several steps' per-rank compute seconds (module docstring)."""
    if not compute_s or any(c is None for step in compute_s for c in step):
        return None
    per_work = [sum(step[r] for step in compute_s) / shares[r] for r in range(len(shares))]
    if min(per_work) <= 0:
        return None
    fast_half = sorted(per_work)[:max(1, (len(per_work) + 1) // 2)]
    typical = statistics.median(fast_half)
    return [typical / x for x in per_work]


def probe_speeds(rates: list[float]) -> list[float]:
    """Matmul rates relative to the median of the faster half of the ranks."""
    typical = statistics.median(sorted(rates, reverse=True)[:max(1, (len(rates) + 1) // 2)])
    return [x / typical for x in rates]


def matmul_probe(device: torch.device, rank: int, step: int, size: int | None = None, repeats: int = 8) -> float:
    """FLOP/s of `repeats` square matmuls on this rank's device (CPU: per CPU second of the thread,
    so that ranks sharing cores compare their devices, not their share of the cores)."""
    size = size or (4096 if device.type == "cuda" else 256)
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    torch.mm(a, b)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            torch.mm(a, b)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.thread_time()
        for _ in range(repeats):
            torch.mm(a, b)
        seconds = time.thread_time() - t0
    extra = SlowDevice.from_env().extra_seconds(rank, step, seconds)  # the test-only slow device
    if extra:
        time.sleep(extra)
        seconds += extra
    return 2.0 * size**3 * repeats / max(seconds, 1e-9)


class StragglerMonitor:
    """Per-step straggler detection (`observe`) and what to do about it (module docstring)."""

    def __init__(self, config: StragglerConfig, world: int):
        self.config = config
        self.world = world
        self.recent: deque = deque(maxlen=config.window)
        self.suspect_steps = 0
        self.quiet_until = 0
        self.speeds: list[float] | None = None
        self.baseline: list[float] | None = [1.0] * world  # None: take the next window's speeds

    def observe(self, step: int, compute_s: list[float] | None, shares: list[float],
                planned: dict[int, float]) -> bool:
        """Record one logged step; True when the ranks should run the probe now (every rank gets
        the same inputs, so every rank answers the same)."""
        if compute_s is None or self.world < 2:
            return False
        self.recent.append(list(compute_s))
        if len(self.recent) < self.recent.maxlen or step < self.quiet_until:
            return False
        self.speeds = speeds_from_compute(list(self.recent), shares)
        if self.speeds is None:
            return False
        if self.baseline is None:
            self.baseline = self.speeds
            return False
        t = self.config.threshold
        if any(not t <= v / b <= 1 / t for v, b in zip(self.speeds, self.baseline)):
            self.suspect_steps += 1
        else:
            self.suspect_steps = 0
        return self.suspect_steps >= self.config.patience

    def confirm(self, step: int, probe_rates: list[float], planned: dict[int, float]) -> dict[int, float] | None:
        """The device speeds to re-plan with (the probe's, module docstring), or None when they
        are what the plan already assumes."""
        self.suspect_steps = 0
        self.quiet_until = step + self.config.cooldown
        probe = probe_speeds(probe_rates)
        if all(0.9 <= p / planned.get(r, 1.0) <= 1 / 0.9 for r, p in enumerate(probe)):
            return None
        return {r: round(p, 3) for r, p in enumerate(probe) if p < 0.9}

    def switched(self, step: int) -> None:
        self.recent.clear()
        self.baseline = None
        self.quiet_until = step + self.config.cooldown


def broadcast_json(obj, group=None, src: int = 0):
    """`obj` from rank `src` on every rank, as JSON bytes in a tensor (no pickle)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return obj
    mine = dist.get_rank() == src
    data = json.dumps(obj).encode() if mine else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if mine else torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return json.loads(bytes(buf.tolist()).decode()) if not mine else obj


def gather_floats(value: float, group=None) -> list[float]:
    """Every rank's `value` on every rank (a CPU all-gather on `group`)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [value]
    mine = torch.tensor([value], dtype=torch.float64)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [float(x) for x in out]
