"""The largest problems the search takes on, and the one check that refuses bigger ones.

The search enumerates divisors of the GPU count and of the global batch, and its per-context work
grows with the number of layers; beyond these sizes a search could run for minutes (a model of
10^9 layers cannot even be built). Each limit is far above today's largest training runs
(16,384 GPUs, 126-block models, global batches of 16,384 sequences).
"""
from __future__ import annotations

from ..errors import TesseraError

MAX_GPUS = 1 << 20
MAX_LAYERS = 4096
MAX_GLOBAL_BATCH = 1 << 22


def check_search_size(*, num_gpus: int | None = None, num_layers: int | None = None,
                      global_batch: int | None = None) -> None:
    """Raise a one-sentence TesseraError naming the first size beyond what the search supports."""
    for value, limit, what in ((num_gpus, MAX_GPUS, "GPUs"), (num_layers, MAX_LAYERS, "layers"),
                               (global_batch, MAX_GLOBAL_BATCH, "sequences of global batch")):
        if value is not None and value > limit:
            raise TesseraError(f"{value:,} {what} is more than the planner supports (at most {limit:,})")
