"""What a run's per-rank step times say: where each rank's time went, and which rank is slowest.

Reads the run directory's `metrics.jsonl` (one record per logged step, with every rank's data,
compute, communication and bubble seconds and MFU: runtime/steptime.py) and `events.jsonl`
(restarts, non-finite steps, probes, re-plans). No torch.

The slowest rank: per step, each rank's compute seconds per unit of work (its share of the step's
FLOPs, proportional to its MFU in the record) over a typical fast rank's (the median of the faster
half); the rank with the largest
median of that ratio over the steps after the first, if it is above `threshold` (1.25), with the
steps where it was, what the others spent waiting meanwhile, and the matmul probes of the run
(`runtime/stragglers.py`) as evidence.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import TesseraError


@dataclass
class RankSummary:
    rank: int
    compute_s: float | None
    comm_s: float | None
    data_s: float
    bubble_s: float
    mfu: float | None
    slowness: float | None  # median over steps of its compute per unit work / a typical fast rank's


@dataclass
class Diagnosis:
    steps: int
    world: int
    ranks: list[RankSummary]
    slowest: int | None
    evidence: list[str] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)


def read_run(run_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """(step records, events) of a run directory; refused in one line when there are no records."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl" if run_dir.is_dir() else run_dir
    if not metrics.is_file():
        raise TesseraError(f"{run_dir} has no metrics.jsonl (give the run directory of `tessera train --out`)")
    records, events = [], []
    for path, out in ((metrics, records), (metrics.parent / "events.jsonl", events)):
        if not path.is_file():
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except ValueError:
                raise TesseraError(f"{path} line {n} is not JSON") from None
            if not isinstance(item, dict):
                raise TesseraError(f"{path} line {n} is not a JSON object")
            out.append(item)
    records = [r for r in records if isinstance(r.get("step"), int)]
    if not records:
        raise TesseraError(f"{metrics} holds no step records")
    return records, events


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _per_rank(records: list[dict], key: str, world: int) -> list[list[float]]:
    out = [[] for _ in range(world)]
    for r in records:
        values = r.get(key)
        if isinstance(values, list) and len(values) == world:
            for i, v in enumerate(values):
                if isinstance(v, (int, float)):
                    out[i].append(float(v))
    return out


