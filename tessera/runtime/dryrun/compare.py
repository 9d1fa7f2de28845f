"""Predicted against measured, per sampled rank: model-state bytes and the step's collectives.

Collectives are compared grouped by (kind, group size, bytes): a predicted and a measured group
are the same when kind and group size are equal and the bytes within `BYTES_TOLERANCE` (FSDP2
pads every parameter to a multiple of its shard group); a group whose counts differ, or that
exists on one side only, is a count mismatch. Point-to-point messages count as a group of 2
whatever process group carries them; collectives over one rank move nothing and are left out
on both sides.

State memory: the error is that of the total of parameters, gradients and optimizer state on
the device; each category is compared as well (`STATE_TOLERANCE`), since the runtime may keep
the same total in other categories (FSDP2 keeps fp32 sharded weights, the master copy, and
fp32 gradients where the cost model counts bf16 weights, bf16 gradients and a separate master).
No torch.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ...cost.collectives import Collective
from ...plan import MemoryBreakdown

BYTES_TOLERANCE = 0.01
STATE_TOLERANCE = 0.02
STATE_FIELDS = ("params", "grads", "optimizer")


@dataclass(frozen=True)
class CollectiveRow:
    kind: str
    group_size: int
    bytes: float
    predicted: int
    measured: int
    why: str = ""  # of the predicted group

    @property
    def matches(self) -> bool:
        return self.predicted == self.measured


@dataclass(frozen=True)
class StateRow:
    name: str  # params, grads, optimizer, total
    predicted: float
    measured: float
    host: float = 0.0  # measured in host memory (CPU offload)

    @property
    def error(self) -> float:
        """Relative error of the measured bytes against the predicted (0 when both are 0)."""
        if self.predicted == 0:
            return 0.0 if self.measured == 0 else float("inf")
        return (self.measured - self.predicted) / self.predicted

    @property
    def matches(self) -> bool:
        return abs(self.error) <= STATE_TOLERANCE


@dataclass
class RankComparison:
    rank: int
    pp_rank: int
    mode: str
    state: list[StateRow]
    collectives: list[CollectiveRow]
    memory_needed: float  # measured states + predicted activations and buffers
    device_memory: float
    notes: list[str] = field(default_factory=list)

    @property
    def state_error(self) -> float:
        return self.state[-1].error

    @property
    def count_mismatches(self) -> int:
        return sum(1 for row in self.collectives if not row.matches)

    @property
    def fits(self) -> bool:
        return self.memory_needed <= self.device_memory


def _normalise(kind: str, group: int) -> tuple[str, int]:
    return (kind, 2) if kind in ("send", "recv") else (kind, group)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= BYTES_TOLERANCE * max(a, b)


def compare_collectives(predicted: list[Collective], measured) -> list[CollectiveRow]:
    """Rows of predicted vs measured counts; `measured` holds records with kind, group_size, bytes."""
    pred: dict[tuple[str, int, float], int] = {}
    why: dict[tuple[str, int, float], str] = {}
    for c in predicted:
        kind, group = _normalise(c.kind, c.group_size)
        key = next((k for k in pred if k[:2] == (kind, group) and _close(k[2], c.bytes)), (kind, group, c.bytes))
        pred[key] = pred.get(key, 0) + c.count
        why.setdefault(key, c.why)
    meas: Counter = Counter()
    for r in measured:
        kind, group = _normalise(r.kind, r.group_size)
        if group > 1:
            meas[(kind, group, r.bytes)] += 1
    rows: list[CollectiveRow] = []
    unmatched = dict(meas)
    for key, count in sorted(pred.items()):
        kind, group, nbytes = key
        near = [k for k in unmatched if k[:2] == (kind, group) and _close(k[2], nbytes)]
        got = sum(unmatched.pop(k) for k in near)
        rows.append(CollectiveRow(kind, group, float(nbytes), count, got, why[key]))
    for (kind, group, nbytes), count in sorted(unmatched.items()):
        rows.append(CollectiveRow(kind, group, float(nbytes), 0, count, "not predicted"))
    return sorted(rows, key=lambda row: (row.kind, row.group_size, row.bytes))


def compare_state(predicted: MemoryBreakdown, device, host) -> list[StateRow]:
    """Rows per category and the total; `device`/`host` have params, grads, optimizer bytes."""
    rows = [StateRow(f, getattr(predicted, f), getattr(device, f), getattr(host, f)) for f in STATE_FIELDS]
    rows.append(StateRow("total", sum(r.predicted for r in rows), sum(r.measured for r in rows),
                         sum(r.host for r in rows)))
    return rows
