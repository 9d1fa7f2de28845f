"""The machine a run is launched on: what a plan for it is made for, and whether a plan fits it.

- `this_machine()`: CUDA GPUs (their name and memory) or a CPU.
- `check_plan_fits_machine(plan, machine, local_world)`: a plan made for another device, dtype
  or node size is refused in one line saying what it was made for and how to plan for this
  machine (its predicted step time and memory would be about another machine).
- `check_model_fits_host(...)`: a model that cannot train (or be profiled) in this host's memory
  is refused in one line before anything is built.
- `cluster_for_this_machine(...)`: the `ClusterSpec` a plan for this machine is searched on. A GPU
  of a preset kind (`spec.presets.clusters.DEVICES`) gets its preset; a CPU gets a quick measured
  profile (`tessera.profile.measure.quick`: hardware and the model, at the run's rank count, cached per
  machine), or, asked for `builtin`, the rough built-in figures of `local_cpu_cluster`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from ..errors import TesseraError

log = logging.getLogger(__name__)

CPU_DTYPE = "fp32"  # what a CPU computes in (runtime/precision.py: no fast bf16 matmul here)


@dataclass(frozen=True)
class Machine:
    kind: str  # "cuda" or "cpu"
    gpu_name: str | None = None
    gpu_memory: float | None = None  # bytes

    @property
    def default_dtype(self) -> str:
        return "bf16" if self.kind == "cuda" else CPU_DTYPE

    def describe(self) -> str:
        if self.kind == "cpu":
            return "a CPU (no GPU)"
        return f"{self.gpu_name} GPUs ({self.gpu_memory / 2**30:.0f} GiB)"


def this_machine() -> Machine:
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return Machine("cuda", props.name, float(props.total_memory))
    return Machine("cpu")


def preset_gpu(machine: Machine) -> str | None:
    """The preset device name of this GPU (its family in the name, memory within 20%), or None."""
    from ..spec.presets.clusters import DEVICES

    if machine.kind != "cuda":
        return None
    name = machine.gpu_name.lower()
    for key, spec in DEVICES.items():
        if key.split("-")[0] in name and abs(spec.memory_bytes - machine.gpu_memory) < 0.2 * spec.memory_bytes:
            return key
    return None


def _is_cpu(device_name: str) -> bool:
    return device_name.lower().startswith("cpu")


def _same_gpu(device, machine: Machine) -> bool:
    """The plan's device is this GPU: the same preset, or the name a profile of it recorded."""
    name = device.name.lower()
    if name == (machine.gpu_name or "").lower() or name == (preset_gpu(machine) or ""):
        return True
    family = name.split("-")[0].split()[-1] if name.split() else name
    return family in machine.gpu_name.lower() and abs(device.memory_bytes - machine.gpu_memory) < 0.2 * machine.gpu_memory


def check_plan_fits_machine(plan, machine: Machine, local_world: int, source: str = "the plan") -> None:
    """Refuse, in one line, a plan made for another device kind, dtype or node size."""
    device = plan.cluster.device
    made_for = f"{source} was made for {plan.cluster.name} ({plan.workload.dtype})"
    replan = "leave out the plan to plan for this machine, or make it with `tessera plan --cluster` of a profile of it"
    if machine.kind == "cpu":
        if not _is_cpu(device.name):
            raise TesseraError(f"{made_for}, but this machine has no GPU: {replan}")
        if plan.workload.dtype != CPU_DTYPE:
            raise TesseraError(f"{made_for}, but a CPU computes in {CPU_DTYPE}, so its predicted time and memory "
                               f"do not hold here: {replan} (tessera plan --dtype {CPU_DTYPE})")
    elif _is_cpu(device.name):
        raise TesseraError(f"{made_for}, but this machine has {machine.describe()}: {replan}")
    elif not _same_gpu(device, machine):
        raise TesseraError(f"{made_for}, but this machine has {machine.describe()}: {replan}")
    if plan.world_size > local_world and plan.cluster.gpus_per_node != local_world:
        raise TesseraError(f"{source} was made for nodes of {plan.cluster.gpus_per_node} ranks, but "
                           f"{local_world} run on this node: its groups would span other nodes than planned")


GiB = 2**30


def available_memory() -> float:
    """Bytes of host memory available now (MemAvailable on Linux, else the physical memory)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_model_fits_host(model, ranks: int, what: str = "train", element_bytes: int = 4,
                          available: float | None = None) -> None:
    """Refuse in one line what cannot fit this host's memory, before it is built: training needs at
    least 16 bytes per parameter in fp32 (weights, gradients, AdamW's two moments) spread over all
    `ranks`; profiling builds the whole model on every rank (`element_bytes` per parameter)."""
    available = available_memory() if available is None else available
    if what == "profile":
        need, how = model.num_params * element_bytes * ranks, (f"builds the whole model on each of {ranks} "
                                                                f"rank{'s' * (ranks > 1)}")
    else:
        need, how = 16.0 * model.num_params, "needs 16 bytes per parameter (fp32 weights, gradients, AdamW state)"
    if need > available:
        raise TesseraError(f"{model.name} ({model.num_params / 1e9:.2f}B parameters) cannot {what} on this machine: "
                           f"it {how}, about {need / GiB:.1f} GiB, and {available / GiB:.1f} GiB of memory is free; "
                           f"{what} it on the GPUs it is meant for, or pick a smaller model")


@dataclass
class PlanningTarget:
    """What a plan for this machine is searched on, and a line saying where the figures come from."""

    cluster: object  # ClusterSpec
    model_profile: object | None  # ModelProfile, or None
    note: str


def cluster_for_this_machine(choice: str, machine: Machine, world: int, local_world: int, model,
                             under_torchrun: bool, measure=None) -> PlanningTarget:
    """The cluster (and, for a measured CPU, the model profile) to plan `model` for `world` ranks,
    `local_world` per node. `choice`: "auto", "measure" (measure again), "builtin" or a cluster
    JSON path. `measure`: the quick profiler (tests replace it)."""
    from ..spec.presets.clusters import local_cpu_cluster, make_cluster

    if choice not in ("auto", "measure", "builtin"):
        from ..profile.apply import load_cluster_profile

        cluster = load_cluster_profile(choice, expect_gpus=world)
        return PlanningTarget(cluster, None, f"cluster profile {choice}")
    if machine.kind == "cuda":
        gpu = preset_gpu(machine)
        if gpu is None:
            raise TesseraError(f"this machine's {machine.gpu_name} is not a preset GPU: profile it "
                               "(torchrun ... -m tessera profile hardware -o cluster.json) and give --cluster cluster.json")
        return PlanningTarget(make_cluster(gpu, world, local_world), None, f"the {gpu} preset")
    if choice == "builtin":
        return PlanningTarget(local_cpu_cluster(world), None, "rough built-in CPU figures (not measured)")
    from ..profile.measure import quick

    check_model_fits_host(model, world)
    measure = measure or quick.quick_profile
    found = measure(model, world, under_torchrun, again=choice == "measure")
    return PlanningTarget(found.cluster, found.model_profile, found.note)
