"""Cluster presets with published peak figures and published measurements of what is achievable.

Peaks (dense, no sparsity):
- A100 SXM: NVIDIA A100 datasheet (2020): bf16/fp16 312 TFLOP/s, tf32 156, fp32 19.5;
  HBM2 1,555 GB/s (40GB) / HBM2e 2,039 GB/s (80GB); 108 SMs; NVLink 3: 600 GB/s total per GPU,
  i.e. 300 GB/s each way. DGX A100: 8x HDR InfiniBand 200 Gb/s, one NIC per GPU = 25 GB/s.
- H100 SXM: NVIDIA H100 datasheet (2022): bf16 989 TFLOP/s, fp8 1,979, tf32 494.5, fp32 67;
  HBM3 3.35 TB/s; 132 SMs; NVLink 4: 900 GB/s total, 450 GB/s each way. DGX H100: 8x NDR
  400 Gb/s = 50 GB/s per GPU.
- H200 SXM: NVIDIA H200 datasheet (2023): compute as H100; 141 GB HBM3e at 4.8 TB/s.

Achievable figures (`compute_efficiency`, `DeviceSpec` kernel fields, links):
- Large GEMMs (`compute_efficiency`): what a training run sustains, i.e. the best bf16 matmul
  measured over a sweep of shapes in short bursts ("Maximum Achievable Matmul FLOPS", MAMF:
  S. Bekman, Machine Learning Engineering Open Book, compute/accelerator/README.md,
  mamf-finder.py, torch 2.6-2.7 / CUDA 12.6: A100 SXM 271.2 of 312 TFLOP/s, 86.9%; H100 SXM
  794.5 of 989, 80.3%) times the fraction a saturated, power-limited chip keeps of it once its
  clock settles below boost ("Maximum Sustainable Matmul FLOPS", MSMF, same book: H200 755
  against a MAMF of 834 TFLOP/s, 0.905; "it's the one to use for training, which is one long
  saturated run"). H100 shares the H200's chip and 700 W limit: 0.803 x 0.905 = 0.727. No
  sustained figure is published for the A100 (400 W, 1,410 MHz boost); the same 0.905 is
  assumed: 0.869 x 0.905 = 0.787. A measured profile (`tessera profile hardware`) replaces both.
- GEMM tiles: cuBLAS's large bf16 kernels compute a 128 x 256 output tile per SM (CUTLASS's
  default Ampere/Hopper tile shapes); see cost/compute.py for the wave quantisation it causes.
- Flash attention (`attention_efficiency`, causal, head dim 128, sequences of 2-8K): A100 with
  FlashAttention-2 (T. Dao, "FlashAttention-2", 2023, Fig. 4-6: forward up to 73% of peak, about
  187 TFLOP/s causal at 2-4K; backward up to 63%, about 160 causal): 0.60 and 0.52 of peak.
  H100 with PyTorch SDPA's flash backend, which is FlashAttention-2 (J. Shah et al.,
  "FlashAttention-3", 2024, Fig. 4-6: FlashAttention-2 on H100 SXM5 at 330-370 TFLOP/s forward,
  below 300 backward, causal slower): 0.33 and 0.29. Both are kernel benchmarks, short bursts
  like MAMF: the sustained fraction 0.905 applies, (0.543, 0.471) and (0.299, 0.262).
- Streaming kernels (`memory_efficiency`): a device-to-device copy on an H100 SXM reaches
  2,903 GB/s, 86.7% of its 3.35 TB/s (Voltage Park / Georgia Tech H100 cluster benchmark, 2025);
  0.87 is used for every HBM device.
- Kernel launches (`kernel_launch_s`): about 3 us of device idle per kernel issued back-to-back
  from Python without CUDA graphs (NVIDIA, "Getting Started with CUDA Graphs", 2019).
- Links: NCCL's own tuning model (NCCL src/graph/tuning.cc) caps A100 bus bandwidth at 235 GB/s
  (`compCap80`), charges 3.4 us per NVLink ring step and 9.6 us per network ring step (Ring /
  Simple `hwLat`), 8.4 us per collective (`baseLat`). NVLink 4 is taken at 80% of 450 GB/s. The
  network: 90% of a NIC's line rate per GPU (a 4-node H100 all-reduce reaches 331 GB/s of bus
  bandwidth over 8 NICs of 50 GB/s: 83%, including NVLink hops; Voltage Park benchmark above).
- Host (offload): PCIe gen4 x16 (A100) ~25 GB/s and gen5 x16 (H100) ~50 GB/s each way per GPU;
  the host optimizer step gets 1/8 of the node's STREAM bandwidth: DGX A100's 2 EPYC 7742 (16
  DDR4-3200 channels, 410 GB/s, ~80% in STREAM) 41 GB/s; an 8-GPU H100 node's STREAM Triad of
  486.7 GB/s (same benchmark) 61 GB/s. Host memory per GPU: DGX A100 (320 GB) 1 TB and DGX A100
  (640 GB) / DGX H100 2 TB of DRAM, over 8 GPUs: 128 GiB (a100-40gb), 256 GiB (the others).
"""
from __future__ import annotations

