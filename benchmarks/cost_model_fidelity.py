"""How close is the cost model to this machine? Profile once, then run plans the profile never saw.

    python benchmarks/cost_model_fidelity.py [--out DIR] [--steps 10] [--attempts 2] [--worlds 2 4]
    python benchmarks/cost_model_fidelity.py --quick     # a few plans and steps: checks it runs end to end

1. Profiles first, each taken once, before any plan runs (never again after, never averaged):
   - `tessera profile hardware` at every world size: ranks share this machine's cores, so 4 ranks
     make another "cluster" than 2 (slower matmuls per rank, other collectives), as another GPU
     type would;
   - `tessera profile model` ONCE, at the smallest world size, at `PROFILE_SIZES` (batch x
     sequence): every layer alone, and blocks tensor parallel, with Ulysses and with ZeRO-3 over
     pairs of ranks. Its scales refer to that world's cluster profile; at other world sizes the
     same profile is applied to that world's cluster profile.
2. Plans the profile did not see (`check_unseen` refuses any other): the workload's sequence length
   (384) is none of the profile's, so no micro-batch shape was measured; on the profiled world
   size the plans use only what the model profile never runs (data and pipeline parallelism,
   recompute, ZeRO-1/2), and on the other world sizes every plan runs with all of them busy and
   groups the profile never formed (tp4, Ulysses over 4, ZeRO-3 over 4, the pair variants beside
   dp2 or pp2). Each is costed by `tessera.cost` with its world's cluster profile and the model
   profile.
3. `--attempts` rounds of `tessera validate` (all world sizes in turn, then again). Every timed
   step of every attempt counts: a plan's measured step time is the median of all of them, shown
   with their range and each attempt's median. No attempt is rerun or dropped.
4. Memory, from the process: the peak bytes the torch allocator held for the plan during one step,
   counted from before its trainer was built (on CPU as the CPU allocator reports them to the
   PyTorch profiler; see tessera/profile/measure/validate.py), against the cost model's peak
   without the framework reserve (`tessera.profile.results.predicted_allocated`). The largest
   rank on each side; the median over attempts.

Ends with `summary: median_time_err_pct=<x> median_mem_err_pct=<y> spearman=<z>`: medians over the
plans of the absolute errors, and the rank correlation of predicted and measured step times over
all plans.

Ranks are pinned to cores (`TESSERA_PIN_CPU=1`, see tessera/runtime/affinity.py; `--no-pin` to
leave them to the OS): at 4 ranks on 2 cores the scheduler otherwise shares the cores so unevenly
that the same step varies by a third. Each model-profile timing averages runs in a row over
`--window` seconds (about a step), as a step averages the machine's bursts of load.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera.plan import Plan, SPKind  # noqa: E402
from tessera.profile.apply import apply_model_profile, load_cluster_profile, load_model_profile  # noqa: E402
from tessera.profile.results import Validation, predicted_allocated  # noqa: E402
from tessera.spec.model import ModelSpec, TransformerConfig  # noqa: E402
from tessera.spec.workload import Workload  # noqa: E402

# A LLaMA small enough for 2 CPU cores, with a vocabulary that does not drown the blocks.
MODEL = TransformerConfig(name="fidelity-llama", hidden=256, num_layers=4, num_heads=8, num_kv_heads=4,
                          ffn_hidden=688, vocab_size=4096, max_seq_len=512)
PROFILE_SIZES = ((2, 128), (1, 256), (4, 128), (2, 256), (1, 512), (4, 256), (2, 512))
QUICK_PROFILE_SIZES = ((2, 128), (1, 256), (2, 256))
# Sequence length 384: between the profiled ones, equal to none. Micro-batches of 2 x 384 tokens.
WORKLOAD = Workload(global_batch=8, seq_len=384, dtype="fp32")

# name -> manual_plan keyword arguments, per world size (see the module docstring for the rules).
PLANS = {
    2: {
        "dp2": dict(micro_batch_size=2),
        "dp2-rc": dict(micro_batch_size=2, recompute="full"),
        "zero1-dp2": dict(zero=1, micro_batch_size=2),
        "zero2-dp2": dict(zero=2, micro_batch_size=2),
        "pp2-1f1b": dict(pp=2, micro_batch_size=2),
        "pp2-gpipe-rc": dict(pp=2, schedule="gpipe", recompute="full", micro_batch_size=2),
    },
    4: {
        "dp4": dict(micro_batch_size=2),
        "zero3-dp4-rc": dict(zero=3, micro_batch_size=2, recompute="full"),
        "tp4": dict(tp=4, micro_batch_size=2),
        "ulysses4": dict(sp="ulysses", sp_degree=4, micro_batch_size=2),
        "tp2-dp2": dict(tp=2, micro_batch_size=2),
        "tp2-dp2-zero3": dict(tp=2, zero=3, micro_batch_size=2),
        "pp2-dp2": dict(pp=2, micro_batch_size=2),
        "pp2-tp2": dict(pp=2, tp=2, micro_batch_size=2),
        "ulysses2-dp2": dict(sp="ulysses", sp_degree=2, micro_batch_size=2),
    },
}
QUICK_PLANS = {2: ("dp2", "pp2-1f1b"), 4: ("tp2-dp2", "zero3-dp4-rc")}

PIN_CPU = True  # see --no-pin


def torchrun(nproc: int, *args: str, timeout: float = 3600) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               TESSERA_PIN_CPU="1" if PIN_CPU else "0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "tessera", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    print(f"  [{time.perf_counter() - t0:5.1f} s] tessera {' '.join(args[:2])} at {nproc} ranks", flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"tessera {' '.join(args)} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return proc.stdout


def spearman(x: list[float], y: list[float]) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(x, y).statistic) if len(x) > 2 else float("nan")


def check_unseen(plan: Plan, profile_world: int, profile_sizes) -> None:
    """Refuse a plan the model profile saw: a micro-batch shape it measured, or, on the profiled
    world size, a block run the way the profile ran it (tensor parallel, Ulysses, ZeRO-3 over the pair)."""
    seq = plan.workload.seq_len
    if any(s == seq for _, s in profile_sizes):
        raise SystemExit(f"plan {plan.name}: sequence length {seq} was profiled")
    if plan.world_size == profile_world:
        for s in plan.layers:
            if s.tp > 1 or s.sp == SPKind.ULYSSES or s.zero >= 3:
                raise SystemExit(f"plan {plan.name}: {s.describe()} at {profile_world} ranks is what the "
                                 "model profile measured")


def build_plans(out: Path, world: int, names, model: ModelSpec, profile_world: int, profile_sizes) -> list[Path]:
    from tessera.search.baselines import manual_plan

    cluster = load_cluster_profile(out / f"cluster{world}.json", expect_gpus=world)
    paths = []
    for name in names:
        plan = manual_plan(model, cluster, WORKLOAD, name=name, **PLANS[world][name])
        check_unseen(plan, profile_world, profile_sizes)
        path = out / f"plan-{name}.json"
        plan.save(path)
        paths.append(path)
    return paths


def profile_all(args, out: Path, worlds: list[int], model_json: Path, sizes) -> Path:
    """Every profile, before any plan runs: the hardware at each world size, the model once."""
    for world in worlds:
        cluster = out / f"cluster{world}.json"
        if not (args.reuse and cluster.exists()):
            torchrun(world, "profile", "hardware", "-o", str(cluster), *args.hardware_options)
    profile = out / "model-profile.json"
    if not (args.reuse and profile.exists()):
        torchrun(worlds[0], "profile", "model", "--model", str(model_json), "-o", str(profile),
                 "--sizes", ",".join(f"{b}x{s}" for b, s in sizes), "--reps", str(args.profile_reps),
                 "--cluster", str(out / f"cluster{worlds[0]}.json"), "--window", str(args.window))
    return profile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for profiles, plans and results (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per plan and attempt (default 10)")
    parser.add_argument("--attempts", type=int, default=None, help="rounds of validation; all count (default 2)")
    parser.add_argument("--window", type=float, default=None, metavar="SECONDS",
                        help="each model-profile timing averages runs in a row over this long (default 0.5)")
    parser.add_argument("--profile-reps", type=int, default=None, help="timings per model-profile point (default 6)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], choices=sorted(PLANS))
    parser.add_argument("--quick", action="store_true",
                        help=f"two plans per world size, {len(QUICK_PROFILE_SIZES)} profile sizes, short profiles, "
                             "2 steps, 1 attempt: checks that the benchmark runs, measures nothing worth quoting")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the profiles and attempt results already in --out (re-cost and re-print only)")
    parser.add_argument("--no-pin", action="store_true",
                        help="let the OS move ranks between cores (default: each rank pinned, TESSERA_PIN_CPU=1)")
    args = parser.parse_args()
    global PIN_CPU
    PIN_CPU = not args.no_pin
    quick = args.quick
    args.steps = args.steps or (2 if quick else 10)
    args.attempts = args.attempts or (1 if quick else 2)
    args.window = args.window if args.window is not None else (0.0 if quick else 0.5)
    args.profile_reps = args.profile_reps or (2 if quick else 6)
    args.hardware_options = ["--reps", "2", "--max-bytes", "1M"] if quick else []
    if args.steps < 1 or args.attempts < 1:
        raise SystemExit("--steps and --attempts must be at least 1")
    sizes = QUICK_PROFILE_SIZES if quick else PROFILE_SIZES
    worlds = sorted(args.worlds)
    names = {w: QUICK_PLANS[w] if quick else tuple(PLANS[w]) for w in worlds}
    out = Path(args.out or tempfile.mkdtemp(prefix="fidelity-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"fidelity of the cost model on this machine ({os.cpu_count()} cores, ranks "
          f"{'pinned' if PIN_CPU else 'not pinned'}{', QUICK mode' if quick else ''}), files in {out}")

    model_json = out / "model.json"
    model_json.write_text(MODEL.model_dump_json(indent=1))
    profile = profile_all(args, out, worlds, model_json, sizes)
    model = apply_model_profile(ModelSpec.from_config(MODEL), load_model_profile(profile))
    # The model profile reaches the other world sizes through their matmul rates: say them.
    rates = {w: load_cluster_profile(out / f"cluster{w}.json", expect_gpus=w).device.peak_flops["fp32"] for w in worlds}
    print("fp32 matmul per rank, as profiled: " + ", ".join(
        f"{w} ranks {r / 1e9:.1f} GFLOP/s ({rates[worlds[0]] / r:.2f}x the time of {worlds[0]})" for w, r in rates.items()))
    plans = {w: build_plans(out, w, names[w], model, worlds[0], sizes) for w in worlds}

    attempts: dict[str, list[Validation]] = {}  # plan -> one record per attempt
    world_of, skipped = {}, {}
    for k in range(1, args.attempts + 1):
        for world in worlds:
            path = out / f"results{world}-attempt{k}.json"
            if not (args.reuse and path.exists()):
                torchrun(world, "validate", "--plan", *map(str, plans[world]), "--steps", str(args.steps),
                         "--json", str(path))
            data = json.loads(path.read_text())
            for r in data["results"]:
                attempts.setdefault(r["plan"], []).append(Validation.from_dict(r))
                world_of[r["plan"]] = world
            skipped.update({Path(s["plan"]).stem: s["reason"] for s in data["skipped"]})

    rows = []
    for name, runs in attempts.items():
        plan = Plan.load(out / f"plan-{name}.json")
        steps = [t for v in runs for t in v.step_times]
        measured_mem = statistics.median(max(r.allocator_peak for r in v.ranks) for v in runs)
        rows.append(dict(plan=name, world=world_of[name], pred_t=plan.prediction.step_time_s,
                         meas_t=statistics.median(steps), low=min(steps), high=max(steps),
                         per_attempt=[statistics.median(v.step_times) for v in runs],
                         pred_m=max(predicted_allocated(plan)), meas_m=measured_mem))

    print(f"\nworkload {WORKLOAD.global_batch} x {WORKLOAD.seq_len} tokens per step; model profile at {worlds[0]} ranks, "
          f"sizes {', '.join(f'{b}x{s}' for b, s in sizes)}; {args.attempts} attempt(s) x {args.steps} timed steps")
    print(f"{'plan':<15}{'ranks':>6}{'pred s':>9}{'meas s':>9}{'range s':>14}{'err':>8}"
          f"{'pred MiB':>10}{'meas MiB':>10}{'err':>8}  attempt medians s")
    for r in rows:
        r["t_err"] = 100 * (r["pred_t"] - r["meas_t"]) / r["meas_t"]
        r["m_err"] = 100 * (r["pred_m"] - r["meas_m"]) / r["meas_m"]
        spread = f"{r['low']:.3f}-{r['high']:.3f}"
        print(f"{r['plan']:<15}{r['world']:>6}{r['pred_t']:>9.3f}{r['meas_t']:>9.3f}{spread:>14}{r['t_err']:>+7.1f}%"
              f"{r['pred_m'] / 2**20:>10.1f}{r['meas_m'] / 2**20:>10.1f}{r['m_err']:>+7.1f}%  "
              + " ".join(f"{t:.3f}" for t in r["per_attempt"]))
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    if not rows:
        print("summary: no plan ran")
        return 1
    for world in worlds:
        sub = [r for r in rows if r["world"] == world]
        if sub:
            print(f"at {world} ranks: median |time error| {statistics.median(abs(r['t_err']) for r in sub):.1f}%, "
                  f"Spearman {spearman([r['pred_t'] for r in sub], [r['meas_t'] for r in sub]):.2f}")
    t_err = statistics.median(abs(r["t_err"]) for r in rows)
    m_err = statistics.median(abs(r["m_err"]) for r in rows)
    rho = spearman([r["pred_t"] for r in rows], [r["meas_t"] for r in rows])
    print(f"summary: median_time_err_pct={t_err:.1f} median_mem_err_pct={m_err:.1f} spearman={rho:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
