"""How close is the cost model to this machine? Profile it, run plans, compare.

    python benchmarks/cost_model_fidelity.py [--out DIR] [--steps 3] [--worlds 2 4]

1. At each world size (ranks share the cores here, so a 4-rank profile is not a 2-rank one),
   right before its plans run: `tessera profile hardware`, then `tessera profile model` of a
   small LLaMA with its scales relative to that cluster profile's matmul rate.
2. Hand-made plans (data, ZeRO-3, tensor, pipeline, Ulysses and hybrids, with and without full
   recompute), each costed by `tessera.cost` with the measured cluster and the profiled model.
3. `tessera validate` runs each plan for a few steps: the slowest rank's median step time, and
   peak memory = model states of the local shards + peak saved activations (by instrumentation;
   see tessera/profile/validate.py), against the prediction without its transient buffers.
4. Right after the runs, `tessera profile model` again; the predictions use the mean of the two
   profiles' fitted coefficients (`--no-bracket`: the first profile only). The machine's speed
   drifts over minutes (other tenants); bracketing the runs gives the profile the speed they saw
   on average instead of the speed of the minute before them. `drift` prints how much the
   reference block's time moved between the two profiles.
5. Machine speed during the runs: `tessera validate --model-profile` times the profile's gauge
   block (the first block at its largest size) before every step and after the last, the way the
   profile timed it. `speed` = its time in the profiles (their mean) / its time during the runs
   (one figure per run, the steadiness check below). `adj s` converts each step to the profiles'
   speed by the gauge runs around it (`Validation.at_profiled_speed`) and `adj err` is the
   prediction's error against that: a diagnostic of how much of an error is the machine's load
   rather than the model, not what the summary reports (single gauge runs are noisy; the
   conversion leans to over-stating the steps by a few per cent).

6. Steadiness: a world size's attempt whose drift or speed is more than `--max-drift` (10%) away
   from 1 ran on a machine whose speed changed under it, which no cost model can predict; it is
   run again (`--retries`, 2) and the steadiest attempt is the one reported (`retryK/` in --out
   holds the others). The output says when that happened.

Ends with `summary: median_time_err_pct=<x> median_mem_err_pct=<y> spearman=<z>
speed_adjusted_median_time_err_pct=<w>` (Spearman of predicted vs measured step time over all
runs; the errors are medians of absolute errors; w from the `adj err` column).

Ranks are pinned to cores (`TESSERA_PIN_CPU=1`, see tessera/runtime/affinity.py; `--no-pin` to
leave them to the OS): at 4 ranks on 2 cores the scheduler otherwise shares the cores so unevenly
from moment to moment that the same step varies by a third, and a profile's best repetitions no
longer stand for the runs.

Timing windows and statistic: on a machine shared with other jobs, whose load comes in bursts
shorter than a step (the same gauge block, timed alone, took 0.09-0.18 s within one validation),
a single 0.05-0.2 s layer timing can fall in a quiet moment that a 0.5-2 s step never sees. So each
model-profile timing here averages as many runs in a row as fill `--window` seconds (0.5, about a
step; `tessera profile model --window`), the gauge during the runs spans the same window, and
every timing, collectives and matmuls of the hardware profile, layer timings and steps, is
summarised by its median over repetitions (`--statistic`; `min` and `mean`, a trimmed mean, are
the alternatives, and the README says what they gave). Plans run interleaved, one step each in turn.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera.plan import Plan  # noqa: E402
from tessera.profile.apply import apply_model_profile, load_cluster_profile, load_model_profile  # noqa: E402
from tessera.profile.fit import PARALLEL_COSTS, STATISTICS, ModelProfile  # noqa: E402
from tessera.profile.results import Gauge, Validation  # noqa: E402
from tessera.spec.model import ModelSpec, TransformerConfig  # noqa: E402
from tessera.spec.workload import Workload  # noqa: E402

# A LLaMA small enough for 2 CPU cores, with a vocabulary that does not drown the blocks.
MODEL = TransformerConfig(name="fidelity-llama", hidden=256, num_layers=4, num_heads=8, num_kv_heads=4,
                          ffn_hidden=688, vocab_size=4096, max_seq_len=512)
WORKLOAD = Workload(global_batch=8, seq_len=256, dtype="fp32")
PROFILE_SIZES = "2x128,1x256,4x128,2x256,1x512,4x256,2x512"

# name -> manual_plan keyword arguments, per world size. Micro-batches of 512+ tokens per rank
# where the batch allows, so that per-operation overheads (which a FLOPs model does not see) stay small.
PLANS = {
    2: {
        "dp2": dict(micro_batch_size=4),
        "dp2-rc": dict(micro_batch_size=4, recompute="full"),
        "zero3-dp2": dict(zero=3, micro_batch_size=4),
        "tp2": dict(tp=2, micro_batch_size=4),
        "pp2-1f1b": dict(pp=2, micro_batch_size=2),
        "ulysses2": dict(sp="ulysses", sp_degree=2, micro_batch_size=4),
    },
    4: {
        "dp4": dict(micro_batch_size=2),
        "zero3-dp4-rc": dict(zero=3, micro_batch_size=2, recompute="full"),
        "tp2-dp2": dict(tp=2, micro_batch_size=4),
        "tp2-dp2-zero3": dict(tp=2, zero=3, micro_batch_size=4),
        "tp4": dict(tp=4, micro_batch_size=4),
        "pp2-dp2": dict(pp=2, micro_batch_size=2),
        "pp2-tp2": dict(pp=2, tp=2, micro_batch_size=2),
        "ulysses2-dp2": dict(sp="ulysses", sp_degree=2, micro_batch_size=4),
    },
}


PIN_CPU = True  # see --no-pin


def torchrun(nproc: int, *args: str, timeout: float = 1800) -> str:
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


def build_plans(out: Path, world: int, model: ModelSpec, suffix: str = "") -> list[Path]:
    from tessera.search.baselines import manual_plan

    cluster = load_cluster_profile(out / f"cluster{world}.json", expect_gpus=world)
    paths = []
    for name, kwargs in PLANS[world].items():
        plan = manual_plan(model, cluster, WORKLOAD, name=name, **kwargs)
        path = out / f"plan-{name}{suffix}.json"
        plan.save(path)
        paths.append(path)
    return paths


def mean_profile(a: ModelProfile, b: ModelProfile) -> ModelProfile:
    """`a` with every fitted time coefficient the mean of `a`'s and `b`'s (profiles of one model on
    one cluster profile, taken before and after the runs: the machine's speed midway)."""
    fields = ("linear_time_scale", "attn_time_scale", "overhead_s", *PARALLEL_COSTS)
    layers = []
    for ka in a.layers:
        kb = b.for_kind(ka.kind)
        mean = {f: (getattr(ka, f) + getattr(kb, f)) / 2 for f in fields
                if getattr(ka, f) is not None and getattr(kb, f) is not None}
        wider_b = {w.degree: w for w in kb.tp_wider}
        mean["tp_wider"] = tuple(
            w.model_copy(update={f: (getattr(w, f) + getattr(wider_b[w.degree], f)) / 2 for f in ("overhead_s", "slowdown")})
            for w in ka.tp_wider if w.degree in wider_b)
        layers.append(ka.model_copy(update=mean))
    return a.model_copy(update={"layers": tuple(layers)})


def block_time(profile: ModelProfile) -> float:
    """Forward + backward seconds of the profile's gauge block (its first block at its largest size)."""
    return Gauge.of(profile, ModelSpec.from_config(MODEL)).profiled_s


@dataclass
class WorldRun:
    """One attempt at one world size: the table rows, and how steady the machine was."""

    rows: list[dict]
    skipped: list[dict]
    drift: float  # gauge block after the runs / before them (1.0 without bracketing)
    speed: float  # gauge block in the profiles / during the runs

    @property
    def unsteadiness(self) -> float:
        return max(abs(math.log(self.drift)), abs(math.log(self.speed)))

    def describe(self) -> str:
        return f"drift {self.drift:.2f}x, speed during the runs {self.speed:.2f}x the profiles'"


def run_world(args, out: Path, model_json: Path, world: int) -> WorldRun:
    """Profile, run the plans, profile again (see the module docstring) at `world` ranks in `out`."""
    cluster, profile = out / f"cluster{world}.json", out / f"model-profile{world}.json"
    if not (args.reuse_profiles and cluster.exists()):
        torchrun(world, "profile", "hardware", "-o", str(cluster), "--statistic", args.statistic)
    if not (args.reuse_profiles and profile.exists()):
        torchrun(world, "profile", "model", "--model", str(model_json), "-o", str(profile),
                 "--sizes", PROFILE_SIZES, "--reps", str(args.profile_reps), "--cluster", str(cluster),
                 "--statistic", args.statistic, "--window", str(args.window))
    model = apply_model_profile(ModelSpec.from_config(MODEL), profile)
    plans = build_plans(out, world, model)
    result_path = out / f"results{world}.json"
    if not (args.reuse_profiles and result_path.exists()):
        torchrun(world, "validate", "--plan", *map(str, plans), "--steps", str(args.steps), "--json",
                 str(result_path), "--statistic", args.statistic, "--model-profile", str(profile))
    data = json.loads(result_path.read_text())
    predicted, reference, drift = {}, block_time(load_model_profile(profile)), 1.0
    if not args.no_bracket:
        after = out / f"model-profile{world}-after.json"
        if not (args.reuse_profiles and after.exists()):
            torchrun(world, "profile", "model", "--model", str(model_json), "-o", str(after),
                     "--sizes", PROFILE_SIZES, "--reps", str(args.profile_reps), "--cluster", str(cluster),
                     "--statistic", args.statistic, "--window", str(args.window))
        both = mean_profile(load_model_profile(profile), load_model_profile(after))
        drift = block_time(load_model_profile(after)) / reference
        model = apply_model_profile(ModelSpec.from_config(MODEL), both)
        bracketed = [Plan.load(p) for p in build_plans(out, world, model, "-bracketed")]
        predicted = {plan.name: plan.prediction.step_time_s for plan in bracketed}
        reference = (reference + block_time(load_model_profile(after))) / 2
    rows, speed = [], 1.0
    for r in data["results"]:
        pred_mem = max(r["predicted_memory"])
        meas_mem = max(sum(x[k] for k in ("params", "grads", "optimizer", "activations")) for x in r["ranks"])
        # The profiles' gauge block (their mean, as the predictions) against the same block
        # timed during the runs: how much faster the machine ran than when it was profiled.
        speed = reference / r["gauge_s"] if r.get("gauge_s") else 1.0
        # Step by step, each step at the speed of the profiles by the gauge timed around it.
        at_speed = Validation.from_dict(r).at_profiled_speed(reference)
        rows.append(dict(plan=r["plan"], world=world, pred_t=predicted.get(r["plan"], r["predicted_step_s"]),
                         meas_t=r["measured_step_s"], adj_meas_t=at_speed if at_speed else math.nan,
                         pred_m=pred_mem, meas_m=meas_mem, speed=speed))
    return WorldRun(rows=rows, skipped=data["skipped"], drift=drift, speed=speed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for profiles, plans and results (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per plan")
    parser.add_argument("--statistic", choices=tuple(STATISTICS), default="median",
                        help="summary of repeated timings, in the profiles and the runs alike")
    parser.add_argument("--window", type=float, default=0.5, metavar="SECONDS",
                        help="each model-profile timing averages runs in a row over this long, about a step")
    parser.add_argument("--profile-reps", type=int, default=6, help="timings per model-profile point")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--reuse-profiles", action="store_true",
                        help="keep profiles and run results already in --out (re-cost the plans only)")
    parser.add_argument("--no-bracket", action="store_true",
                        help="predict from the profile taken before the runs only (no second profile after them)")
    parser.add_argument("--max-drift", type=float, default=0.10,
                        help="a world size's attempt counts as steady when the machine's speed moved by at most this "
                             "fraction between the profiles and during the runs (drift and speed)")
    parser.add_argument("--retries", type=int, default=2,
                        help="attempts more at a world size whose machine was not steady; the steadiest is kept")
    parser.add_argument("--no-pin", action="store_true",
                        help="let the OS move ranks between cores (default: each rank pinned, TESSERA_PIN_CPU=1)")
    args = parser.parse_args()
    global PIN_CPU
    PIN_CPU = not args.no_pin
    out = Path(args.out or tempfile.mkdtemp(prefix="fidelity-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"fidelity of the cost model on this machine ({os.cpu_count()} cores, ranks "
          f"{'pinned' if PIN_CPU else 'not pinned'}), files in {out}")

    model_json = out / "model.json"
    model_json.write_text(MODEL.model_dump_json(indent=1))
    rows, skipped, drift, speeds = [], [], {}, {}
    for world in args.worlds:
        attempts = []
        for k in range(1 + args.retries):
            where = out if k == 0 else out / f"retry{k}"
            if k and args.reuse_profiles and not where.exists():
                break
            where.mkdir(exist_ok=True)
            attempts.append(run_world(args, where, model_json, world))
            if attempts[-1].unsteadiness <= math.log1p(args.max_drift):
                break
            again = k < args.retries and not (args.reuse_profiles and not (out / f"retry{k + 1}").exists())
            print(f"  unsteady machine at {world} ranks: {attempts[-1].describe()}" + ("; again" if again else ""),
                  flush=True)
        kept = min(attempts, key=lambda a: a.unsteadiness)
        if len(attempts) > 1:
            print(f"  kept attempt {attempts.index(kept) + 1} of {len(attempts)} at {world} ranks ({kept.describe()})")
        rows += kept.rows
        skipped += kept.skipped
        drift[world], speeds[world] = kept.drift, kept.speed

    # speed: the gauge block's profiled time over its time during the runs (1.00 = as profiled);
    # adj s / adj err: the measured step at the profiles' speed, step by step, and its error.
    print(f"\n{'plan':<16}{'ranks':>6}{'pred s':>9}{'meas s':>9}{'err':>8}{'pred MiB':>10}{'meas MiB':>10}"
          f"{'err':>8}{'speed':>7}{'adj s':>8}{'adj err':>9}")
    for r in rows:
        r["t_err"] = 100 * (r["pred_t"] - r["meas_t"]) / r["meas_t"]
        r["adj_err"] = 100 * (r["pred_t"] - r["adj_meas_t"]) / r["adj_meas_t"]
        r["m_err"] = 100 * (r["pred_m"] - r["meas_m"]) / r["meas_m"]
        print(f"{r['plan']:<16}{r['world']:>6}{r['pred_t']:>9.3f}{r['meas_t']:>9.3f}{r['t_err']:>+7.1f}%"
              f"{r['pred_m'] / 2**20:>10.1f}{r['meas_m'] / 2**20:>10.1f}{r['m_err']:>+7.1f}%"
              f"{r['speed']:>7.2f}{r['adj_meas_t']:>8.3f}{r['adj_err']:>+8.1f}%")
    for s in skipped:
        print(f"skipped {Path(s['plan']).stem}: {s['reason']}")
    if not rows:
        print("summary: no plan ran")
        return 1
    for world, d in drift.items():
        print(f"drift at {world} ranks: the reference block took {d:.2f}x as long after the runs as before them, "
              f"and ran {speeds[world]:.2f}x as fast during them as in the profiles")
    for world in args.worlds:
        sub = [r for r in rows if r["world"] == world]
        print(f"spearman at {world} ranks: {spearman([r['pred_t'] for r in sub], [r['meas_t'] for r in sub]):.2f}")
    t_err = statistics.median(abs(r["t_err"]) for r in rows)
    m_err = statistics.median(abs(r["m_err"]) for r in rows)
    rho = spearman([r["pred_t"] for r in rows], [r["meas_t"] for r in rows])
    adj = [abs(r["adj_err"]) for r in rows if not math.isnan(r["adj_err"])]  # nan: results of an older validate
    adj_err = f"{statistics.median(adj):.1f}" if adj else "nan"
    print(f"summary: median_time_err_pct={t_err:.1f} median_mem_err_pct={m_err:.1f} spearman={rho:.2f} "
          f"speed_adjusted_median_time_err_pct={adj_err}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
