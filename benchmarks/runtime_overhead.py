"""Step time of Tessera's runtime vs a plain hand-written PyTorch loop, same model and batch.

    python benchmarks/runtime_overhead.py [--nproc 2] [--rounds 6] [--steps 3]

Launches torchrun itself. Each rank holds both a hand-written model (DDP, or FSDP2 `fully_shard`
per block + root) and a Tessera `Trainer` running the equivalent plan (pure data parallel, or
ZeRO-3), built from the same seed. The two alternate in rounds of `--steps` timed steps on the same
batches (so load from other processes hits both alike); the reported time is the median round.
Both loops do forward, cross-entropy, backward, gradient clipping at 1.0, AdamW and zero_grad;
Tessera also averages the loss over ranks for its log. Ends with
`summary: overhead_ddp_pct=<x> overhead_fsdp_pct=<y>`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=3, help="timed steps per round")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    return p.parse_args()


def _launch(args) -> int:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           __file__, *sys.argv[1:]]
    return subprocess.call(cmd, env=env)


def _rank_main(args) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from tessera.models.transformer import build_model
    from tessera.plan import LayerStrategy, PipelineSpec, Plan
    from tessera.runtime.optim import OptimConfig
    from tessera.runtime.trainer import TrainConfig, Trainer
    from tessera.spec.model import ModelSpec, TransformerConfig
    from tessera.spec.presets.clusters import local_cpu_cluster
    from tessera.spec.workload import Workload

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = TransformerConfig(name="bench-llama", vocab_size=4096, hidden=256, num_layers=4, num_heads=8,
                               num_kv_heads=4, ffn_hidden=688, max_seq_len=args.seq_len)
    spec = ModelSpec.from_config(config)
    optim = OptimConfig(lr=1e-4, warmup_steps=1, total_steps=10_000, grad_clip=1.0)
    gen = torch.Generator().manual_seed(0)
    rows = args.global_batch // world
    batches = []
    for _ in range(args.steps):
        seqs = torch.randint(0, config.vocab_size, (args.global_batch, args.seq_len + 1), generator=gen)
        mine = seqs[rank * rows:(rank + 1) * rows]
        batches.append((mine[:, :-1].contiguous(), mine[:, 1:].contiguous()))

    def plan(zero: int) -> Plan:
        s = LayerStrategy(dp=world, zero=zero)
        return Plan(model=spec, cluster=local_cpu_cluster(world),
                    workload=Workload(global_batch=args.global_batch, seq_len=args.seq_len, dtype="fp32"),
                    micro_batch_size=rows, num_micro_batches=1,
                    pipeline=PipelineSpec(stages=((0, len(spec.layers)),)), layers=(s,) * len(spec.layers))

    def hand_written(kind: str):
        model = build_model(config, seed=0)
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model, broadcast_buffers=False)
        else:
            from torch.distributed.fsdp import fully_shard

            for block in model.layers.values():
                fully_shard(block)
            fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas, weight_decay=0.1)

        def step(tokens, labels):
            logits = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return step

    def tessera(zero: int):
        trainer = Trainer(TrainConfig(plan=plan(zero), steps=10_000, optim=optim, seed=0))
        return trainer.train_step

    def timed(step) -> float:
        dist.barrier()
        start = time.perf_counter()
        for tokens, labels in batches:
            step(tokens, labels)
        dist.barrier()
        return (time.perf_counter() - start) / len(batches)

    results = {}
    for kind, zero in (("ddp", 0), ("fsdp", 3)):
        runners = {"hand-written": hand_written(kind), "tessera": tessera(zero)}
        for run in runners.values():  # warm-up: lazy inits, allocator, first collectives
            timed(run)
        times = {name: [] for name in runners}
        for r in range(args.rounds):
            order = list(runners.items()) if r % 2 == 0 else list(reversed(runners.items()))
            for name, run in order:
                times[name].append(timed(run))
        results[kind] = {name: statistics.median(t) for name, t in times.items()}

    if rank == 0:
        tokens = args.global_batch * args.seq_len
        print(f"\n{config.name}: {spec.num_params / 1e6:.1f}M parameters, global batch {args.global_batch} x "
              f"{args.seq_len} tokens, {world} ranks (gloo, CPU), median of {args.rounds} rounds x {args.steps} steps")
        print(f"{'data parallel':<15}{'loop':<14}{'step (s)':>10}{'tokens/s':>11}{'overhead':>10}")
        overhead = {}
        for kind, res in results.items():
            base = res["hand-written"]
            overhead[kind] = 100 * (res["tessera"] / base - 1)
            for name, t in res.items():
                extra = f"{overhead[kind]:+.1f}%" if name == "tessera" else ""
                print(f"{kind.upper() if kind == 'ddp' else 'FSDP2 (ZeRO-3)':<15}{name:<14}{t:>10.3f}{tokens / t:>11,.0f}{extra:>10}")
        print(f"summary: overhead_ddp_pct={overhead['ddp']:.1f} overhead_fsdp_pct={overhead['fsdp']:.1f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    arguments = _parse()
    if "RANK" in os.environ:
        _rank_main(arguments)
    else:
        sys.exit(_launch(arguments))
