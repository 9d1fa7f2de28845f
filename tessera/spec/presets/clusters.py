"""Cluster presets with published peak figures.

Sources (dense, no sparsity):
- A100 SXM: NVIDIA A100 datasheet (2020): bf16/fp16 312 TFLOP/s, tf32 156, fp32 19.5;
  HBM2 1,555 GB/s (40GB) / HBM2e 2,039 GB/s (80GB); NVLink 3: 600 GB/s total per GPU,
  i.e. 300 GB/s each way. DGX A100: 8x HDR InfiniBand 200 Gb/s, one NIC per GPU = 25 GB/s.
- H100 SXM: NVIDIA H100 datasheet (2022): bf16 989 TFLOP/s, fp8 1,979, tf32 494.5, fp32 67;
  HBM3 3.35 TB/s; NVLink 4: 900 GB/s total, 450 GB/s each way. DGX H100: 8x NDR 400 Gb/s = 50 GB/s.
- H200 SXM: NVIDIA H200 datasheet (2023): compute as H100; 141 GB HBM3e at 4.8 TB/s.
Achievable bus bandwidth is lower than the link rate: NCCL tests typically reach ~80% of NVLink
and ~90% of InfiniBand line rate for large messages; `ring_efficiency` below applies that.
Latencies: ~5 us per NVLink hop, ~10 us across InfiniBand (NCCL small-message all-reduce times).
"""
from __future__ import annotations

from ..cluster import ClusterSpec, DeviceSpec, LinkSpec

GiB = 2**30
GB = 1e9

DEVICES: dict[str, DeviceSpec] = {
    "a100-40gb": DeviceSpec(name="a100-40gb", memory_bytes=40 * GiB, memory_bandwidth=1555 * GB,
                            peak_flops={"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    "a100-80gb": DeviceSpec(name="a100-80gb", memory_bytes=80 * GiB, memory_bandwidth=2039 * GB,
                            peak_flops={"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    "h100-80gb": DeviceSpec(name="h100-80gb", memory_bytes=80 * GiB, memory_bandwidth=3350 * GB,
                            peak_flops={"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12,
                                        "tf32": 494.5e12, "fp32": 67e12}),
    "h200": DeviceSpec(name="h200", memory_bytes=141 * GB, memory_bandwidth=4800 * GB,
                       peak_flops={"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12,
                                   "tf32": 494.5e12, "fp32": 67e12}),
}

# (intra-node link, inter-node link) per device: achievable unidirectional bytes/s per GPU.
LINKS: dict[str, tuple[LinkSpec, LinkSpec]] = {
    "a100-40gb": (LinkSpec(bandwidth=0.8 * 300 * GB, latency=5e-6), LinkSpec(bandwidth=0.9 * 25 * GB, latency=10e-6)),
    "a100-80gb": (LinkSpec(bandwidth=0.8 * 300 * GB, latency=5e-6), LinkSpec(bandwidth=0.9 * 25 * GB, latency=10e-6)),
    "h100-80gb": (LinkSpec(bandwidth=0.8 * 450 * GB, latency=5e-6), LinkSpec(bandwidth=0.9 * 50 * GB, latency=10e-6)),
    "h200": (LinkSpec(bandwidth=0.8 * 450 * GB, latency=5e-6), LinkSpec(bandwidth=0.9 * 50 * GB, latency=10e-6)),
}


class UnknownGPUError(ValueError):
    pass


def gpu_names() -> list[str]:
    return sorted(DEVICES)


def make_cluster(gpu: str = "h100-80gb", num_gpus: int = 64, gpus_per_node: int = 8) -> ClusterSpec:
    """A homogeneous cluster of `num_gpus` devices of kind `gpu`, `gpus_per_node` per node."""
    if gpu not in DEVICES:
        raise UnknownGPUError(f"unknown GPU '{gpu}'; known GPUs: {', '.join(gpu_names())}")
    if num_gpus <= 0 or gpus_per_node <= 0:
        raise ValueError(f"GPU counts must be positive (got --gpus {num_gpus}, --gpus-per-node {gpus_per_node})")
    if num_gpus > gpus_per_node and num_gpus % gpus_per_node:
        raise ValueError(f"--gpus {num_gpus} is not a multiple of --gpus-per-node {gpus_per_node}")
    intra, inter = LINKS[gpu]
    nodes = max(1, num_gpus // gpus_per_node)
    per_node = min(num_gpus, gpus_per_node)
    return ClusterSpec(name=f"{nodes}x{per_node} {gpu}", num_nodes=nodes, gpus_per_node=per_node,
                       device=DEVICES[gpu], intra_node=intra, inter_node=inter)


def local_cpu_cluster(num_ranks: int) -> ClusterSpec:
    """This machine as a 'cluster' of `num_ranks` CPU processes on gloo (for local training).

    Figures are rough for a 2-core CI machine; `tessera profile hardware` measures real ones.
    """
    device = DeviceSpec(name="cpu", memory_bytes=4 * GiB, memory_bandwidth=10 * GB,
                        peak_flops={"fp32": 50e9, "bf16": 1e9}, reserved_bytes=0.0)
    link = LinkSpec(bandwidth=1 * GB, latency=50e-6)
    return ClusterSpec(name=f"local cpu x{num_ranks}", num_nodes=1, gpus_per_node=num_ranks,
                       device=device, intra_node=link, inter_node=link, compute_efficiency=0.5,
                       overlap_slowdown=1.0, host_bandwidth=10 * GB)
