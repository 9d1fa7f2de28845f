"""Adaptive sequence parallelism on real document lengths: predicted step time and solver time.

Replays batches of real Wikipedia document lengths (one length per line; consecutive batches of
`--global-batch` documents, each truncated to the length cap) for a 7B model on H100 clusters,
and compares, with one cost model (tessera.adapt.seqcost):

- static SP (token split): one Ulysses degree for the whole run, each group taking a contiguous
  run of the batch with an equal share of tokens (what a static system does); the best degree;
- static SP (balanced): one degree for the run, sequences spread over groups by predicted time;
- best degree per batch: the balanced static plan with the best degree chosen for each batch;
- Tessera adaptive: `tessera.adapt.solve_step`, per-step groups of mixed sizes;
- a lower bound no plan beats (`tessera.adapt.seqpar.step_lower_bound`: devices shared fluidly,
  memory binding each sequence alone), to show how far from optimal the solver can be.

Static plan underneath: ZeRO-3 sharded within each node (HSDP), selective recompute, bf16.
Also reports the data-parallel balance (max/mean predicted compute over the groups of the smallest
static degree that fits) before (token split) and after `tessera.adapt.balance_ranks`, with the
bound that one indivisible sequence sets.

    python benchmarks/varlen.py [--lengths FILE] [--batches 20] [--gpus 16 64 256] [--caps 32768 131072]

Lengths: the file given, else the full sample of one million lengths where the project's shared
data holds it, else the first 10,240 of them shipped in `benchmarks/data/` (the 20 batches of 512
the default run reads, so the default run gives the same table from a clone; source and licence
in benchmarks/data/README.md).
"""
from __future__ import annotations

import argparse
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
from tessera.adapt.seqcost import cost_model_from_budget  # noqa: E402
from tessera.adapt.seqpar import Items, solve_static, step_lower_bound  # noqa: E402
import tessera.adapt.seqmilp  # noqa: E402,F401  (scipy.optimize's one-off import is not a per-batch cost)
from tessera.spec.presets import get_model, make_cluster  # noqa: E402

SHARED_LENGTHS = ROOT / ".." / "shared" / "data" / "seqlens" / "wikipedia.txt"
SHIPPED_LENGTHS = ROOT / "benchmarks" / "data" / "wikipedia-lengths-10240.txt"


def default_lengths() -> Path:
    """The shared million-length sample where it exists, else the shipped first 10,240 lengths."""
    return SHARED_LENGTHS if SHARED_LENGTHS.is_file() else SHIPPED_LENGTHS


def load_lengths(path: Path) -> np.ndarray:
    if not path.is_file():
        sys.exit(f"varlen benchmark: length file {path} not found; give one with --lengths FILE "
                 "(one document length in tokens per line)")
    return np.loadtxt(path, dtype=np.int64, ndmin=1)


def run_setting(lengths, num_batches, global_batch, cap, gpus, args):
    model = get_model(args.model)
    cluster = make_cluster(args.gpu, gpus, args.gpus_per_node)
    cost = cost_model_from_budget(model, cluster, recompute=args.recompute,
                                  shard=min(args.gpus_per_node, gpus))
    degrees = [int(d) for d in cost.degrees]
    token_static = {d: 0.0 for d in degrees}
    balanced_static = {d: 0.0 for d in degrees}
    per_batch_best = adaptive = lower_bound = 0.0
    wall, cpu, methods, before, after, bound = [], [], {}, [], [], []
    batches = [np.minimum(lengths[i * global_batch:(i + 1) * global_batch], cap) for i in range(num_batches)]
    for lens in batches:
        items = Items.of_sequences(lens, cost)
        best_this = np.inf
        for d in degrees:
            tok = solve_static(items, d, "tokens")
            bal = solve_static(items, d, "cost")
            token_static[d] += tok.time_s if tok else np.inf
            balanced_static[d] += bal.time_s if bal else np.inf
            best_this = min(best_this, bal.time_s if bal else np.inf)
        per_batch_best += best_this
        lower_bound += step_lower_bound(items)
        t0, c0 = time.perf_counter(), time.process_time()
        sol = solve_step(lens, cost, time_budget_s=args.time_budget)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        adaptive += sol.time_s
        methods[sol.method] = methods.get(sol.method, 0) + 1
    d_tok = min(token_static, key=token_static.get)
    d_bal = min(balanced_static, key=balanced_static.get)
    ranks = gpus // min(d for d in degrees if np.isfinite(token_static[d]))  # the widest DP that fits
    for lens in batches:
        costs = cost.compute_time(lens)
        before.append(token_split_ranks(lens, costs, ranks).imbalance)
        after.append(balance_ranks(lens, ranks, lin=cost.lin_s_per_token, attn=cost.attn_s_per_token2).imbalance)
        share = costs.sum() / ranks
        bound.append(max(costs.max(), share) / share)  # no split cuts a sequence: the best possible
    return dict(gpus=gpus, cap=cap, n=num_batches, d_tok=d_tok, t_tok=token_static[d_tok], d_bal=d_bal,
                t_bal=balanced_static[d_bal], t_per_batch=per_batch_best, t_adaptive=adaptive, t_bound=lower_bound,
                wall=np.array(wall), cpu=np.array(cpu), methods=methods, ranks=ranks,
                before=float(np.mean(before)), after=float(np.mean(after)), bound=float(np.mean(bound)))


