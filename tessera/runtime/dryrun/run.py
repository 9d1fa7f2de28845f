"""`dry_run(plan, ranks)`: each sampled rank measured in a process of its own, beside the prediction.

Every sampled rank runs in a forked child process (`measure.measure_rank`): a fresh fake process
group, and no DTensor or device-mesh caches shared between ranks (their groups would belong to
the previous rank's process group); the child's peak RSS is that rank's cost on this machine.
The prediction is the cost model's (`cost.evaluate.stage_memory` for the rank's pipeline stage,
with `rank_states` giving the rank's own pieces of the vocabulary tables,
`cost.collectives.step_collectives` for its collectives).
"""
from __future__ import annotations

import logging
import multiprocessing
import traceback
from dataclasses import dataclass, field

from ...cost.collectives import step_collectives
from ...cost.evaluate import rank_states, stage_memory
from ...errors import TesseraError
from ...plan import Plan
from .compare import RankComparison, compare_collectives, compare_state
from .measure import RankMeasurement

log = logging.getLogger(__name__)

# Real tensors when the whole model in fp32 (the trainer builds it whole, then shards it) and
# the rank's states fit in this many bytes; fake tensors otherwise.
MATERIALIZE_LIMIT_BYTES = 1 << 30


@dataclass
class RankResult:
    comparison: RankComparison
    measurement: RankMeasurement


@dataclass
class DryRun:
    plan: Plan
    ranks: list[RankResult] = field(default_factory=list)

    @property
    def max_state_error(self) -> float:
        return max((abs(r.comparison.state_error) for r in self.ranks), default=0.0)

    @property
    def count_mismatches(self) -> int:
        return sum(r.comparison.count_mismatches for r in self.ranks)

    def not_fitting(self) -> list[str]:
        """One line per sampled rank whose memory exceeds the device's."""
        gib = 2**30
        return [f"rank {r.comparison.rank} (pipeline stage {r.comparison.pp_rank}) needs "
                f"{r.comparison.memory_needed / gib:.1f} GiB (measured model states + predicted activations "
                f"and buffers), the device has {r.comparison.device_memory / gib:.1f} GiB"
                for r in self.ranks if not r.comparison.fits]


def default_ranks(plan: Plan) -> list[int]:
    """The first rank of the first pipeline stage and the last rank of the last."""
    return sorted({0, plan.world_size - 1})


def parse_ranks(text: str, plan: Plan) -> list[int]:
    """`--ranks first,last,5`: rank numbers or the words first / last."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if item == "first":
            out.append(0)
        elif item == "last":
            out.append(plan.world_size - 1)
        else:
            try:
                rank = int(item)
            except ValueError:
                raise TesseraError(f"--ranks: '{item}' is not a rank number (or first / last)") from None
            if not 0 <= rank < plan.world_size:
                raise TesseraError(f"--ranks: rank {rank} is outside the plan's world of {plan.world_size} ranks")
            out.append(rank)
    if not out:
        raise TesseraError("--ranks: give at least one rank")
    return sorted(set(out))


def should_materialize(plan: Plan) -> bool:
    return plan.model.num_params * 4 * 2 <= MATERIALIZE_LIMIT_BYTES


def _child(plan: Plan, rank: int, materialize: bool, step: bool, conn) -> None:
    try:
        from .measure import measure_rank

        conn.send(("ok", measure_rank(plan, rank, materialize, step)))
    except TesseraError as e:
        conn.send(("refused", str(e)))
    except BaseException as e:  # noqa: BLE001 (reported to the parent with its traceback)
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def measure_in_child(plan: Plan, rank: int, materialize: bool, step: bool = True) -> RankMeasurement:
    """`measure_rank` in a child process (a fresh fake world per rank). Children fork from a
    forkserver that imported the runtime once and runs no thread: forking this process instead
    can deadlock a child on a lock that one of its threads (a process group's, a thread pool's)
    held at the fork."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(plan, rank, materialize, step, child))
    proc.start()
    child.close()
    try:
        status, value = parent.recv()
    except EOFError:
        proc.join()
        raise TesseraError(f"the dry run of rank {rank} died (exit code {proc.exitcode})") from None
    proc.join()
    if status == "refused":
        raise TesseraError(value)
    if status == "error":
        raise RuntimeError(f"dry run of rank {rank} failed: {value}")
    return value


def compare_rank(plan: Plan, m: RankMeasurement, memory=None) -> RankComparison:
    memory = memory if memory is not None else stage_memory(plan)
    predicted = memory[m.pp_rank]
    state = compare_state(rank_states(plan, m.rank, memory), m.device, m.host)
    needed = state[-1].measured + predicted.activations + predicted.buffers
    return RankComparison(rank=m.rank, pp_rank=m.pp_rank, mode=m.mode, state=state,
                          collectives=compare_collectives(step_collectives(plan, m.rank), m.collectives),
                          memory_needed=needed, device_memory=plan.cluster.device.memory_bytes,
                          notes=list(m.notes))


def dry_run(plan: Plan, ranks: list[int] | None = None, materialize: bool | None = None,
            in_process: bool = False, step: bool = True) -> DryRun:
    """Measure `ranks` (default: first and last) of the plan at its world size, against the prediction.

    `materialize`: real tensors (True), fake ones (False), or by model size (None).
    `in_process`: measure in this process (one rank only: its fake process group and caches stay).
    `step=False`: build only (parameters measured, no step)."""
    from ..parallelize import check_plan_supported

    check_plan_supported(plan, plan.world_size, pipeline_available=True)  # refused before any process starts
    ranks = ranks if ranks is not None else default_ranks(plan)
    materialize = should_materialize(plan) if materialize is None else materialize
    memory = stage_memory(plan)
    result = DryRun(plan=plan)
    for rank in ranks:
        if in_process:
            from .measure import measure_rank

            m = measure_rank(plan, rank, materialize, step)
        else:
            m = measure_in_child(plan, rank, materialize, step)
        log.info("rank %d: %s, built in %.1f s, stepped in %.1f s, peak RSS %.2f GiB", rank, m.mode,
                 m.build_s, m.step_s, m.peak_rss_bytes / 2**30)
        result.ranks.append(RankResult(compare_rank(plan, m, memory), m))
    return result
