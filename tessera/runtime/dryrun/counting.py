"""Count the collectives a region of code issues: (kind, group size, bytes) per call.

`CollectiveCounter` is a `TorchDispatchMode`: every collective reaches the dispatcher as a c10d
op (`dist.all_reduce`, FSDP2, DDP, send/recv) or a functional-collective op (DTensor's
redistributions, Ulysses' autograd all-to-alls), so counting works under any backend, the fake
one included (its collectives are no-ops but are still dispatched). DTensor ops are let through
first (`NotImplemented`) so that the mode sees the collectives they desugar into, not the
DTensor op itself.

Bytes follow the cost model's convention (`tessera.cost.comm`): the full (gathered) size for
all-gather, the full input for reduce-scatter, the tensor for all-reduce and broadcast, what each
rank sends in total for all-to-all, the message for send / recv.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveRecord", "CollectiveCounter"]


@dataclass(frozen=True, order=True)
class CollectiveRecord:
    kind: str  # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send, recv, ...
    group_size: int
    bytes: int


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _group_size(group) -> int:
    """Size of a c10d ProcessGroup script object or of a functional collective's group name."""
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(group).size()
    if isinstance(group, torch.ScriptObject):
        import torch.distributed as dist

        group = dist.ProcessGroup.unbox(group)
    return group.size()


def _c10d(name: str, args) -> CollectiveRecord | None:
    """A record for a `torch.ops.c10d` op (process group is an argument)."""
    if name in ("allreduce_", "allreduce_coalesced_"):
        return CollectiveRecord("all_reduce", _group_size(args[1]), _nbytes(args[0]))
    if name == "_allgather_base_":
        return CollectiveRecord("all_gather", _group_size(args[2]), _nbytes(args[0]))
    if name in ("allgather_", "allgather_coalesced_", "allgather_into_tensor_coalesced_"):
        return CollectiveRecord("all_gather", _group_size(args[2]), _nbytes(args[0]))
    if name == "_reduce_scatter_base_":
        return CollectiveRecord("reduce_scatter", _group_size(args[2]), _nbytes(args[1]))
    if name in ("reduce_scatter_", "reduce_scatter_tensor_coalesced_"):
        return CollectiveRecord("reduce_scatter", _group_size(args[2]), _nbytes(args[1]))
    if name == "alltoall_base_":
        return CollectiveRecord("all_to_all", _group_size(args[2]), _nbytes(args[1]))
    if name == "alltoall_":
        return CollectiveRecord("all_to_all", _group_size(args[2]), _nbytes(args[1]))
    if name == "broadcast_":
        return CollectiveRecord("broadcast", _group_size(args[1]), _nbytes(args[0]))
    if name == "send":
        return CollectiveRecord("send", _group_size(args[1]), _nbytes(args[0]))
    if name in ("recv_", "recv_any_source_"):
        return CollectiveRecord("recv", _group_size(args[1]), _nbytes(args[0]))
    if name in ("reduce_", "gather_", "scatter_"):
        return CollectiveRecord(name.rstrip("_"), _group_size(args[2] if name != "reduce_" else args[1]),
                                _nbytes(args[0] if name != "scatter_" else args[1]))
    if name == "barrier":
        return CollectiveRecord("barrier", _group_size(args[1]), 0)
    return None


def _functional(name: str, args) -> CollectiveRecord | None:
    """A record for a `_c10d_functional` (or its autograd twin) op (group given by name)."""
    base = name.rstrip("_")
    if base in ("all_reduce", "all_reduce_coalesced"):
        return CollectiveRecord("all_reduce", _group_size(args[2]), _nbytes(args[0]))
    if base in ("all_gather_into_tensor", "all_gather_into_tensor_out"):
        return CollectiveRecord("all_gather", int(args[1]), _nbytes(args[0]) * int(args[1]))
    if base == "all_gather_into_tensor_coalesced":
        return CollectiveRecord("all_gather", int(args[1]), _nbytes(args[0]) * int(args[1]))
    if base in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):
        return CollectiveRecord("reduce_scatter", int(args[2]), _nbytes(args[0]))
    if base == "all_to_all_single":
        return CollectiveRecord("all_to_all", _group_size(args[3]), _nbytes(args[0]))
    if base == "broadcast":
        return CollectiveRecord("broadcast", _group_size(args[2]), _nbytes(args[0]))
    return None


class CollectiveCounter(TorchDispatchMode):
    """Record every collective issued inside `with CollectiveCounter() as counter:`.

    `records` lists them in issue order; `counts()` groups them by (kind, group size, bytes).
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[CollectiveRecord] = []
        self.paused = False  # while True, collectives pass uncounted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into plain ops and collectives first
        namespace = getattr(func, "namespace", "")
        name = func._overloadpacket.__name__ if hasattr(func, "_overloadpacket") else ""
        record = None
        if namespace == "c10d":
            record = _c10d(name, args)
        elif namespace in ("_c10d_functional", "_c10d_functional_autograd"):
            record = _functional(name, args)
        if record is not None and not self.paused:
            self.records.append(record)
        return func(*args, **kwargs)

    def counts(self) -> Counter:
        return Counter(self.records)
