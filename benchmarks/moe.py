"""Mixture-of-experts: expert-parallel exactness, NetMoE sample placement, skew, APTMoE offload.

(0) Exactness: a 4-rank torchrun of tests/dist/moe_equivalence.py (gradients and losses vs one
    process) for ep2 x dp2, ep4, ep2 x tp2 with Megatron SP, ep2 in a 1F1B pipeline, NetMoE
    per-layer placement (Qwen-MoE, capacity, 2 micro-batches, full recompute, packed documents;
    and under tp2 with Megatron SP), the MoE block's tensor-parallel collectives against a dense
    block's, and APTMoE offload in a 4-stage pipeline.
(a) NetMoE placement on routing traces (benchmarks/moe_placement_eval.py): tiny-moe trained here on
    mixed text, recorded twice (benchmarks/moe_traces.py: v1, 40 steps from initialisation; v2,
    240 steps on four kinds of text, experts specialised); synthetic skewed routing (64 experts,
    top-8, layer-to-layer structure). Inter-node all-to-all bytes per step without placement,
    placed once per step (predicted per token id), placed per layer (what moe_placement="layer"
    runs: next layer predicted from this one's routing) and per layer with the next layer's
    routing known, at 64 and 512 GPUs, in geometries whose expert-parallel groups cross nodes:
    tiny-moe's ep4 over 2 nodes (two experts a node: tp1 on 2-GPU nodes, the same crossings as
    tp4 on 8-GPU nodes) and tp8 x ep4 (one expert a node, the first benchmark's geometry); the
    synthetic trace at ep64 over 8 nodes. Solver wall and CPU time (the wall time on a loaded
    machine includes waiting for a core).
(b) The planner's predicted step time for mixtral-8x7b: the searched plan, with routing balanced
    and with the skew measured on the recorded trace; and a plan whose ep8 groups span two nodes
    (4 GPUs per node) without and with placement (cost/moe.py's inter-node scale = 1 - the cut
    measured on trace v2 in the two-experts-a-node geometry).
(c) APTMoE on a memory-poor, bandwidth-poor node (assumptions printed): mixtral-8x7b's experts in
    host memory, per expert "bring to the GPU" or "compute on the host" (cost/expert_offload.py),
    versus bringing every expert (offload all) and computing every expert on the host. The
    trainer runs the decision (TrainConfig.expert_offload), exact in (0).
(d) The routing table's per-step update at a 152K vocabulary (Qwen2-57B-A14B's shape, 64 GPUs):
    dense all-reduce of the table against the sparse update of the step's token ids
    (adapt/moe_routing.py), bytes from the distinct token ids per rank measured on the trace
    data, and the update's build time; the predictor with hashed buckets.

Last line: `summary: ep_runtime_exact=<0|1> internode_a2a_cut_pct=<x> placement_p99_ms=<y>
aptmoe_speedup_vs_offload_all=<z>`: x the per-layer placement's cut (predicted routing, what the
runtime runs) on recorded trace v2 at 64 GPUs, two experts a node (v1 when v2 is not recorded);
y the p99 wall time of a solve (per step or per layer) at 64 GPUs over all traces. Timings are
wall time on whatever machine runs it (on a shared machine, under the others' load).

    python benchmarks/moe.py [--skip-exact] [--retrace]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # the solver's small matrices: threads only wait

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import moe_traces  # noqa: E402
from moe_placement_eval import evaluate, specialisation, synthetic_pool, trace_pool  # noqa: E402

from tessera.adapt.moe_routing import EXACT_UP_TO_IDS, HASHED_BUCKETS, RoutingTable, update_bytes  # noqa: E402
from tessera.cost.expert_offload import HostSpec, plan_expert_offload  # noqa: E402
from tessera.cost.moe import routing_skew, with_routing  # noqa: E402
from tessera.plan import LayerStrategy  # noqa: E402
from tessera.search import manual_plan, search  # noqa: E402
from tessera.spec.presets import get_model, make_cluster  # noqa: E402
from tessera.spec.workload import Workload  # noqa: E402

EXACT_CHECKS = ("ep2_dp2_zero2_mixtral", "ep4_zero1_qwen", "ep2_tp2_sp_qwen", "ep2_pp2_1f1b_mixtral",
                "ep2_dp4_netmoe_per_layer_qwen_capacity_recompute", "ep2_tp2_sp_netmoe_per_layer_qwen",
                "tp_sp_collectives_as_priced",
                "aptmoe_offload_pp4")
GiB = 2**30
V2 = f"tiny-moe v2 ({moe_traces.V2_STEPS} steps)"
TINY_ROW = 256 * 2  # tiny-moe's hidden size in bf16
SYNTH_ROW = 3584 * 2  # a Qwen2-57B-shaped hidden size in bf16


def run_exactness() -> int:
    script = ROOT / "tests" / "dist" / "moe_equivalence.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", str(script),
           *EXACT_CHECKS]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    lines = proc.stdout.splitlines()
    passed = {line.split()[1] for line in lines if line.startswith("CHECK ") and line.endswith(" ok")}
    for line in proc.stdout.splitlines():
        if line.startswith("  ") or line.startswith("CHECK"):
            print(line)
    ok = proc.returncode == 0 and set(EXACT_CHECKS) <= passed
    if not ok:
        print(proc.stdout[-3000:], proc.stderr[-3000:])
    return int(ok)


# --- (a) placement on traces -------------------------------------------------------------------------


def _cases(traces: dict) -> list[tuple]:
    """(trace label, pool, experts, strategy, gpus, gpus per node, samples per rank, row bytes, batches)."""
    cases = []
    for label, pool in traces.items():
        for gpus, per_rank, batches in ((64, 1, 16), (512, 1, 3)):
            cases.append((label, pool, 4, LayerStrategy(dp=gpus, ep=4), gpus, 2, per_rank, TINY_ROW, batches))
        for gpus, per_rank, batches in ((64, 4, 16), (512, 2, 3)):
            cases.append((label, pool, 4, LayerStrategy(dp=gpus // 8, tp=8, ep=4), gpus, 8, per_rank, TINY_ROW,
                          batches))
    synth = synthetic_pool(2048, 4, 64, 8, 4096, seed=1)
    for gpus, per_rank, batches in ((64, 8, 6), (64, 2, 6), (512, 2, 2)):
        cases.append(("synthetic, 64 experts top-8", synth, 64, LayerStrategy(dp=gpus, ep=64), gpus, 8, per_rank,
                      SYNTH_ROW, batches))
    return cases


def placement_section(traces: dict, console: Console) -> dict:
    t = Table(title="NetMoE placement: inter-node all-to-all bytes per step (dispatch + combine of every MoE layer, "
                    "forward + backward) and the cut")
    for col in ("trace", "GPUs", "geometry", "samples", "none", "per step", "per layer", "per layer, next known",
                "bound", "solve p50 / p99 wall, p99 CPU"):
        t.add_column(col)
    out = {"times": [], "cuts": {}}
    for label, pool, experts, s, gpus, gpn, per_rank, row, batches in _cases(traces):
        r = evaluate(pool, s, experts, gpn, per_rank, batches)
        rows = r["rows"]
        base = rows["none"]
        cut = {p: 100 * (1 - v / base) if base else 0.0 for p, v in rows.items()}
        cut["bound"] = 100 * (1 - r["bound"] / base) if base else 0.0
        out["cuts"][(label, gpus, s.tp, per_rank)] = cut
        wall = r["times"]["step"] + r["times"]["layer"]
        cpu = r["cpu"]["step"] + r["cpu"]["layer"]
        if gpus == 64:
            out["times"] += wall
            out.setdefault("cpu", []).extend(cpu)
        geometry = f"ep{s.ep} tp{s.tp}, {gpn}/node ({r['classes']} classes)"
        t.add_row(label, str(gpus), geometry, str(r["samples"]), f"{2 * base * row / GiB:.3f} GiB",
                  f"{cut['step']:.1f}%", f"{cut['layer']:.1f}%", f"{cut['layer oracle']:.1f}%", f"{cut['bound']:.1f}%",
                  f"{1e3 * np.median(wall):.1f} / {1e3 * np.percentile(wall, 99):.1f}, "
                  f"{1e3 * np.percentile(cpu, 99):.1f} ms")
    console.print(t)
    print("bound: the largest cut of any placement that keeps every rank's sample count in every layer, even "
          "knowing every layer's routing in advance (moe_placement_eval.placement_bound, a Lagrangian bound)")
    for label, pool in traces.items():
        print(f"{label}: specialisation (std across samples of an expert's share, mean over layers and experts) "
              f"{specialisation(pool):.3f}")
    return out


def load_traces(retrace: bool) -> tuple[dict, dict]:
    """({label: pool}, {label: raw trace}) of the recorded traces."""
    raw = {"tiny-moe v1 (40 steps)": moe_traces.load(1, 40, retrace),
           V2: moe_traces.load(2, moe_traces.V2_STEPS, retrace)}
    raw = {k: v for k, v in raw.items() if v is not None}
    return {k: trace_pool(v, 4, 2, 50257) for k, v in raw.items()}, raw


# --- (d) the routing table's update ----------------------------------------------------------------------


def table_section(raw: dict, console: Console) -> None:
    vocab, experts, layers, k, gpus = 151936, 64, 28, 8, 64
    tokens_per_rank = 8 * 4096
    streams = moe_traces.streams()
    rng = np.random.default_rng(0)
    distinct = []
    for _ in range(gpus):  # a rank's 8 samples of 4096 tokens, each from one kind of text
        rows = []
        for _ in range(8):
            stream = streams[rng.integers(len(streams))]
            start = int(rng.integers(0, len(stream) - 4096))
            rows.append(stream[start:start + 4096])
        distinct.append(len(np.unique(np.concatenate(rows))))
    distinct = np.array(distinct)
    b = update_bytes(distinct, experts, vocab, gpus, HASHED_BUCKETS)
    table = RoutingTable(vocab, experts)
    ids = rng.integers(0, 50257, size=(8, 4096))
    chosen = rng.integers(0, experts, size=(layers, 8, 4096, k))
    start = time.perf_counter()
    table.observed(ids, chosen)
    build = time.perf_counter() - start
    t = Table(title=f"routing table update per step: {vocab} ids x {experts} experts (Qwen2-57B-A14B's shape), "
                    f"{gpus} GPUs, {tokens_per_rank} tokens and {layers} MoE layers per rank")
    for col in ("update", "sent per rank", "received at the placing rank"):
        t.add_column(col)
    for label, key in (("dense: all-reduce of the fp64 table (before)", "dense"),
                       (f"sparse: the step's ids (<= {distinct.max()} a rank), gathered", "sparse"),
                       (f"hashed: {HASHED_BUCKETS} buckets' int32 counts, reduced (runtime above "
                        f"{EXACT_UP_TO_IDS} ids)", "hashed")):
        t.add_row(label, f"{b[key][0] / 2**20:.2f} MiB", f"{b[key][1] / 2**20:.2f} MiB")
    console.print(t)
    print(f"distinct ids per rank (GPT-2 tokenizer on trace v2's text): median {int(np.median(distinct))}, "
          f"max {distinct.max()}; a rank's sparse update of random routing in numpy: {1e3 * build:.0f} ms wall "
          f"(the runtime builds it on the device)")
    name = V2 if V2 in raw else "tiny-moe v1 (40 steps)"
    trace = raw[name]
    cuts = []
    for buckets in (None, HASHED_BUCKETS, 1024):
        pool = trace_pool(trace, 4, 2, 50257, buckets=buckets)
        r = evaluate(pool, LayerStrategy(dp=64, ep=4), 4, 2, 1, 16)
        cut = 100 * (1 - r["rows"]["step"] / r["rows"]["none"])
        cuts.append(f"{'exact' if buckets is None else buckets}: {cut:.1f}%")
    print(f"the table's prediction in buckets, per-step placement's cut on {name} at 64 GPUs: {', '.join(cuts)}")


# --- (b), (c) predictions ----------------------------------------------------------------------------


def planner_section(skew: float, cut: float, cut_label: str, console: Console) -> None:
    model, work = get_model("mixtral-8x7b"), Workload(global_batch=512, seq_len=4096)
    t = Table(title="mixtral-8x7b, 512 x 4096 tokens on 64 H100: predicted step time (cost model)")
    for col in ("plan", "routing", "step s", "exposed comm s"):
        t.add_column(col)
    searched = search(model, make_cluster("h100-80gb", 64), work)
    common = max({s.describe() for s in searched.layers[1:-1]}, key=[s.describe() for s in searched.layers].count)
    t.add_row(f"searched ({common}, ...)", "balanced", f"{searched.prediction.step_time_s:.3f}",
              f"{searched.prediction.exposed_comm_s:.3f}")
    skewed = search(with_routing(model, skew=skew), make_cluster("h100-80gb", 64), work)
    common = max({s.describe() for s in skewed.layers[1:-1]}, key=[s.describe() for s in skewed.layers].count)
    t.add_row(f"searched ({common}, ...)", f"skew {skew:.2f} (recorded trace)", f"{skewed.prediction.step_time_s:.3f}",
              f"{skewed.prediction.exposed_comm_s:.3f}")
    cluster4 = make_cluster("h100-80gb", 64, gpus_per_node=4)
    for label, scale in (("no placement", 1.0), (f"placement (cut {100 * cut:.0f}%, {cut_label})", 1 - cut)):
        plan = manual_plan(with_routing(model, internode_scale=scale), cluster4, work, dp=64, ep=8, zero=1,
                           dp_shard=4, recompute="full", micro_batch_size=1)
        t.add_row("dp64 zero1/hsdp4 ep8 rc:full, 4 GPUs/node (ep spans 2 nodes)", label,
                  f"{plan.prediction.step_time_s:.3f}", f"{plan.prediction.exposed_comm_s:.3f}")
    console.print(t)


def offload_section(skew: float, console: Console) -> float:
    model = get_model("mixtral-8x7b")
    cluster = make_cluster("a100-40gb", 4, gpus_per_node=4)
    host = HostSpec(flops=1e12, link_bandwidth=12e9)
    tokens = 512
    layers = with_routing(model, skew=skew)
    # Each GPU of a 4-stage pipeline holds 8 of the 32 MoE layers.
    stage = layers.model_copy(update={"layers": tuple([layers.layers[0], *layers.layers[1:9], layers.layers[-1]])})
    plan = plan_expert_offload(stage, cluster, Workload(global_batch=1, seq_len=tokens), host, tokens, skew=skew)
    t = Table(title=f"APTMoE: mixtral-8x7b fine-tuning, one GPU's 8 MoE layers, micro-batch of {tokens} tokens "
                    f"(predicted)")
    for col in ("where experts compute", "seconds per micro-batch (fwd + bwd)", "vs APTMoE"):
        t.add_column(col)
    for label, s in (("offload all: bring every expert", plan.offload_all_s), ("host all", plan.host_all_s),
                     ("APTMoE decision", plan.step_s)):
        t.add_row(label, f"{s:.3f}", f"{s / plan.step_s:.2f}x")
    console.print(t)
    where = plan.layers[0].where
    print(f"assumptions: a100-40gb, host link {host.link_bandwidth / 1e9:.0f} GB/s per GPU each way (PCIe 3.0 x16), "
          f"host {host.flops / 1e12:.0f} TFLOP/s per GPU, skew {skew:.2f}; layer 1 places its experts {list(where)} "
          f"(expert 0 the hottest); the host AdamW update, the same for all three, is left out")
    return plan.offload_all_s / plan.step_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-exact", action="store_true", help="skip the 4-rank exactness run (ep_runtime_exact=0)")
    ap.add_argument("--retrace", action="store_true", help="record the routing traces again (v2 takes long)")
    args = ap.parse_args()
    console = Console(width=190)
    exact = 0
    if not args.skip_exact:
        print("expert parallelism vs one process (4 ranks, gloo):")
        exact = run_exactness()
        print(f"  exact: {bool(exact)}")
    pools, raw = load_traces(args.retrace)
    placed = placement_section(pools, console)
    headline = V2 if V2 in pools else "tiny-moe v1 (40 steps)"
    cut = placed["cuts"][(headline, 64, 1, 1)]["layer"]
    p99 = 1e3 * np.percentile(placed["times"], 99)
    print(f"solves at 64 GPUs: p99 {p99:.1f} ms wall, {1e3 * np.percentile(placed['cpu'], 99):.1f} ms CPU")
    skew = routing_skew(np.concatenate([moe_traces.layer_slots(t) for t in raw.values()]), ep=4)
    planner_section(skew, cut / 100, f"per layer, trace {headline.split()[1]}", console)
    speedup = offload_section(skew, console)
    table_section(raw, console)
    print(f"summary: ep_runtime_exact={exact} internode_a2a_cut_pct={cut:.1f} placement_p99_ms={p99:.1f} "
          f"aptmoe_speedup_vs_offload_all={speedup:.2f}")


if __name__ == "__main__":
    main()
