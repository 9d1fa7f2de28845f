"""Measure the hardware this job runs on and describe it as a `ClusterSpec`.

Run under `torchrun` (every rank takes part; rank 0 gets the result). Device and backend come from
the environment: CUDA + NCCL when a GPU is visible, otherwise CPU + gloo.

What is measured (median, or min, of `reps` timed repetitions after one warm-up, each counting
the slowest rank):
- collectives (all_reduce, all_gather, reduce_scatter, all_to_all, p2p) per group size 2, 4, …,
  world and per span: `intra_node` groups are consecutive ranks of one node, `inter_node` groups
  take one rank per node (multi-node only) or the whole world. All disjoint groups of a size run
  at once, as the ranks of a real job do. Message sizes grow by 4x from `min_bytes` to `max_bytes`
  and mean what `tessera.cost.comm` means: the full buffer for all_reduce, the gathered size for
  all_gather / reduce_scatter, the bytes each rank sends for all_to_all, one message for p2p
  (half a ping-pong round trip).
- matmul FLOP/s per dtype: square matmuls of side `matmul_size`, on every rank at once, timed
  at many moments of the profile (`MatmulSamples`: a round before the collectives, one after
  each collective curve, `reps` at the end; the statistic is over all of them), so that a burst
  of load on a shared machine moves a few samples rather than the rate. On the 2-core CI machine
  profiles minutes apart timed 5 matmuls back to back at 4 ranks as 31.0 to 45.6 GFLOP/s (a
  model profile taken at 2 ranks and applied to 4 scales every layer by that rate); three in a
  row with the samples spread read 36.6 to 45.8: the machine's own drift over minutes remains.
- overlap slowdown: how much slower compute and all-reduces finish together than the cost model's
  perfect overlap (see `measure_overlap_slowdown`).
- oversubscription: ranks x threads per core on this node (CPU; see `ClusterSpec.oversubscription`).
- device memory; memory bandwidth as the AdamW update achieves it (the only use the cost model
  makes of it); host bandwidth (pinned copies on CUDA, a plain copy on CPU).

The curves, rates and sizes are then turned into the `ClusterSpec` by `tessera.profile.fit_hardware`
(no torch): links fitted to the alpha-beta model, peak and efficiency from the matmul rates.
"""
from __future__ import annotations

import logging
import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...spec.cluster import ClusterSpec, CollectiveCurve, DeviceSpec, LinkSpec
from ...spec.presets.clusters import DEVICES
from ..fit import summarize
from ..fit_hardware import device_from_rates, fit_link, monotone

log = logging.getLogger(__name__)

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

Progress = Callable[[str, int], None]  # (what is being measured, units done since last call)


@dataclass
class HardwareOptions:
    min_bytes: int = 4 * 1024
    max_bytes: int | None = None  # default: 16 MiB on CPU, 1 GiB on CUDA
    reps: int = 5
    matmul_size: int | None = None  # default: 1024 on CPU, 8192 on CUDA
    dtypes: Sequence[str] | None = None  # default: fp32, bf16 on CPU; fp32, tf32, bf16, fp16 on CUDA
    collectives: Sequence[str] = COLLECTIVES
    name: str | None = None
    statistic: str = "median"  # or "min" (see tessera.profile.fit.STATISTICS)


@dataclass
class Environment:
    """Where this process runs: device, backend and the node layout of the job."""

    device: torch.device
    backend: str
    rank: int
    world: int
    local_world: int
    num_nodes: int = field(init=False)

    def __post_init__(self) -> None:
        if self.world % self.local_world:
            raise ValueError(f"world size {self.world} is not a multiple of the {self.local_world} ranks per node")
        self.num_nodes = self.world // self.local_world


def detect_environment() -> Environment:
    """Device and backend from the environment; initialises the default process group if needed."""
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise ValueError("the hardware profile needs torchrun (RANK/WORLD_SIZE are not set)")
        dist.init_process_group(backend)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    world = dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return Environment(device=device, backend=dist.get_backend(), rank=dist.get_rank(), world=world,
                       local_world=local_world)


