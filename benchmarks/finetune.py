"""`--init-from` at 4 ranks ZeRO-3: load time and peak host memory per rank, vs every rank loading the full state dict.

    python benchmarks/finetune.py                  # llama-1b (1.1B parameters, 4.4 GB in fp32)
    python benchmarks/finetune.py --model tiny-llama

1. A Hugging Face directory is written offline into a temporary directory: config.json and random
   fp32 weights (seeded, per tensor) in ~1 GB safetensors shards with an index.
2. `--init-from` (torchrun, 4 ranks): each rank builds the `Trainer` for a ZeRO-3 plan (dp=4) on
   the meta device and reads only its shards from the files (`models/hf_load.py`).
3. The usual way (torchrun, 4 ranks): each rank reads the whole state dict into its memory (each
   file read and deserialised, renamed to Tessera's names) and copies its shards out of it. To fit a shared machine the ranks
   take turns (a barrier between them), so each rank's figures are its own; the process
   groups and meshes are made before, so nothing waits on a rank out of its turn.
Then every rank's shards from (2)'s loader are compared, bit for bit, with (3)'s.

Peak host memory is the process's resident-set high-water mark (`ru_maxrss`, torch and the
process group included); load time is the loader's own time (`load_s`), beside the whole
`Trainer` build. Timings on a loaded shared machine are indicative only; bytes and exactness are not.
Last line: `summary: init_from_exact=<0|1> load_s=<x> peak_host_gib_per_rank=<y> full_load_peak_gib_per_rank=<z>`.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORLD = 4
GIB = 2**30


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


# ----------------------------------------------------------------------------- the checkpoint

def write_checkpoint(model_name: str, directory: Path, shard_bytes: int = 10**9, seed: int = 0) -> int:
    """A random fp32 HF checkpoint of the preset `model_name`; returns its bytes."""
    import torch
    from safetensors.torch import save_file

    from tessera.models.hf import INDEX_FILE, tessera_to_hf_state_dict
    from tessera.models.transformer import Transformer
    from tessera.spec.hf_config import to_hf_config
    from tessera.spec.presets import get_model_config

    cfg = get_model_config(model_name)
    with torch.device("meta"):
        shapes = [(k, v.shape) for k, v in Transformer(cfg).state_dict().items()
                  if not (cfg.tie_embeddings and k == "output.weight")]
    gen = torch.Generator().manual_seed(seed)
    directory.mkdir(parents=True, exist_ok=True)
    groups: list[list[tuple[str, torch.Size]]] = [[]]
    for name, shape in shapes:
        if groups[-1] and sum(s.numel() * 4 for _, s in groups[-1]) + shape.numel() * 4 > shard_bytes:
            groups.append([])
        groups[-1].append((name, shape))
    weight_map, total = {}, 0
    for i, group in enumerate(groups, 1):
        tensors = {n: (torch.randn(s, generator=gen) * 0.02 if len(s) > 1 else torch.ones(s)) for n, s in group}
        hf_tensors = {k: v.contiguous() for k, v in tessera_to_hf_state_dict(tensors, cfg).items()}
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file(hf_tensors, str(directory / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in hf_tensors})
        total += sum(t.numel() * 4 for t in hf_tensors.values())
        del tensors, hf_tensors
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(to_hf_config(cfg), indent=2))
    return total


def zero3_plan(hf_dir: Path):
    from tessera.models.hf_load import hf_model_config
    from tessera.plan import LayerStrategy
    from tessera.search import manual_plan
    from tessera.spec.model import ModelSpec
    from tessera.spec.presets import local_cpu_cluster
    from tessera.spec.workload import Workload

    model = ModelSpec.from_config(hf_model_config(hf_dir))
    plan = manual_plan(model, local_cpu_cluster(WORLD), Workload(global_batch=WORLD, seq_len=128, dtype="fp32"),
                       dp=WORLD, micro_batch_size=1, zero=3, name="zero3-dp4")
    assert all(isinstance(s, LayerStrategy) and s.zero == 3 and s.dp == WORLD for s in plan.layers)
    return plan


# ----------------------------------------------------------------------------- the ranks

def worker_init_from(hf_dir: Path, out: Path) -> None:
    """Each rank: the Trainer of a ZeRO-3 plan, built on meta, its shards read from the files."""
    import torch.distributed as dist

    from tessera.models import hf_load
    from tessera.runtime.trainer import TrainConfig, Trainer

    seconds = []
    original = hf_load.load_hf_shards

    def timed(*args, **kwargs):
        stats = original(*args, **kwargs)
        seconds.append(stats.seconds)
        return stats

    hf_load.load_hf_shards = timed  # the loader's own time, beside the whole build
    dist.init_process_group("gloo")
    start = time.perf_counter()
    trainer = Trainer(TrainConfig(plan=zero3_plan(hf_dir), steps=0, synthetic_data=True, init_from=str(hf_dir)))
    build_s = time.perf_counter() - start
    local = sum(p.to_local().numel() * p.to_local().element_size() for p in trainer.params)
    result = {"load_s": sum(seconds), "build_s": build_s, "peak_rss": peak_rss_bytes(), "local_bytes": local}
    (out / f"init_from-{dist.get_rank()}.json").write_text(json.dumps(result))
    trainer.close()
    dist.destroy_process_group()


def worker_full_load(hf_dir: Path, out: Path) -> None:
    """Each rank in turn: the whole state dict in memory, its shards copied out; then exactness."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    from tessera.models import hf
    from tessera.models.hf_load import canonical_name, load_hf_shards
    from tessera.models.transformer import build_model
    from tessera.runtime.mesh import ParallelDims
    from tessera.runtime.parallelize import parallelize

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    plan = zero3_plan(hf_dir)
    cfg = plan.model.config
    dims = ParallelDims.from_plan(plan, WORLD, "cpu")

    def sharded():
        return parallelize(build_model(cfg, device="meta"), plan, dims, rank).module

    mine, reference = sharded(), sharded()  # meshes and groups made by all ranks, before the turns
    dist.barrier()
    result = {}
    for turn in range(WORLD):
        if turn == rank:
            start = time.perf_counter()
            mine.to_empty(device="cpu")
            full = hf.hf_to_tessera_state_dict(read_whole(hf_dir), cfg)  # the whole model, in memory
            with torch.no_grad():
                for name, p in mine.named_parameters():
                    value = full[canonical_name(name)]
                    p.to_local().copy_(distribute_tensor(value, p.device_mesh, p.placements,
                                                         src_data_rank=None).to_local())
            result = {"load_s": time.perf_counter() - start, "peak_rss": peak_rss_bytes()}
            del full
        dist.barrier()
    load_hf_shards(reference, hf_dir, cfg, "cpu")
    exact = all(torch.equal(a.to_local(), b.to_local())
                for a, b in zip(mine.parameters(), reference.parameters(), strict=True))
    flag = torch.tensor([int(exact)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    result["exact"] = int(flag)
    (out / f"full-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def read_whole(hf_dir: Path) -> dict:
    """Every tensor of the checkpoint in this process's memory (each file read, then deserialised)."""
    from safetensors.torch import load

    files = sorted(set(json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"].values()))
    out = {}
    for f in files:
        out.update(load((hf_dir / f).read_bytes()))
    return out


def launch(mode: str, hf_dir: Path, out: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           __file__, "--worker", mode, "--hf-dir", str(hf_dir), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{mode} run failed:\n{(proc.stdout + proc.stderr)[-4000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-1b", help="model preset to write as the checkpoint (default llama-1b)")
    p.add_argument("--worker", choices=("init_from", "full"), help=argparse.SUPPRESS)
    p.add_argument("--hf-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        (worker_init_from if args.worker == "init_from" else worker_full_load)(args.hf_dir, args.out)
        return

    from rich.console import Console
    from rich.table import Table

    from tessera.spec.model import ModelSpec
    from tessera.spec.presets import get_model_config

    model_bytes = sum(layer.params for layer in ModelSpec.from_config(get_model_config(args.model)).layers) * 4
    need = model_bytes * 2.5 + WORLD * 0.6 * GIB  # one rank's full state dict and shards, and four processes
    if available_bytes() < need:
        sys.exit(f"needs about {need / GIB:.1f} GiB of free memory, {available_bytes() / GIB:.1f} GiB is available")
    with tempfile.TemporaryDirectory(prefix="tessera-finetune-") as tmp:
        tmp = Path(tmp)
        start = time.perf_counter()
        written = write_checkpoint(args.model, tmp / "hf")
        print(f"wrote a random {args.model} checkpoint ({written / GIB:.2f} GiB fp32) in "
              f"{time.perf_counter() - start:.0f}s", flush=True)
        for mode in ("init_from", "full"):
            launch(mode, tmp / "hf", tmp)
        init = [json.loads((tmp / f"init_from-{r}.json").read_text()) for r in range(WORLD)]
        full = [json.loads((tmp / f"full-{r}.json").read_text()) for r in range(WORLD)]
    table = Table(title=f"{args.model} ({written / GIB:.2f} GiB fp32) at {WORLD} ranks ZeRO-3 (loaded shared machine)")
    for col in ("rank", "init-from load (s)", "init-from build (s)", "init-from peak (GiB)", "local shards (GiB)",
                "full load (s)", "full-load peak (GiB)"):
        table.add_column(col, justify="right")
    for r, (a, b) in enumerate(zip(init, full)):
        table.add_row(str(r), f"{a['load_s']:.2f}", f"{a['build_s']:.2f}", f"{a['peak_rss'] / GIB:.2f}",
                      f"{a['local_bytes'] / GIB:.2f}", f"{b['load_s']:.2f}", f"{b['peak_rss'] / GIB:.2f}")
    Console().print(table)
    exact = min(b["exact"] for b in full)
    load_s = max(a["load_s"] for a in init)
    y = max(a["peak_rss"] for a in init) / GIB
    z = max(b["peak_rss"] for b in full) / GIB
    print(f"summary: init_from_exact={exact} load_s={load_s:.2f} peak_host_gib_per_rank={y:.2f} "
          f"full_load_peak_gib_per_rank={z:.2f}")


if __name__ == "__main__":
    main()
