"""What the model is trained on: devices, nodes, and the links between them.

Bandwidths are unidirectional bytes/s per device (what one GPU can push while all GPUs of the node
push at once); latencies in seconds. A measured profile (`tessera profile hardware`) fills
`collectives` with curves and `compute_efficiency` with an achieved fraction of peak; either
overrides the preset's educated guess. No torch import.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from .model import Frozen

Dtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8"]
Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"]
Span = Literal["intra_node", "inter_node"]
# A rate or size that a cost is divided by: zero, negative, NaN or infinite would answer nonsense.
PositiveFinite = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class DeviceSpec(Frozen):
    name: str
    memory_bytes: float = Field(gt=0, allow_inf_nan=False)
    # Dense peak FLOP/s per dtype (no sparsity).
    peak_flops: dict[str, PositiveFinite]
    memory_bandwidth: float = Field(gt=0, allow_inf_nan=False, description="HBM bytes/s")
    # Memory the framework and NCCL hold that the model cannot use (CUDA context, buffers).
    reserved_bytes: float = Field(default=2.0 * 2**30, ge=0, allow_inf_nan=False)


class LinkSpec(Frozen):
    bandwidth: float = Field(gt=0, allow_inf_nan=False, description="unidirectional bytes/s per device")
    latency: float = Field(ge=0, allow_inf_nan=False, description="seconds per message hop")


class CollectiveCurve(Frozen):
    """Measured time of one collective at one group size and span, over message sizes."""

    collective: Collective
    span: Span
    group_size: int = Field(ge=2)
    message_bytes: tuple[float, ...]
    seconds: tuple[float, ...]

    @model_validator(mode="after")
    def _check(self) -> "CollectiveCurve":
        if len(self.message_bytes) != len(self.seconds) or not self.message_bytes:
            raise ValueError("a collective curve needs as many timings as message sizes (and at least one)")
        return self


class ClusterSpec(Frozen):
    name: str
    num_nodes: int = Field(gt=0)
    gpus_per_node: int = Field(gt=0)
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec
    # Achievable fraction of peak FLOP/s for large matmuls (measured profiles replace this).
    compute_efficiency: float = Field(default=0.6, gt=0, le=1)
    # Overlap of compute and communication: overlapped(c, x) = c + (s - 1) min(c, x) + max(0, x - c)
    # (1.0 = perfect overlap; ~1.1 on GPUs, where NCCL takes some SMs; 2.0 = none, as on CPUs).
    overlap_slowdown: float = Field(default=1.1, ge=1)
    # Host link used to offload optimizer state (PCIe gen5 x16 ~ 50 GB/s unidirectional).
    host_bandwidth: float = Field(default=50e9, gt=0, allow_inf_nan=False)
    # Ranks per set of cores their compute needs, when a node runs more ranks x threads than it
    # has cores (a CPU profile; 1 on GPUs). Measured rates are those with every rank busy, so a
    # rank waiting in a pipeline bubble lends its cores to the others (see `cost.evaluate`).
    oversubscription: float = Field(default=1.0, ge=1)
    collectives: tuple[CollectiveCurve, ...] = ()

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def link(self, group_size: int, span_nodes: bool) -> LinkSpec:
        return self.inter_node if span_nodes else self.intra_node

    def peak(self, dtype: str) -> float:
        try:
            return self.device.peak_flops[dtype]
        except KeyError:
            raise ValueError(
                f"device {self.device.name} has no peak FLOP/s for dtype '{dtype}'; "
                f"known: {', '.join(sorted(self.device.peak_flops))}"
            ) from None

    def with_gpus(self, num_gpus: int) -> "ClusterSpec":
        """The same kind of cluster with another GPU count (whole nodes, or one partial node)."""
        if num_gpus <= self.gpus_per_node:
            return self.model_copy(update={"num_nodes": 1, "gpus_per_node": num_gpus})
        if num_gpus % self.gpus_per_node:
            raise ValueError(
                f"{num_gpus} GPUs is not a multiple of {self.gpus_per_node} GPUs per node"
            )
        return self.model_copy(update={"num_nodes": num_gpus // self.gpus_per_node})
