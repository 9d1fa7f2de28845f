"""Devices of unequal speed and uneven data shares: what each data-parallel replica runs at.

A plan's ranks form `dp` replicas per pipeline stage (pp outermost, then dp: replica j of pipeline
rank r is the block of n/dp consecutive ranks starting at r*n + j*n/dp, with n = world/pp). With
`ClusterSpec.device_speeds` and `Plan.batch_shares`, replica j of pipeline rank r runs

    F'(r, j) = rho_j * (F + (1/v_rj - 1) * C_F)        (likewise B with C_B, W with W)

where F is a chunk's forward time per micro-batch at the plan's nominal share, C_F its compute
part, rho_j = rows_j / (G / dp) the replica's share of the batch over the nominal, and v_rj the
speed of the block's slowest device (a tensor-parallel group waits for its slowest member):
compute runs 1/v times as long, and both compute and the activation traffic scale with the rows.
Each replica's pipeline is simulated with its own chunk times; the step is the slowest replica's
makespan plus the largest tail (gradient sync and optimizer update, the update part slowed by
1/v of the pipeline rank's slowest device), since the replicas synchronise gradients at the end.
Replicas with the same (rho, speeds) are simulated once.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..plan import Plan


@dataclass(frozen=True)
class ReplicaGroup:
    rows_ratio: float  # rho: the replica's rows over the nominal share
    speeds: tuple[float, ...]  # per pipeline rank: the slowest device of the replica's block
    count: int  # replicas with these factors


def is_uniform(plan: Plan) -> bool:
    return not plan.batch_shares and not plan.cluster.device_speeds


def block_speed(plan: Plan, pp_rank: int, replica: int) -> float:
    """Speed of the slowest device of replica `replica` on pipeline rank `pp_rank`."""
    n, dp = plan.stage_size, plan.dp_of_batch
    width = n // dp
    first = pp_rank * n + replica * width
    inside = [v for r, v in plan.cluster.device_speeds.items() if first <= r < first + width]
    return min(inside + ([1.0] if len(inside) < width else []))


def replica_groups(plan: Plan) -> list[ReplicaGroup]:
    """The distinct (rows ratio, per-stage speeds) of the plan's replicas, with their counts."""
    dp, pp = plan.dp_of_batch, plan.pipeline.degree
    nominal = plan.workload.global_batch / dp
    rows = plan.replica_rows()
    slow = {}
    if plan.cluster.device_speeds:  # only replicas holding a listed device can be slower
        n, width = plan.stage_size, plan.stage_size // dp
        for rank in plan.cluster.device_speeds:
            slow.setdefault((rank % n) // width, None)
    groups: dict[tuple, int] = {}
    for j in range(dp):
        speeds = tuple(block_speed(plan, r, j) for r in range(pp)) if j in slow else (1.0,) * pp
        key = (rows[j] / nominal, speeds)
        groups[key] = groups.get(key, 0) + 1
    return [ReplicaGroup(ratio, speeds, count) for (ratio, speeds), count in groups.items()]


def pipeline_rank_speeds(plan: Plan) -> list[float]:
    """Per pipeline rank, its slowest device (what the once-per-step update waits for)."""
    out = [1.0] * plan.pipeline.degree
    for rank, v in plan.cluster.device_speeds.items():
        r = rank // plan.stage_size
        out[r] = min(out[r], v)
    return out
