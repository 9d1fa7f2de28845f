"""Adaptive sequence parallelism with strategy switching on variable-length batches: predicted step
time against static plans, and the solver's wall time.

Replays batches of document lengths (consecutive batches of `--global-batch` documents, each
truncated to the length cap) on H100 clusters, and compares, all priced by one cost model
(`tessera.adapt.seqcost`, which prices through `tessera.cost`: the model `published_runs.py`
checks against published runs):

- static SP, token split: one Ulysses degree for the whole run, each group taking a contiguous
  run of the batch with an equal share of tokens (what a static system does); the best degree;
- static SP, balanced: one degree for the run, sequences spread over groups by predicted time;
- best degree per batch: the balanced static plan with the best degree chosen for each batch;
- best degree and strategy per batch (for reference): the same, also choosing the ZeRO working
  mode and recompute of the whole batch;
- adaptive: `tessera.adapt.solve_step` under the plan's own strategy (per-step groups of mixed
  sizes), and adaptive + switching: length groups that each run their own ZeRO working mode and
  recompute per group (HotSPa);
- a lower bound no plan over these strategies beats (`switching.step_lower_bound`).

Layouts (sharded parameters): 7B: ZeRO-3 within each node (HSDP over 8), selective recompute;
70B: ZeRO-3 over all devices, selective recompute. bf16, AdamW. Lengths: the shared Wikipedia
sample (one length per line), and a heavier log-normal mix the benchmark draws itself (median 350,
sigma 1.8, capped at 1M tokens, seed 0). Also reports the data-parallel balance (max/mean
predicted compute over the groups of the smallest static degree that fits) before (token split)
and after `tessera.adapt.balance_ranks`. Solver times are per batch, wall and CPU, under its
budget (on the process's CPU clock by default, so that the plans do not depend on the machine's
load; `--budget-clock wall` as a training run does); this machine's load average is printed with
them.

    python benchmarks/varlen.py [--lengths FILE] [--batches 20] [--gpus 64 256] [--caps 131072]

Lengths: the file given, else the full sample of one million lengths where the project's shared
data holds it, else the first 10,240 of them shipped in `benchmarks/data/` (the 20 batches of 512
the default run reads, so the default run gives the same table from a clone; source and licence
in benchmarks/data/README.md).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera.adapt import balance_ranks, solve_step  # noqa: E402
from tessera.adapt.balance import token_split_ranks  # noqa: E402
from tessera.adapt.seqcost import Layout, Strategy, StrategySet, strategy_set  # noqa: E402
from tessera.adapt.seqpar import Items, solve_static  # noqa: E402
from tessera.adapt.switching import by_zero, phase_items, step_lower_bound  # noqa: E402
import tessera.adapt.seqmilp  # noqa: E402,F401  (scipy.optimize's one-off import is not a per-batch cost)
from tessera.spec.presets import get_model, make_cluster  # noqa: E402

SHARED_LENGTHS = ROOT / ".." / "shared" / "data" / "seqlens" / "wikipedia.txt"
SHIPPED_LENGTHS = ROOT / "benchmarks" / "data" / "wikipedia-lengths-10240.txt"
MODELS = {"7b": ("llama2-7b", 8), "70b": ("llama2-70b", 0)}  # (preset, ZeRO shard group: 0 = all devices)


def default_lengths() -> Path:
    """The shared million-length sample where it exists, else the shipped first 10,240 lengths."""
    return SHARED_LENGTHS if SHARED_LENGTHS.is_file() else SHIPPED_LENGTHS


def load_lengths(path: Path) -> np.ndarray:
    """Document lengths, one per line."""
    if not path.is_file():
        sys.exit(f"varlen benchmark: length file {path} not found; give one with --lengths FILE "
                 "(one document length in tokens per line)")
    return np.loadtxt(path, dtype=np.int64, ndmin=1)


def heavy_lengths(count: int, seed: int = 0) -> np.ndarray:
    """Log-normal lengths: median 350 tokens, sigma 1.8, capped at 1M (heavier-tailed than Wikipedia)."""
    rng = np.random.default_rng(seed)
    return np.minimum(np.maximum(rng.lognormal(np.log(350.0), 1.8, count), 1), 1_000_000).astype(np.int64)


def static_times(lens, cost) -> tuple[dict, dict]:
    """Per degree: the token-split and the balanced static step time (inf where it does not fit)."""
    items = Items.of_sequences(lens, cost)
    tok, bal = {}, {}
    for d in (int(x) for x in cost.degrees):
        t, b = solve_static(items, d, "tokens"), solve_static(items, d, "cost")
        tok[d] = t.time_s if t else np.inf
        bal[d] = b.time_s if b else np.inf
    return tok, bal


def run_setting(batches, model_name: str, gpus: int, cap: int, args) -> dict:
    preset, shard = MODELS[model_name]
    model, cluster = get_model(preset), make_cluster(args.gpu, gpus, args.gpus_per_node)
    layout = Layout(num_ranks=gpus, tp=1, shard=shard or 0)
    switching = strategy_set(model, cluster, layout, Strategy(3, args.recompute), switching=True)
    fixed = StrategySet(layout=layout, models=switching.models[:1])
    degrees = [int(d) for d in fixed.default.degrees]
    token_static = {d: 0.0 for d in degrees}
    balanced_static = {d: 0.0 for d in degrees}
    totals = dict(per_batch=0.0, per_batch_strategy=0.0, adaptive=0.0, switching=0.0, bound=0.0)
    wall, cpu, methods, before, after = [], [], {}, [], []
    cut = [np.minimum(lens, cap) for lens in batches]
    for lens in cut:
        tok, bal = static_times(lens, fixed.default)
        for d in degrees:
            token_static[d] += tok[d]
            balanced_static[d] += bal[d]
        totals["per_batch"] += min(bal.values())
        totals["per_batch_strategy"] += min(min(static_times(lens, c)[1].values()) for c in switching)
        clock = time.process_time if args.budget_clock == "cpu" else time.perf_counter
        totals["adaptive"] += solve_step(lens, fixed, time_budget_s=args.time_budget, clock=clock).time_s
        t0, c0 = time.perf_counter(), time.process_time()
        sol = solve_step(lens, switching, time_budget_s=args.time_budget, clock=clock)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        totals["switching"] += sol.time_s
        methods[sol.method] = methods.get(sol.method, 0) + 1
        totals["bound"] += step_lower_bound([phase_items(lens, switching, ks) for ks in by_zero(switching).values()],
                                            switching)
    d_tok = min(token_static, key=token_static.get)
    d_bal = min(balanced_static, key=balanced_static.get)
    smallest = min(d for d in degrees if np.isfinite(token_static[d]))
    ranks = gpus // smallest  # the widest data parallelism that fits
    cost = fixed.default
    for lens in cut:
        costs = cost.compute_time(lens)
        before.append(token_split_ranks(lens, costs, ranks).imbalance)
        after.append(balance_ranks(lens, ranks, lin=float(cost.lin_s[0]), attn=float(cost.attn_s[0])).imbalance)
    return dict(model=model_name, gpus=gpus, cap=cap, n=len(cut), d_tok=d_tok, t_tok=token_static[d_tok],
                d_bal=d_bal, t_bal=balanced_static[d_bal], wall=np.array(wall), cpu=np.array(cpu),
                methods=methods, ranks=ranks, before=float(np.mean(before)), after=float(np.mean(after)), **totals)


def setting_table(r, dataset: str) -> Table:
    t = Table(title=f"{dataset}: {r['model'].upper()}, {r['gpus']} GPUs, cap {r['cap'] // 1024}K, "
                    f"{r['n']} batches (predicted step time)")
    t.add_column("plan")
    t.add_column("mean step (s)", justify="right")
    t.add_column("adaptive + switching speedup", justify="right")
    rows = [(f"static SP, token split (best degree {r['d_tok']})", r["t_tok"]),
            (f"static SP, balanced (best degree {r['d_bal']})", r["t_bal"]),
            ("best single degree per batch", r["per_batch"]),
            ("[dim]best degree and strategy per batch[/dim]", r["per_batch_strategy"]),
            ("adaptive, no switching", r["adaptive"]),
            ("adaptive + switching", r["switching"])]
    for name, total in rows:
        t.add_row(name, f"{total / r['n']:.3f}", f"{total / r['switching']:.2f}x")
    t.add_row("[dim]lower bound (no plan is faster)[/dim]", f"[dim]{r['bound'] / r['n']:.3f}[/dim]",
              f"[dim]{r['bound'] / r['switching']:.2f}x[/dim]")
    t.caption = (f"solver per batch (adaptive + switching): wall median {1e3 * np.median(r['wall']):.1f} ms, "
                 f"p99 {1e3 * np.percentile(r['wall'], 99):.1f} ms; cpu median {1e3 * np.median(r['cpu']):.1f} ms, "
                 f"p99 {1e3 * np.percentile(r['cpu'], 99):.1f} ms; chosen: {r['methods']}\n"
                 f"DP balance over {r['ranks']} ranks (groups of {r['gpus'] // r['ranks']}, the smallest static "
                 f"degree that fits), max/mean predicted: token split {r['before']:.2f} -> balanced {r['after']:.2f}")
    return t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=Path, default=None,
                   help="document lengths, one per line (default: the shared Wikipedia sample, else the "
                        "10,240 shipped in benchmarks/data/)")
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=512)
    p.add_argument("--gpus", type=int, nargs="+", default=[64, 256])
    p.add_argument("--caps", type=int, nargs="+", default=[131072])
    p.add_argument("--models", nargs="+", default=["7b", "70b"], choices=sorted(MODELS))
    p.add_argument("--gpu", default="h100-80gb")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--recompute", default="selective", choices=["none", "selective", "full"])
    p.add_argument("--time-budget", type=float, default=0.08, help="solver time budget per batch (s)")
    p.add_argument("--budget-clock", choices=["cpu", "wall"], default="cpu",
                   help="the clock the budget runs on: cpu (default) gives the plans a quiet machine makes "
                        "within the budget whatever this machine's load; wall is what a training run uses")
    args = p.parse_args(argv)
    args.lengths = args.lengths or default_lengths()
    wiki = load_lengths(args.lengths)
    print(f"lengths: {args.lengths.relative_to(ROOT) if args.lengths.is_relative_to(ROOT) else args.lengths} "
          f"({len(wiki):,} documents)")
    num_batches = min(args.batches, len(wiki) // args.global_batch)
    if num_batches < 1:
        sys.exit(f"varlen benchmark: {args.lengths} holds fewer than {args.global_batch} lengths")
    heavy = heavy_lengths(num_batches * args.global_batch)
    datasets = {"wikipedia": wiki, "heavy log-normal": heavy}
    console = Console()
    load = os.getloadavg()[0]
    results = {}
    for dataset, lengths in datasets.items():
        batches = [lengths[i * args.global_batch:(i + 1) * args.global_batch] for i in range(num_batches)]
        for model_name in args.models:
            for cap in args.caps:
                for gpus in args.gpus:
                    r = run_setting(batches, model_name, gpus, cap, args)
                    results[(dataset, model_name, gpus, cap)] = r
                    console.print(setting_table(r, dataset))
    load = max(load, os.getloadavg()[0])
    cap = 131072 if 131072 in args.caps else args.caps[-1]
    key = results.get(("wikipedia", "7b", 64, cap)) or next(iter(results.values()))
    heavy_key = results.get(("heavy log-normal", "7b", 64, cap)) or key
    wall = np.concatenate([r["wall"] for r in results.values()])
    cpu = np.concatenate([r["cpu"] for r in results.values()])
    print(f"solver (adaptive + switching, every setting): wall median {1e3 * np.median(wall):.1f} ms, "
          f"p99 {1e3 * np.percentile(wall, 99):.1f} ms; cpu median {1e3 * np.median(cpu):.1f} ms, "
          f"p99 {1e3 * np.percentile(cpu, 99):.1f} ms; budget {1e3 * args.time_budget:.0f} ms ({args.budget_clock} clock); "
          f"load average up to {load:.1f} on {os.cpu_count()} cores")
    print(f"summary: speedup_vs_best_static={key['per_batch'] / key['switching']:.2f} "
          f"speedup_vs_balanced_static={key['t_bal'] / key['switching']:.2f} "
          f"heavy_speedup_vs_best_static={heavy_key['per_batch'] / heavy_key['switching']:.2f} "
          f"solver_p99_wall_ms={1e3 * np.percentile(wall, 99):.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