def message_sizes(min_bytes: int, max_bytes: int) -> list[int]:
    """Message sizes growing 4x from `min_bytes` to `max_bytes` (inclusive)."""
    if min_bytes <= 0 or max_bytes < min_bytes:
        raise ValueError(f"message sizes need 0 < --min-bytes <= --max-bytes (got {min_bytes}, {max_bytes})")
    sizes, n = [], min_bytes
    while n <= max_bytes:
        sizes.append(n)
        n *= 4
    return sizes


def group_sizes(n: int) -> list[int]:
    """2, 4, 8, … up to n, plus n itself when it is not a power of two."""
    sizes, g = [], 2
    while g <= n:
        sizes.append(g)
        g *= 2
    if n >= 2 and n not in sizes:
        sizes.append(n)
    return sizes


def group_layouts(env: Environment) -> list[tuple[str, int, list[list[int]]]]:
    """(span, group size, disjoint rank groups that run at once) for every measured layout."""
    layouts = []
    L, N = env.local_world, env.num_nodes
    for g in group_sizes(L):
        groups = [[node * L + i * g + j for j in range(g)] for node in range(N) for i in range(L // g)]
        layouts.append(("intra_node", g, groups))
    if N > 1:
        for g in group_sizes(N):
            groups = [[(k * g + j) * L + lr for j in range(g)] for k in range(N // g) for lr in range(L)]
            layouts.append(("inter_node", g, groups))
        if L > 1:
            layouts.append(("inter_node", env.world, [list(range(env.world))]))
    return layouts


def _sync(env: Environment) -> None:
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)


def _slowest(env: Environment, seconds: float) -> float:
    """The largest of every rank's `seconds` (a step waits for its slowest rank)."""
    t = torch.tensor([seconds], dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _mean(env: Environment, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=env.device)
    dist.all_reduce(t)
    return float(t.item()) / env.world


class _CollectiveBench:
    """Buffers and the call for one collective on one group, sized for a message of n bytes."""

    def __init__(self, env: Environment, collective: str, group, members: list[int], nbytes: int):
        self.env, self.collective, self.group, self.members = env, collective, group, members
        p = len(members)
        numel = max(p, nbytes // 4 // p * p)
        dev = env.device
        self.full = torch.ones(numel, dtype=torch.float32, device=dev)
        self.shard = torch.ones(numel // p, dtype=torch.float32, device=dev)
        self.out = torch.empty(numel, dtype=torch.float32, device=dev, memory_format=torch.contiguous_format)
        me = members.index(env.rank)
        self.peer = members[me ^ 1] if collective == "p2p" else None
        self.leader = me % 2 == 0

    def run(self) -> None:
        c, g = self.collective, self.group
        if c == "all_reduce":
            dist.all_reduce(self.full, group=g)
        elif c == "all_gather":
            dist.all_gather_into_tensor(self.out, self.shard, group=g)
        elif c == "reduce_scatter":
            dist.reduce_scatter_tensor(self.shard, self.full, group=g)
        elif c == "all_to_all":
            dist.all_to_all_single(self.out, self.full, group=g)
        elif self.leader:  # p2p ping-pong: send then receive back
            dist.send(self.full, self.peer, group=g)
            dist.recv(self.full, self.peer, group=g)
        else:
            dist.recv(self.full, self.peer, group=g)
            dist.send(self.full, self.peer, group=g)


def _time_once(env: Environment, fn: Callable[[], None], barrier_group=None) -> float:
    """This rank's seconds of one run of `fn`, started after a barrier of `barrier_group`."""
    dist.barrier(group=barrier_group)
    _sync(env)
    t0 = time.perf_counter()
    fn()
    _sync(env)
    return time.perf_counter() - t0


def _time_reps(env: Environment, fn: Callable[[], None], reps: int, barrier_group=None,
               statistic: str = "median") -> float:
    """Median (or min) over `reps` runs, after one warm-up, of the slowest rank's seconds of `fn`.

    Each run starts after a barrier; it lasts until the last rank of the group is done, so ranks
    that share cores are measured sharing them (a minimum over one rank's runs would pick the runs
    in which it happened to be scheduled first).
    """
    fn()
    _sync(env)
    times = [_time_once(env, fn, barrier_group) for _ in range(reps)]
    slowest = torch.tensor(times, dtype=torch.float64, device=env.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=barrier_group)
    return summarize(slowest.tolist(), statistic)


def measure_collectives(env: Environment, sizes: Sequence[int], reps: int, collectives: Sequence[str],
                        progress: Progress | None = None, statistic: str = "median",
                        between: Callable[[], None] | None = None) -> list[CollectiveCurve]:
    """One curve per collective, group size and span; `between()` runs after each (every rank)."""
    curves = []
    for span, g, groups in group_layouts(env):
        # Every rank creates every group, in the same order (new_group is collective).
        handles = [dist.new_group(members) for members in groups]
        mine = next(((h, m) for h, m in zip(handles, groups) if env.rank in m), None)
        for collective in collectives:
            if collective == "p2p" and g != 2:
                continue
            seconds = []
            for n in sizes:
                t = 0.0
                if mine is not None:
                    bench = _CollectiveBench(env, collective, mine[0], mine[1], n)
                    # Small messages are cheap and jittery: time them more often.
                    r = reps * 3 if n < (1 << 20) else reps
                    t = _time_reps(env, bench.run, r, barrier_group=mine[0], statistic=statistic)
                    if collective == "p2p":
                        t /= 2.0  # half a round trip
                seconds.append(_slowest(env, t))
            curves.append(CollectiveCurve(collective=collective, span=span, group_size=g,
                                          message_bytes=tuple(float(n) for n in sizes),
                                          seconds=tuple(monotone(seconds))))
            log.debug("%s %s p=%d: %s", collective, span, g, seconds)
            if between:
                between()
            if progress:
                progress(f"{collective} {span} x{g}", 1)
        for h in handles:
            dist.destroy_process_group(h)
    return curves


def _matmul_operands(env: Environment, dtype: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=env.device).manual_seed(env.rank)
    a = torch.randn(n, n, generator=gen, device=env.device).to(_DTYPES[dtype])
    b = torch.randn(n, n, generator=gen, device=env.device).to(_DTYPES[dtype])
    return a, b


def _set_tf32(env: Environment, on: bool) -> None:
    if env.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = on


class MatmulSamples:
    """Matmul timings per dtype taken at several moments (module docstring): `sample()` times
    each dtype's n x n x n matmul once, every rank at once, the slowest rank's seconds;
    `flops(statistic)` is the achieved FLOP/s of the statistic over all samples."""

    def __init__(self, env: Environment, sides: dict[str, int]):
        self.env, self.sides = env, sides
        self.operands = {d: _matmul_operands(env, d, n) for d, n in sides.items()}
        self.times: dict[str, list[float]] = {d: [] for d in sides}
        for d in sides:  # warm-up
            self._run(d)

    def _run(self, dtype: str) -> None:
        _set_tf32(self.env, dtype == "tf32")
        torch.mm(*self.operands[dtype])
        _set_tf32(self.env, False)

    def sample(self, rounds: int = 1) -> None:
        for _ in range(rounds):
            for d in self.sides:
                self.times[d].append(_slowest(self.env, _time_once(self.env, lambda: self._run(d))))

    def flops(self, statistic: str = "median") -> dict[str, float]:
        return {d: 2.0 * self.sides[d] ** 3 / summarize(t, statistic) for d, t in self.times.items()}


def measure_overlap_slowdown(env: Environment, n: int, nbytes: int, reps: int) -> float:
    """The cost model's `overlap_slowdown` s, fitted to compute and communication run together.

    With c the seconds of some matmuls alone, x those of some all-reduces alone and T the seconds
    until both are done when launched together, the cost model has
    T = c + (s - 1) min(c, x) + max(0, x - c), so s = 1 + (T - c - max(0, x - c)) / min(c, x):
    about 1.1 on a GPU (NCCL kernels take some SMs), near 2 where the same cores must do both (a
    CPU: gloo's threads share the cores of the compute, so overlapping saves nothing). Measuring
    only the matmuls' slowdown would miss the second case: the matmuls keep their speed while the
    collectives wait for them."""
    a, b = _matmul_operands(env, "fp32", n)
    buf = torch.ones(max(env.world, nbytes // 4), dtype=torch.float32, device=env.device)
    k = 3  # matmuls per timing

    def matmuls() -> None:
        for _ in range(k):
            torch.mm(a, b)

    alone = _time_reps(env, matmuls, reps)
    t_ar = _time_reps(env, lambda: dist.all_reduce(buf), 1)
    # About as much communication as compute (a bounded queue: gloo does not like thousands of
    # pending ops). Every rank must issue the same number of all-reduces: agree on the largest count.
    copies = int(_slowest(env, min(32, max(1, round(alone / max(t_ar, 1e-6))))))

    def all_reduces() -> None:
        for w in [dist.all_reduce(buf, async_op=True) for _ in range(copies)]:
            w.wait()

    comm = _time_reps(env, all_reduces, reps)
    both = []
    for _ in range(reps):
        dist.barrier()
        _sync(env)
        t0 = time.perf_counter()
        works = [dist.all_reduce(buf, async_op=True) for _ in range(copies)]
        matmuls()
        for w in works:
            w.wait()
        _sync(env)
        both.append(_slowest(env, time.perf_counter() - t0))
    together = statistics.median(both)
    s = 1.0 + (together - alone - max(0.0, comm - alone)) / min(alone, comm)
    return float(min(max(s, 1.0), 3.0))


def measure_optimizer_bandwidth(env: Environment, statistic: str = "median") -> float:
    """Bytes/s the update moves, every rank at once: 28 bytes per fp32 parameter (AdamW reads p, g,
    m, v and writes p, m, v) over the time of the runtime's update (gradient clipping, then
    `optimizer.step()` of the optimizer the runtime builds).

    This is what `ClusterSpec.device.memory_bandwidth` is used for in the cost model (the
    memory-bound optimizer update), so the profile stores this achieved figure there: a CPU's
    unfused AdamW runs several passes over memory and reaches a fraction of a plain copy's rate.
    """
    from ...runtime.optim import OptimConfig, build_optimizer, clip_grad_norm_

    numel = (64 << 20) if env.device.type == "cuda" else (4 << 20)
    # 8 matrices of numel / 8 elements each (matrices: the runtime decays them, as a model's).
    params = [torch.nn.Parameter(torch.randn(numel // 8 // 256, 256, device=env.device)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    cfg = OptimConfig()
    opt = build_optimizer(params, cfg)

    def update() -> None:
        clip_grad_norm_(params, cfg.grad_clip)
        opt.step()

    t = _time_reps(env, update, 3, statistic=statistic)
    return _mean(env, 28.0 * numel / t)


def measure_memory(env: Environment, statistic: str = "median") -> tuple[float, float, float, float]:
    """(device memory bytes, achieved memory bandwidth of the optimizer update B/s, host bandwidth
    B/s, reserved bytes) of this rank."""
    nbytes = 1 << 30 if env.device.type == "cuda" else 64 << 20
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=env.device).fill_(1.0)
    mem_bw = measure_optimizer_bandwidth(env, statistic)
    if env.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(env.device)
        reserved = float(total - free - torch.cuda.memory_reserved(env.device))
        host = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=True)
        t_h2d = _time_reps(env, lambda: src.copy_(host, non_blocking=True), 3, statistic=statistic)
        host_bw = _mean(env, nbytes / t_h2d)
        del host
        memory = float(total)
    else:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / env.local_world
        dst = torch.empty_like(src)
        host_bw = _mean(env, 2.0 * nbytes / _time_reps(env, lambda: dst.copy_(src), 3, statistic=statistic))
        reserved = 0.0
    del src
    return memory, mem_bw, host_bw, max(0.0, reserved)


def _known_device(env: Environment) -> DeviceSpec | None:
    if env.device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(env.device).lower()
    total = torch.cuda.get_device_properties(env.device).total_memory
    for key, spec in DEVICES.items():
        family = key.split("-")[0]
        if family in name and abs(spec.memory_bytes - total) < 0.2 * spec.memory_bytes:
            return spec
    return None


def build_device(env: Environment, measured: dict[str, float], memory: float, mem_bw: float,
                 reserved: float) -> tuple[DeviceSpec, float]:
    """The DeviceSpec and compute efficiency from measured matmul rates (`fit_hardware.device_from_rates`)."""
    name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"
    ref = "bf16" if env.device.type == "cuda" else "fp32"
    return device_from_rates(name, measured, ref, _known_device(env), memory, mem_bw, reserved)


def profile_hardware(options: HardwareOptions | None = None, progress: Progress | None = None,
                     env: Environment | None = None) -> ClusterSpec:
    """Measure everything (a collective call: every rank calls it; all get the same spec).

    `planned_units(env, options)` tells how many progress units it reports.
    """
    o = options or HardwareOptions()
    env = env or detect_environment()
    cuda = env.device.type == "cuda"
    max_bytes = o.max_bytes or ((1 << 30) if cuda else (16 << 20))
    sizes = message_sizes(o.min_bytes, max_bytes)
    n = o.matmul_size or (8192 if cuda else 1024)
    dtypes = list(o.dtypes or (("fp32", "tf32", "bf16", "fp16") if cuda else ("fp32", "bf16")))
    unknown = [c for c in o.collectives if c not in COLLECTIVES]
    if unknown:
        raise ValueError(f"unknown collective(s) {', '.join(unknown)}; known: {', '.join(COLLECTIVES)}")

    # A slow dtype (bf16 on most CPUs) gets a smaller matrix so that it stays quick.
    matmuls = MatmulSamples(env, {d: n if cuda or d == "fp32" else max(128, n // 4) for d in dtypes})
    matmuls.sample()
    with warnings.catch_warnings():  # the *_into_tensor names are deprecated in newer torch, kept for 2.11
        warnings.simplefilter("ignore", FutureWarning)
        curves = (measure_collectives(env, sizes, o.reps, o.collectives, progress, o.statistic, between=matmuls.sample)
                  if env.world > 1 else [])
    matmuls.sample(max(3, o.reps))
    measured = matmuls.flops(o.statistic)
    del matmuls
    if progress:
        for d in dtypes:
            progress(f"matmul {d}", 1)
    slowdown = 1.0
    if env.world > 1:
        # Gradient-bucket-sized messages (DDP buckets are 25 MB), within what was asked for.
        overlap_bytes = min(max_bytes, 32 << 20) if cuda else max(1 << 20, min(max_bytes, 16 << 20))
        slowdown = measure_overlap_slowdown(env, n if cuda else n // 2, overlap_bytes, max(3, o.reps // 2))
    if progress:
        progress("overlap", 1)
    memory, mem_bw, host_bw, reserved = measure_memory(env, o.statistic)
    if progress:
        progress("memory", 1)

    device, efficiency = build_device(env, measured, memory, mem_bw, reserved)
    intra = fit_link([c for c in curves if c.span == "intra_node"])
    inter = fit_link([c for c in curves if c.span == "inter_node"])
    intra = intra or inter or LinkSpec(bandwidth=mem_bw, latency=0.0)
    inter = inter or intra
    name = o.name or f"profiled {env.num_nodes}x{env.local_world} {device.name} ({env.backend})"
    # On a CPU the "host" an offloaded optimizer lives in is the same memory: its step runs at the
    # measured bandwidth, in the same bytes (not a GPU node's DRAM).
    host = {} if cuda else dict(host_memory_bandwidth=mem_bw, host_memory_bytes=memory)
    cluster = ClusterSpec(name=name, num_nodes=env.num_nodes, gpus_per_node=env.local_world, device=device,
                          intra_node=intra, inter_node=inter, compute_efficiency=efficiency,
                          overlap_slowdown=slowdown, host_bandwidth=host_bw, collectives=tuple(curves),
                          oversubscription=oversubscription(env, cuda),
                          # The fitted link latency is all the fixed cost; no caching allocator on CPU.
                          collective_latency=8.4e-6 if cuda else 0.0, fragmentation=0.10 if cuda else 0.0,
                          **host)
    return cluster


def oversubscription(env: Environment, cuda: bool) -> float:
    """Ranks per set of cores they need: this node's ranks x threads each over its usable cores
    (>= 1; 1 on GPUs, whose ranks each own a device)."""
    from ...runtime.affinity import host_cores

    if cuda:
        return 1.0
    return max(1.0, env.local_world * torch.get_num_threads() / host_cores())


def planned_units(env: Environment, options: HardwareOptions | None = None) -> int:
    """How many progress units `profile_hardware` reports (for a progress bar's total)."""
    o = options or HardwareOptions()
    units = 0
    if env.world > 1:
        for _, g, _ in group_layouts(env):
            units += sum(1 for c in o.collectives if c != "p2p" or g == 2)
    cuda = env.device.type == "cuda"
    units += len(o.dtypes or (("fp32", "tf32", "bf16", "fp16") if cuda else ("fp32", "bf16")))
    return units + 2
