"""Count the collectives a region of code issues: kind, group size and bytes, per call.

    with count_collectives() as records:
        trainer.train_step(tokens, labels)
    summary(records)          # {("reduce_scatter", 2): (calls, bytes), ...}

A `TorchDispatchMode` sees every collective that reaches the dispatcher: the process-group
operators FSDP2, DDP and `torch.distributed.*` call (`c10d::allreduce_`, `_allgather_base_`,
`send`, ...), and the functional collectives DTensor and tensor parallelism use
(`_c10d_functional::all_reduce`, ...), on any backend, the fake one included. Only the issuing
rank is counted; run it on every rank to see every rank's share.

Bytes follow the cost model's convention (`tessera.cost.comm`): the full message, i.e. the
gathered size for all-gather, the unreduced input for reduce-scatter, the tensor for all-reduce
and broadcast, what this rank sends in total for all-to-all, and the tensor for send/recv.
Collectives on a group of one rank move nothing and are left out unless `keep_trivial=True`.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# operator name (without overload) -> (kind, which argument holds the message)
# "in": the input tensor(s), "out": the output tensor(s) (gathered size).
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
    "scatter_": ("scatter", "out"),
    "send": ("send", "in"),
    "recv_": ("recv", "in"),
    "recv_any_source_": ("recv", "in"),
}
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", "in"),
    "all_reduce_coalesced": ("all_reduce", "in"),
    "all_gather_into_tensor": ("all_gather", "out"),
    "all_gather_into_tensor_coalesced": ("all_gather", "out"),
    "reduce_scatter_tensor": ("reduce_scatter", "in"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "in"),
    "all_to_all_single": ("all_to_all", "in"),
    "broadcast": ("broadcast", "in"),
}
_NAMESPACES = {"c10d": _C10D, "_c10d_functional": _FUNCTIONAL, "c10d_functional": _FUNCTIONAL}


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective issued by this rank."""

    kind: str  # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send, recv, ...
    group_size: int
    bytes: int  # the message, as the cost model counts it (module docstring)
    op: str  # the operator, e.g. "c10d._reduce_scatter_base_"


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _group_size(args, kwargs) -> int | None:
    import torch.distributed as dist

    for a in (*args, *kwargs.values()):
        if isinstance(a, dist.ProcessGroup):
            return a.size()
        if isinstance(a, torch.ScriptObject) and a._type().name().endswith("ProcessGroup"):
            return dist.ProcessGroup.unbox(a).size()
    return None


def _functional_group_size(args, kwargs, name: str) -> int | None:
    """Functional collectives name their group (a string) and, for gathers, pass its size."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    for a in (*args, *kwargs.values()):
        if isinstance(a, str):
            try:
                return _resolve_process_group(a).size()
            except (RuntimeError, ValueError, KeyError):
                continue
    return None


def _record(func, args, kwargs, out) -> CollectiveRecord | None:
    namespace = func.namespace
    table = _NAMESPACES.get(namespace)
    if table is None:
        return None
    name = func._schema.name.split("::")[-1]
    if name not in table:
        return None
    kind, where = table[name]
    if namespace == "c10d":
        size = _group_size(args, kwargs)
        # c10d ops return (output tensors, work); the first argument holds the outputs for
        # gathers (output, input) and the tensors themselves for in-place ones.
        if where == "out":
            message = _nbytes(_tensors(args[0]))
        elif kind in ("reduce_scatter", "all_to_all"):
            message = _nbytes(_tensors(args[1]))
        else:
            message = _nbytes(_tensors(args[0]))
    else:
        size = _functional_group_size(args, kwargs, name)
        message = _nbytes(_tensors(out if where == "out" else args[0]))
    return CollectiveRecord(kind=kind, group_size=size or 0, bytes=message, op=f"{namespace}.{name}")


class _Counter(TorchDispatchMode):
    def __init__(self, records: list[CollectiveRecord], keep_trivial: bool):
        super().__init__()
        self.records = records
        self.keep_trivial = keep_trivial

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        record = _record(func, args, kwargs, out)
        if record is not None and (self.keep_trivial or record.group_size != 1):
            self.records.append(record)
        return out


@contextmanager
def count_collectives(keep_trivial: bool = False) -> Iterator[list[CollectiveRecord]]:
    """Record every collective this rank issues inside the block (list filled as it runs)."""
    records: list[CollectiveRecord] = []
    with _Counter(records, keep_trivial):
        yield records


def summary(records: list[CollectiveRecord]) -> dict[tuple[str, int], tuple[int, int]]:
    """(kind, group size) -> (number of calls, total bytes)."""
    out: dict[tuple[str, int], tuple[int, int]] = {}
    for r in records:
        calls, nbytes = out.get((r.kind, r.group_size), (0, 0))
        out[(r.kind, r.group_size)] = (calls + 1, nbytes + r.bytes)
    return out