def slowness(record: dict) -> list[float] | None:
    """Each rank's compute per unit of work over a typical fast rank's, in one step."""
    compute, mfu = record.get("compute_s"), record.get("rank_mfu")
    if not isinstance(compute, list) or not compute or any(not isinstance(c, (int, float)) for c in compute):
        return None
    work = mfu if isinstance(mfu, list) and len(mfu) == len(compute) and all(m and m > 0 for m in mfu) \
        else [1.0] * len(compute)
    per_work = [c / w for c, w in zip(compute, work)]
    typical = statistics.median(sorted(per_work)[:max(1, (len(per_work) + 1) // 2)])
    return [x / typical if typical > 0 else 1.0 for x in per_work]


def diagnose(records: list[dict], events: list[dict], threshold: float = 1.25) -> Diagnosis:
    world = max(len(r.get("peak_memory_bytes") or [0]) for r in records)
    steady = [r for r in records if r["step"] > 1] or records
    columns = {k: _per_rank(steady, k, world) for k in ("compute_s", "comm_s", "data_s", "bubble_s", "rank_mfu")}
    ratios = [s for r in steady if (s := slowness(r)) is not None and len(s) == world]
    per_rank_ratio = [statistics.median(x[i] for x in ratios) if ratios else None for i in range(world)]
    ranks = [RankSummary(i, _mean(columns["compute_s"][i]), _mean(columns["comm_s"][i]),
                         _mean(columns["data_s"][i]) or 0.0, _mean(columns["bubble_s"][i]) or 0.0,
                         _mean(columns["rank_mfu"][i]), per_rank_ratio[i]) for i in range(world)]
    slowest, evidence = None, []
    if ratios and world > 1:
        worst = max(range(world), key=lambda i: (per_rank_ratio[i], statistics.fmean(x[i] for x in ratios)))
        if per_rank_ratio[worst] <= threshold:  # slow in part of the run: the rank slow in the most steps
            worst = max(range(world), key=lambda i: (sum(x[i] > threshold for x in ratios),
                                                     statistics.fmean(x[i] for x in ratios)))
        slow_steps = [r["step"] for r in steady if (s := slowness(r)) and len(s) == world and s[worst] > threshold]
        peak = max((x[worst] for x in ratios), default=1.0)
        if per_rank_ratio[worst] > threshold or (slow_steps and peak > threshold and len(slow_steps) >= 3):
            slowest = worst
            evidence.append(f"rank {worst} takes {peak:.2f}x a typical fast rank's compute time per unit of work at its "
                            f"worst ({per_rank_ratio[worst]:.2f}x over the run), in {len(slow_steps)} of "
                            f"{len(ratios)} steps (steps {_ranges(slow_steps)})")
            during = [r for r in steady if r["step"] in set(slow_steps)]
            comm = _per_rank(during, "comm_s", world)
            waits = [_mean(comm[i]) for i in range(world) if i != worst and comm[i]]
            if waits and comm[worst]:
                evidence.append(f"in those steps the other ranks wait {statistics.median(waits):.3g} s per step in "
                                f"communication, rank {worst} {_mean(comm[worst]):.3g} s")
    for e in events:
        if e.get("event") == "probe" and isinstance(e.get("probe_speed"), list) and slowest is not None \
                and slowest < len(e["probe_speed"]):
            evidence.append(f"matmul probe at step {e.get('step')}: rank {slowest} runs at {e['probe_speed'][slowest]:.2f}x "
                            f"the fast ranks' rate ({'confirmed' if e.get('confirmed') else 'not confirmed'})")
    return Diagnosis(steps=len(records), world=world, ranks=ranks, slowest=slowest, evidence=evidence,
                     events=events, records=records)


def _ranges(steps: list[int]) -> str:
    if not steps:
        return "none"
    out, start, prev = [], steps[0], steps[0]
    for s in steps[1:] + [None]:
        if s is not None and s == prev + 1:
            prev = s
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if s is not None:
            start = prev = s
    return ", ".join(out)


def describe_event(e: dict) -> str:
    kind, step = e.get("event"), e.get("step")
    if kind == "resume":
        skipped = f", past the corrupt {Path(str(e['skipped_corrupt'])).name}" if e.get("skipped_corrupt") else ""
        return f"restart {e.get('attempt', '?')}: resumed from step {step}{skipped}"
    if kind == "recomputed":
        same = "identical, bit for bit" if e.get("identical") else "DIFFERENT"
        return f"steps {_ranges(list(e.get('steps') or []))} computed again after the resume: losses {same}"
    if kind == "nonfinite":
        return f"step {step}: loss {e.get('loss', '?')}, not applied ({e.get('action')})"
    if kind == "rollback":
        return f"rolled back to step {step}"
    if kind == "probe":
        return f"step {step}: matmul probe, slowest rank {e.get('slowest_rank')} ({'confirmed' if e.get('confirmed') else 'not confirmed'})"
    if kind == "replan":
        return (f"step {step}: re-planned for speeds {e.get('speeds')} in {1e3 * float(e.get('replan_s', 0)):.0f} ms, "
                f"predicted {100 * float(e.get('predicted_gain', 0)):.0f}% faster" + ("" if e.get("switched") else ", kept"))
    if kind == "switch":
        return f"step {step}: switched plan ({e.get('how')}), sequences per replica {e.get('batch_shares')}"
    if kind == "stop":
        return f"step {step}: stopped on {e.get('reason')}, checkpoint {e.get('checkpoint')}"
    return f"step {step}: {kind}"
