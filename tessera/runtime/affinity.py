"""Pin each local rank to its own share of the host's cores: `TESSERA_PIN_CPU=1`.

With more ranks than cores (CPU runs on a small machine), the OS scheduler shares the cores
unevenly from one moment to the next: within one measured 4-rank step on 2 cores, one rank's
forward took 66 ms and another's 477 ms, and every collective waits for the slowest. Pinned,
ranks sharing a core get equal turns (all four forwards 211-230 ms), so timings repeat from step
to step — what a profile and the runs it predicts must share — at some cost in throughput (the
scheduler can no longer move a rank away from other work; 10% slower steps in that test). Off
by default; `benchmarks/cost_model_fidelity.py` turns it on.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

ENV = "TESSERA_PIN_CPU"
_host_cores: set[int] | None = None  # what this process could use before `pin_cpu_rank`


def host_cores() -> int:
    """How many cores this process's ranks share: those it could use before it was pinned."""
    if _host_cores is not None:
        return len(_host_cores)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def core_share(local_rank: int, local_world: int, cores: Sequence[int]) -> set[int]:
    """The cores of `local_rank` of `local_world` ranks on a host with `cores`: an equal
    contiguous block each when there are enough, else one core, round robin."""
    cores = sorted(cores)
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local rank {local_rank} is not in 0..{local_world - 1}")
    if not cores:
        raise ValueError("no cores to share")
    per = len(cores) // local_world
    if per == 0:
        return {cores[local_rank % len(cores)]}
    return set(cores[local_rank * per:(local_rank + 1) * per])


def pin_cpu_rank(environ: Mapping[str, str] = os.environ) -> set[int] | None:
    """Pin this process to `core_share` of the cores it may use, when `TESSERA_PIN_CPU=1` and it
    runs under torchrun (LOCAL_RANK set); returns the cores, or None when it did nothing."""
    value = environ.get(ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 1 (pin each rank to its cores) or 0, got '{value}'")
    if value == "0" or "LOCAL_RANK" not in environ or not hasattr(os, "sched_setaffinity"):
        return None
    global _host_cores
    if _host_cores is None:
        _host_cores = set(os.sched_getaffinity(0))
    share = core_share(int(environ["LOCAL_RANK"]), int(environ.get("LOCAL_WORLD_SIZE", "1")), list(_host_cores))
    os.sched_setaffinity(0, share)
    return share
