"""One-line refusals of what `tessera train` reads beyond its typed config (`tessera/config.py`
refuses bad numbers in flags and config files, each field with its bounds)."""
from __future__ import annotations

from ..config import MAX_SEQ_LEN
from ..errors import TesseraError


def check_plan_sizes(plan) -> None:
    """A plan file's sequence length within what a rank can build (the planner checks the rest)."""
    if plan.workload.seq_len > MAX_SEQ_LEN:
        raise TesseraError(f"plan.workload.seq_len {plan.workload.seq_len:,} is longer than {MAX_SEQ_LEN:,} tokens")