from ..cluster import ClusterSpec, DeviceSpec, LinkSpec

GiB = 2**30
GB = 1e9
SUSTAINED = 755 / 834  # MSMF / MAMF of the H200: the clock a saturated, power-limited chip keeps

_A100 = dict(peak_flops={"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}, sm_count=108,
             attention_efficiency=(0.60 * SUSTAINED, 0.52 * SUSTAINED), memory_efficiency=0.87,
             kernel_launch_s=3e-6)
_H100 = dict(peak_flops={"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "tf32": 494.5e12, "fp32": 67e12},
             sm_count=132, attention_efficiency=(0.33 * SUSTAINED, 0.29 * SUSTAINED), memory_efficiency=0.87,
             kernel_launch_s=3e-6)

DEVICES: dict[str, DeviceSpec] = {
    "a100-40gb": DeviceSpec(name="a100-40gb", memory_bytes=40 * GiB, memory_bandwidth=1555 * GB, **_A100),
    "a100-80gb": DeviceSpec(name="a100-80gb", memory_bytes=80 * GiB, memory_bandwidth=2039 * GB, **_A100),
    "h100-80gb": DeviceSpec(name="h100-80gb", memory_bytes=80 * GiB, memory_bandwidth=3350 * GB, **_H100),
    "h200": DeviceSpec(name="h200", memory_bytes=141 * GB, memory_bandwidth=4800 * GB, **_H100),
}

# Sustained large-GEMM fraction of peak (see the module docstring).
MATMUL_EFFICIENCY = {"a100-40gb": 0.869 * SUSTAINED, "a100-80gb": 0.869 * SUSTAINED,
                     "h100-80gb": 0.803 * SUSTAINED, "h200": 0.803 * SUSTAINED}

_NVLINK3, _NVLINK4 = LinkSpec(bandwidth=235 * GB, latency=3.4e-6), LinkSpec(bandwidth=0.8 * 450 * GB, latency=3.4e-6)
_HDR, _NDR = LinkSpec(bandwidth=0.9 * 25 * GB, latency=9.6e-6), LinkSpec(bandwidth=0.9 * 50 * GB, latency=9.6e-6)
# (intra-node link, inter-node link, PCIe host link, host DRAM bandwidth and bytes per GPU).
LINKS: dict[str, tuple[LinkSpec, LinkSpec, float, float, float]] = {
    "a100-40gb": (_NVLINK3, _HDR, 25 * GB, 41 * GB, 128 * GiB),
    "a100-80gb": (_NVLINK3, _HDR, 25 * GB, 41 * GB, 256 * GiB),
    "h100-80gb": (_NVLINK4, _NDR, 50 * GB, 61 * GB, 256 * GiB),
    "h200": (_NVLINK4, _NDR, 50 * GB, 61 * GB, 256 * GiB),
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
    intra, inter, host, host_memory, host_bytes = LINKS[gpu]
    nodes = max(1, num_gpus // gpus_per_node)
    per_node = min(num_gpus, gpus_per_node)
    return ClusterSpec(name=f"{nodes}x{per_node} {gpu}", num_nodes=nodes, gpus_per_node=per_node,
                       device=DEVICES[gpu], intra_node=intra, inter_node=inter,
                       compute_efficiency=MATMUL_EFFICIENCY[gpu], host_bandwidth=host,
                       host_memory_bandwidth=host_memory, host_memory_bytes=host_bytes)


def local_cpu_cluster(num_ranks: int) -> ClusterSpec:
    """This machine as a 'cluster' of `num_ranks` CPU processes on gloo (for local training).

    Figures are rough for a 2-core CI machine; `tessera profile hardware` measures real ones. A
    CPU has no GEMM description (`sm_count` 0): compute is priced by FLOPs at the flat efficiency
    and, once profiled, by the measured layers. No allocator fragmentation term (CPU tensors come
    from the system allocator; the profile measures what the process holds).
    """
    device = DeviceSpec(name="cpu", memory_bytes=4 * GiB, memory_bandwidth=10 * GB,
                        peak_flops={"fp32": 50e9, "bf16": 1e9}, reserved_bytes=0.0)
    link = LinkSpec(bandwidth=1 * GB, latency=50e-6)
    return ClusterSpec(name=f"local cpu x{num_ranks}", num_nodes=1, gpus_per_node=num_ranks,
                       device=device, intra_node=link, inter_node=link, compute_efficiency=0.5,
                       overlap_slowdown=1.0, host_bandwidth=10 * GB, host_memory_bandwidth=10 * GB,
                       host_memory_bytes=4 * GiB,
                       collective_latency=0.0, fragmentation=0.0)
