"""One-line refusals of `tessera train`'s numeric flags, before anything is planned or started.

A value that would train nonsense (a NaN learning rate, a negative clip), fail late in every rank
(zero ranks, a zero logging interval) or make the planner run for ever (a global batch of 10^12)
is named with the reason. The recovery and node flags are checked by `cli/launch.py`.
"""
from __future__ import annotations

import math

from ..errors import TesseraError

MAX_LOCAL_RANKS = 1024
MAX_SEQ_LEN = 1 << 24


def _number(args, name: str, *, low: float, high: float = math.inf, strict_low: bool = False) -> None:
    value = getattr(args, name.lstrip("-").replace("-", "_"))
    if value is None:
        return
    if not math.isfinite(value) or value < low or (strict_low and value == low) or value > high:
        bound = f"{'above' if strict_low else 'at least'} {_show(low)}" + \
            (f" and at most {_show(high)}" if high < math.inf else "")
        raise TesseraError(f"{name} must be a finite number {bound}, got {_show(value)}")


def _show(x: float) -> str:
    return f"{int(x):,}" if isinstance(x, int) or (math.isfinite(x) and x == int(x)) else f"{x:g}"


def check_plan_sizes(plan) -> None:
    """A plan file's sequence length within what a rank can build (the planner checks the rest)."""
    if plan.workload.seq_len > MAX_SEQ_LEN:
        raise TesseraError(f"plan.workload.seq_len {plan.workload.seq_len:,} is longer than {MAX_SEQ_LEN:,} tokens")


def check_flags(args) -> None:
    _number(args, "--nproc", low=1, high=MAX_LOCAL_RANKS)
    _number(args, "--steps", low=0)
    _number(args, "--lr", low=0, strict_low=True)
    _number(args, "--grad-clip", low=0)
    _number(args, "--warmup", low=0)
    _number(args, "--seed", low=0, high=2**63 - 1)
    _number(args, "--global-batch", low=1)
    _number(args, "--seq-len", low=1, high=MAX_SEQ_LEN)
    _number(args, "--checkpoint-every", low=0)
    _number(args, "--log-every", low=1)
    from ..search.limits import check_search_size

    check_search_size(global_batch=args.global_batch)


def check_data(plan, args) -> None:
    """The data the ranks will read: it loads, and its token ids fit the model (with --check;
    `--init-from` data is checked by `cli/train.py` before any run)."""
    if args.synthetic_data or args.init_from:
        return
    from ..runtime.data import load_token_stream

    stream = load_token_stream(args.data)
    if stream.vocab_size > plan.model.config.vocab_size:
        raise TesseraError(f"the data's tokens go up to id {stream.vocab_size - 1}, beyond the model's vocabulary of "
                           f"{plan.model.config.vocab_size}")
