"""A quick measured profile of this CPU machine for planning a run on it, cached.

`tessera train` on a CPU plans from what this machine does, not from made-up figures: the
hardware profile (`measure.hardware`: collectives, matmul rate, overlap, memory) and the model
profile (`measure.model`: every layer kind at a few sizes, and its tensor-parallel, Ulysses and
ZeRO-3 variants over pairs of ranks) are measured once, with as many ranks as the run has, all
computing at once (ranks sharing cores are measured sharing them), and kept under
`$TESSERA_CACHE_DIR/profiles/<machine>/`. The machine key covers the host, its CPU model and
usable cores, the threads per rank and the torch version; the model profile's key adds the
model's architecture. A planned step then predicts the measured one within the machine's own
noise, and MFU is taken against the measured matmul rate.

    python -m torch.distributed.run --nproc-per-node N -m tessera.profile.measure.quick \\
        --model MODEL_JSON --cluster-out cluster.json --model-out model-profile.json

(what `quick_profile` launches outside torchrun; under torchrun it measures in the running ranks).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ...errors import TesseraError

log = logging.getLogger(__name__)

HARDWARE_REPS = 3
MODEL_REPS = 3


@dataclass
class QuickProfile:
    cluster: object  # ClusterSpec
    model_profile: object  # ModelProfile
    note: str


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(world: int) -> str:
    """Identifies what a profile measured: host, CPU, usable cores, ranks and threads, torch."""
    import torch

    from ...runtime.affinity import host_cores

    threads = os.environ.get("OMP_NUM_THREADS") or ("1" if world > 1 else "default")
    parts = [platform.node(), _cpu_model(), host_cores(), world, threads, torch.__version__]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def profile_paths(model, world: int) -> tuple[Path, Path]:
    """(cluster JSON, model profile JSON) of this machine at `world` ranks, for `model` (a ModelSpec)."""
    from ...runtime.data import cache_dir
    from ..fit import PROFILE_VERSION

    folder = cache_dir() / "profiles" / f"{machine_key(world)}-w{world}"
    arch = hashlib.sha256((model.config.model_dump_json() + str(PROFILE_VERSION)).encode()).hexdigest()[:12]
    return folder / "cluster.json", folder / f"model-{model.name}-{arch}.json"


def _load(cluster_path: Path, model_path: Path, model, world: int, how: str) -> QuickProfile:
    from ..apply import load_cluster_profile, load_model_profile

    cluster = load_cluster_profile(cluster_path, expect_gpus=world)
    profile = load_model_profile(model_path)
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(model_path.stat().st_mtime))
    return QuickProfile(cluster, profile, f"this machine as measured {how} at {world} ranks ({when}; "
                                          f"cached in {model_path.parent}, --cluster measure measures again)")


def quick_profile(model, world: int, under_torchrun: bool, again: bool = False) -> QuickProfile:
    """This machine's cluster and `model`'s profile at `world` ranks: from the cache, else measured
    (outside torchrun by launching it; under torchrun by the running ranks, a collective call)."""
    cluster_path, model_path = profile_paths(model, world)
    if not again and cluster_path.is_file() and model_path.is_file():
        return _load(cluster_path, model_path, model, world, "before")
    cluster_path.parent.mkdir(parents=True, exist_ok=True)
    todo_cluster = again or not cluster_path.is_file()
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if rank0:
        print(f"measuring this machine once at {world} rank{'s' * (world > 1)} to plan for it (hardware, then "
              f"{model.name}'s layers; one to three minutes; cached in {cluster_path.parent})", flush=True)
    start = time.perf_counter()
    if under_torchrun:
        measure_here(model.config, cluster_path if todo_cluster else None, model_path)
    else:
        _launch(model, world, cluster_path if todo_cluster else None, model_path)
    if rank0:
        print(f"measured in {time.perf_counter() - start:.0f} s", flush=True)
    return _load(cluster_path, model_path, model, world, "now")


def _launch(model, world: int, cluster_path: Path | None, model_path: Path) -> None:
    config = model_path.with_suffix(".config.json")
    config.write_text(model.config.model_dump_json())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "tessera.profile.measure.quick", "--model", str(config), "--model-out", str(model_path)]
    if cluster_path is not None:
        cmd += ["--cluster-out", str(cluster_path)]
    env = dict(os.environ)
    if world > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # as the training ranks run
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    config.unlink(missing_ok=True)
    if proc.returncode != 0:
        tail = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()][-1:] or ["no output"]
        raise TesseraError(f"measuring this machine failed (exit {proc.returncode}: {tail[0].strip()}); "
                           "plan with --cluster builtin instead")


def measure_here(config, cluster_path: Path | None, model_path: Path) -> None:
    """Measure under torchrun, every rank taking part; rank 0 writes the files."""
    import torch.distributed as dist

    from ...spec.model import ModelSpec
    from ..apply import load_cluster_profile, write_atomic
    from .hardware import HardwareOptions, detect_environment, profile_hardware
    from .model import profile_model

    env = detect_environment()  # starts the process group
    if cluster_path is not None:
        cluster = profile_hardware(HardwareOptions(reps=HARDWARE_REPS), env=env)
        if env.rank == 0:
            write_atomic(cluster_path, cluster.model_dump_json(indent=1))
    dist.barrier()
    cluster = cluster if cluster_path is not None else load_cluster_profile(model_path.parent / "cluster.json")
    reference = cluster.peak("fp32") * cluster.compute_efficiency
    profile = profile_model(ModelSpec.from_config(config), reps=MODEL_REPS, dtype="fp32", reference_flops=reference)
    if env.rank == 0:
        write_atomic(model_path, profile.model_dump_json(indent=1))
    dist.barrier()


def main(argv: list[str] | None = None) -> int:
    from ...spec.model import TransformerConfig

    p = argparse.ArgumentParser(prog="python -m tessera.profile.measure.quick", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the model's TransformerConfig JSON")
    p.add_argument("--model-out", required=True, help="where the model profile goes")
    p.add_argument("--cluster-out", default=None, help="where the cluster profile goes (default: measure none; "
                                                       "read cluster.json beside the model profile)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    config = TransformerConfig.model_validate_json(Path(args.model).read_text())
    cluster = Path(args.cluster_out) if args.cluster_out else None
    try:
        measure_here(config, cluster, Path(args.model_out))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
