"""What the model is trained on: devices, nodes, and the links between them.

Bandwidths are unidirectional bytes/s per device (what one GPU can push while all GPUs of the node
push at once); latencies in seconds. A measured profile (`tessera profile hardware`) fills
`collectives` with curves and `compute_efficiency` with an achieved fraction of peak; either
overrides the preset's educated guess. No torch import.
"""
from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from .model import Frozen

Dtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8"]
Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"]
Span = Literal["intra_node", "inter_node"]


class DeviceSpec(Frozen):
    """One accelerator. The GEMM, attention and kernel-launch fields describe how its kernels
    behave (cost/compute.py); a device without `sm_count` (a CPU) is priced by FLOPs at the
    cluster's flat `compute_efficiency` and its measured model profile."""

    name: str
    memory_bytes: float = Field(gt=0, allow_inf_nan=False)
    # Dense peak FLOP/s per dtype (no sparsity).
    peak_flops: dict[str, float]
    memory_bandwidth: float = Field(gt=0, allow_inf_nan=False, description="HBM bytes/s")
    # Memory the framework and NCCL hold that the model cannot use: CUDA context, NCCL channel
    # buffers, cuBLAS workspaces (a measured profile fills it from the device's free memory).
    reserved_bytes: float = Field(default=2.0 * 2**30, ge=0, allow_inf_nan=False)
    # Achievable fraction of `memory_bandwidth` for streaming kernels (copies, element-wise ops).
    memory_efficiency: float = Field(default=1.0, gt=0, le=1)
    # GEMM description: streaming multiprocessors and the output tile a GEMM kernel computes per
    # SM (wave quantisation), 0 = none (flat efficiency).
    sm_count: int = Field(default=0, ge=0)
    gemm_tile: tuple[int, int] = (128, 256)
    # Flash-attention kernel throughput, fraction of the dtype's peak, (forward, backward),
    # causal, head dim 128; 0 = the cluster's `compute_efficiency`.
    attention_efficiency: tuple[float, float] = (0.0, 0.0)
    # Seconds each kernel launch adds on the device (gaps between back-to-back kernels).
    kernel_launch_s: float = Field(default=0.0, ge=0)

    @model_validator(mode="after")
    def _check_positive(self) -> "DeviceSpec":
        bad = [k for k, v in self.peak_flops.items() if not (v > 0 and math.isfinite(v))]
        if bad:
            raise ValueError(f"peak_flops[{bad[0]}] must be a positive number, got {self.peak_flops[bad[0]]}")
        if not math.isfinite(self.memory_bandwidth) or not math.isfinite(self.memory_bytes):
            raise ValueError("memory_bytes and memory_bandwidth must be finite")
        return self

    @property
    def streaming_bandwidth(self) -> float:
        """Bytes/s a memory-bound kernel achieves."""
        return self.memory_bandwidth * self.memory_efficiency


class LinkSpec(Frozen):
    bandwidth: float = Field(gt=0, allow_inf_nan=False, description="unidirectional bytes/s per device")
    latency: float = Field(ge=0, allow_inf_nan=False, description="seconds per ring step (message hop)")


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
    # Achievable fraction of peak FLOP/s for large matmuls (the presets: the best GEMM measured
    # on the device; a measured profile replaces it). Smaller GEMMs run below it (cost/compute.py).
    compute_efficiency: float = Field(default=0.6, gt=0, le=1)
    # Overlap of compute and communication: overlapped(c, x) = c + (s - 1) min(c, x) + max(0, x - c)
    # (1.0 = perfect overlap; ~1.1 on GPUs, where NCCL takes some SMs; 2.0 = none, as on CPUs).
    overlap_slowdown: float = Field(default=1.1, ge=1)
    # Host link used to offload (PCIe gen5 x16 ~ 50 GB/s unidirectional), per device.
    host_bandwidth: float = Field(default=50e9, gt=0, allow_inf_nan=False)
    # The host's DRAM bandwidth one device's share of the host optimizer step gets (the node's
    # STREAM bandwidth / devices per node).
    host_memory_bandwidth: float = Field(default=30e9, gt=0, allow_inf_nan=False)
    # Host memory one device's offloaded states may take (the node's DRAM / devices per node).
    host_memory_bytes: float = Field(default=256 * 2**30, gt=0, allow_inf_nan=False)
    # Fixed start-up of every collective (NCCL's `baseLat`, Ring/Simple: 8.4 us; see cost/comm.py).
    collective_latency: float = Field(default=8.4e-6, ge=0, allow_inf_nan=False)
    # Bus bandwidth cap of NCCL's tree all-reduce across more than two nodes (`maxTreeBw`).
    tree_bandwidth: float = Field(default=80e9, gt=0, allow_inf_nan=False)
    # Memory: the caching allocator's fragmentation, a fraction of the bytes the model allocates
    # (states, activations, transient buffers), and the share of device memory the planner
    # leaves free (`--memory-margin`), so that a plan it calls feasible does not fail on the device.
    fragmentation: float = Field(default=0.10, ge=0, le=1)
    memory_margin: float = Field(default=0.05, ge=0, lt=1)
    # Ranks per set of cores their compute needs, when a node runs more ranks x threads than it
    # has cores (a CPU profile; 1 on GPUs). Measured rates are those with every rank busy, so a
    # rank waiting in a pipeline bubble lends its cores to the others (see `cost.evaluate`).
    oversubscription: float = Field(default=1.0, ge=1)
    collectives: tuple[CollectiveCurve, ...] = ()
    # Relative compute speed of devices that are not as fast as the rest, by global rank (a
    # straggler measured at 0.5 runs its kernels in twice the time); absent ranks run at 1.0.
    # The cost model slows each data-parallel replica's pipeline stages by their slowest device
    # (cost/evaluate.py) and `search.replan` re-cuts layers and data around them (Malleus).
    device_speeds: dict[int, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_speeds(self) -> "ClusterSpec":
        for rank, speed in self.device_speeds.items():
            if not 0 <= rank < self.num_gpus:
                raise ValueError(f"device_speeds names rank {rank}, outside the cluster's {self.num_gpus} devices")
            if not (math.isfinite(speed) and 0 < speed <= 1000):
                raise ValueError(f"device_speeds[{rank}] must be a speed factor in (0, 1000], got {speed}")
        return self

    def speed(self, rank: int) -> float:
        """Relative compute speed of the device of global rank `rank` (1.0 unless measured slower)."""
        return self.device_speeds.get(rank, 1.0)

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
        if num_gpus <= self.gpus_per_node:  # device speeds name ranks of the old size: dropped
            return self.model_copy(update={"num_nodes": 1, "gpus_per_node": num_gpus, "device_speeds": {}})
        if num_gpus % self.gpus_per_node:
            raise ValueError(
                f"{num_gpus} GPUs is not a multiple of {self.gpus_per_node} GPUs per node"
            )
        return self.model_copy(update={"num_nodes": num_gpus // self.gpus_per_node, "device_speeds": {}})