def setting_table(r) -> Table:
    t = Table(title=f"{r['gpus']} GPUs, cap {r['cap'] // 1024}K: {r['n']} batches (predicted step time)")
    t.add_column("plan")
    t.add_column("mean step (s)", justify="right")
    t.add_column("adaptive speedup", justify="right")
    rows = [(f"static SP, token split (best degree {r['d_tok']})", r["t_tok"]),
            (f"static SP, balanced (best degree {r['d_bal']})", r["t_bal"]),
            ("best single degree per batch", r["t_per_batch"]),
            ("Tessera adaptive", r["t_adaptive"])]
    for name, total in rows:
        t.add_row(name, f"{total / r['n']:.3f}", f"{total / r['t_adaptive']:.2f}x")
    t.add_row("[dim]lower bound (no plan is faster)[/dim]", f"[dim]{r['t_bound'] / r['n']:.3f}[/dim]",
              f"[dim]{r['t_bound'] / r['t_adaptive']:.2f}x[/dim]")
    t.caption = (f"solver per batch: cpu median {1e3 * np.median(r['cpu']):.1f} ms, p99 "
                 f"{1e3 * np.percentile(r['cpu'], 99):.1f} ms; wall median {1e3 * np.median(r['wall']):.1f} ms, "
                 f"p99 {1e3 * np.percentile(r['wall'], 99):.1f} ms; chosen: {r['methods']}\n"
                 f"DP balance over {r['ranks']} ranks (groups of {r['gpus'] // r['ranks']}, the smallest static "
                 f"degree that fits), max/mean predicted: token split {r['before']:.2f} -> balanced {r['after']:.2f} (bound {r['bound']:.2f})")
    return t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=Path, default=None,
                   help="document lengths, one per line (default: the shared Wikipedia sample, else the "
                        "10,240 shipped in benchmarks/data/)")
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=512)
    p.add_argument("--gpus", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--caps", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--model", default="llama2-7b")
    p.add_argument("--gpu", default="h100-80gb")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--recompute", default="selective", choices=["none", "selective", "full"])
    p.add_argument("--time-budget", type=float, default=0.1, help="solver time budget per batch (s)")
    args = p.parse_args(argv)
    args.lengths = args.lengths or default_lengths()
    lengths = load_lengths(args.lengths)
    print(f"lengths: {args.lengths.relative_to(ROOT) if args.lengths.is_relative_to(ROOT) else args.lengths} "
          f"({len(lengths):,} documents)")
    num_batches = min(args.batches, len(lengths) // args.global_batch)
    if num_batches < 1:
        sys.exit(f"varlen benchmark: {args.lengths} holds fewer than {args.global_batch} lengths")
    console = Console()
    results = []
    for cap in args.caps:
        for gpus in args.gpus:
            r = run_setting(lengths, num_batches, args.global_batch, cap, gpus, args)
            results.append(r)
            console.print(setting_table(r))
    key = next((r for r in results if r["gpus"] == 64 and r["cap"] == 131072), results[-1])
    cpu = np.concatenate([r["cpu"] for r in results])
    wall = np.concatenate([r["wall"] for r in results])
    print(f"summary: speedup_{key['gpus']}gpu_{key['cap'] // 1024}k={key['t_tok'] / key['t_adaptive']:.2f} "
          f"solver_median_ms={1e3 * np.median(cpu):.1f} solver_p99_ms={1e3 * np.percentile(cpu, 99):.1f} "
          f"speedup_vs_balanced_static={key['t_bal'] / key['t_adaptive']:.2f} "
          f"adaptive_over_lower_bound={key['t_adaptive'] / key['t_bound']:.3f} "
          f"solver_wall_median_ms={1e3 * np.median(wall):.1f} solver_wall_p99_ms={1e3 * np.percentile(wall, 99):.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
