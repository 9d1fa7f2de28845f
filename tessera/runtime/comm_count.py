"""Count the collectives a region of code issues: kind, group size and bytes, per call.

    with count_collectives() as records:
        trainer.train_step(tokens, labels)
    summary(records)          # {("reduce_scatter", 2): (calls, bytes), ...}

`CollectiveCounter` is a `TorchDispatchMode`: every collective reaches the dispatcher, as a
process-group operator (FSDP2, DDP, `torch.distributed.*`, send/recv: `c10d::allreduce_`,
`_allgather_base_`, ...) or as a functional collective (DTensor's redistributions, tensor and
loss parallelism, Ulysses' autograd all-to-alls: `_c10d_functional::all_reduce`, ...), on any
backend, the fake one included (its collectives do nothing but are still dispatched). An
operator on DTensors is handed back to DTensor first (`NotImplemented`), so that the mode sees
the collectives it desugars into (the input redistribution of a matmul, loss parallelism's
reductions), not only the DTensor operator. Only the issuing rank is counted; run it on every
rank to see every rank's share. The dry run (`runtime/dryrun`) and the distributed tests count
with it.

Bytes follow the cost model's convention (`tessera.cost.comm`): the full message, i.e. the
gathered size for all-gather, the unreduced input for reduce-scatter, the tensor for all-reduce
and broadcast, what this rank sends in total for all-to-all, and the tensor for send/recv.
Collectives on a group of one rank move nothing and are left out unless `keep_trivial=True`.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveRecord", "CollectiveCounter", "count_collectives", "summary"]

# operator name (without overload) -> (kind, which argument holds the message):
# "out" the output tensor(s) (the gathered size), "in" the input tensor(s) (c10d's in-place
# operators take the tensors themselves first; reduce-scatter and all-to-all take (output, input)).
_C10D = {
    "allreduce_": ("all_reduce", "in"),
    "allreduce_coalesced_": ("all_reduce", "in"),
    "_allgather_base_": ("all_gather", "out"),
    "allgather_": ("all_gather", "out"),
    "allgather_coalesced_": ("all_gather", "out"),
    "allgather_into_tensor_coalesced_": ("all_gather", "out"),
    "_reduce_scatter_base_": ("reduce_scatter", "in"),
    "reduce_scatter_": ("reduce_scatter", "in"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "in"),
    "alltoall_base_": ("all_to_all", "in"),
    "alltoall_": ("all_to_all", "in"),
    "broadcast_": ("broadcast", "in"),
    "reduce_": ("reduce", "in"),
    "gather_": ("gather", "in"),
    "scatter_": ("scatter", "in"),
    "send": ("send", "in"),
    "recv_": ("recv", "in"),
    "recv_any_source_": ("recv", "in"),
    "barrier": ("barrier", "none"),
}
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", "in"),
    "all_reduce_coalesced": ("all_reduce", "in"),
    "all_gather_into_tensor": ("all_gather", "out"),
    "all_gather_into_tensor_out": ("all_gather", "out"),
    "all_gather_into_tensor_coalesced": ("all_gather", "out"),
    "reduce_scatter_tensor": ("reduce_scatter", "in"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "in"),
    "all_to_all_single": ("all_to_all", "in"),
    "broadcast": ("broadcast", "in"),
}
_NAMESPACES = {"c10d": _C10D, "_c10d_functional": _FUNCTIONAL, "c10d_functional": _FUNCTIONAL,
               "_c10d_functional_autograd": _FUNCTIONAL}
# c10d operators whose message is their second argument: (output, input, ...) signatures.
_C10D_SECOND = {"_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_",
                "alltoall_base_", "alltoall_", "gather_", "scatter_"}


@dataclass(frozen=True, order=True)
class CollectiveRecord:
    """One collective issued by this rank. Equal records (kind, group size, bytes) count alike."""

    kind: str  # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send, recv, ...
    group_size: int
    bytes: int  # the message, as the cost model counts it (module docstring)
    op: str = field(default="", compare=False)  # the operator, e.g. "c10d._reduce_scatter_base_"


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(x))


def _group_size(args, kwargs) -> int:
    """Size of the process group a c10d operator is given (a ProcessGroup or its script object),
    or of the group a functional collective names; 0 when none is found."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    for a in (*args, *kwargs.values()):
        if isinstance(a, dist.ProcessGroup):
            return a.size()
        if isinstance(a, torch.ScriptObject) and a._type().name().endswith("ProcessGroup"):
            return dist.ProcessGroup.unbox(a).size()
        if isinstance(a, str):
            try:
                return _resolve_process_group(a).size()
            except (RuntimeError, ValueError, KeyError):
                continue
    return 0


def _record(func, args, kwargs, out) -> CollectiveRecord | None:
    namespace = getattr(func, "namespace", "")
    table = _NAMESPACES.get(namespace)
    if table is None:
        return None
    name = func._schema.name.split("::")[-1]
    if name not in table:
        return None
    kind, where = table[name]
    if where == "none":
        message = 0
    elif namespace == "c10d":
        message = _nbytes(args[1] if name in _C10D_SECOND else args[0])
    else:
        message = _nbytes(out if where == "out" else args[0])
    return CollectiveRecord(kind, _group_size(args, kwargs), message, f"{namespace}.{name}")


class CollectiveCounter(TorchDispatchMode):
    """Record every collective issued inside `with CollectiveCounter() as counter:` in
    `counter.records` (issue order). While `paused` is True collectives pass uncounted."""

    def __init__(self, keep_trivial: bool = False, records: list[CollectiveRecord] | None = None):
        super().__init__()
        self.records: list[CollectiveRecord] = records if records is not None else []
        self.keep_trivial = keep_trivial
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor desugars first; its plain ops come back here
        out = func(*args, **kwargs)
        record = _record(func, args, kwargs, out)
        if record is not None and not self.paused and (self.keep_trivial or record.group_size != 1):
            self.records.append(record)
        return out


@contextmanager
def count_collectives(keep_trivial: bool = False) -> Iterator[list[CollectiveRecord]]:
    """Record every collective this rank issues inside the block (list filled as it runs)."""
    records: list[CollectiveRecord] = []
    with CollectiveCounter(keep_trivial, records):
        yield records


def summary(records: list[CollectiveRecord]) -> dict[tuple[str, int], tuple[int, int]]:
    """(kind, group size) -> (number of calls, total bytes)."""
    out: dict[tuple[str, int], tuple[int, int]] = {}
    for r in records:
        calls, nbytes = out.get((r.kind, r.group_size), (0, 0))
        out[(r.kind, r.group_size)] = (calls + 1, nbytes + r.bytes)
    return out
