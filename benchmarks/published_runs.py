"""Predicted vs published training throughput of Megatron-LM's published runs, each as a hand plan.

Source (the only table this benchmark could read as text; see "H100" below):

  D. Narayanan, M. Shoeybi, J. Casper, P. LeGresley, M. Patwary, V. Korthikanti, D. Vainbrand,
  P. Kashinkunti, J. Bernauer, B. Catanzaro, A. Phanishayee, M. Zaharia, "Efficient Large-Scale
  Language Model Training on GPU Clusters Using Megatron-LM", SC'21 (arXiv 2104.04473), Table 1:
  GPT models of 1.7B to 1T parameters on up to 3,072 A100-80GB GPUs of NVIDIA's Selene (DGX A100
  nodes of 8 GPUs, 8 HDR InfiniBand NICs each), vocabulary 51,200, sequence length 2,048, with the
  achieved teraFLOP/s per GPU. Micro-batch sizes, interleaving and recompute as the paper's own
  reproduction scripts set them: NVIDIA/Megatron-LM examples/sc21/run_table_1.sh (MBS, GBS,
  `--num-layers-per-virtual-pipeline-stage`, `--recompute-method uniform`: full activation
  recomputation of every layer) and CONFIG.sh (`--fp16`, sequence 2,048). Megatron-LM of 2021 ran
  GPT-2-style blocks (LayerNorm, GeLU, biases, learned positions, tied embeddings) with dropout 0.1,
  fused kernels (bias-GeLU, bias-dropout-add, scale-mask-softmax, apex LayerNorm) and attention
  scores materialised (no flash attention): the model is built that way
  (`ModelSpec.from_config(..., attention="unfused", kernels="fused", dropout=True)`). The plan:
  tensor parallel without sequence parallelism, pipeline stages of equal numbers of blocks (the
  embedding on the first, the head on the last), 1F1B or interleaved 1F1B, no ZeRO.

Each row's predicted step time is converted with the paper's own FLOP formula (its eq. 3: a
training iteration with full recompute is 96 B s l h^2 (1 + s / 6h + V / 16 l h) FLOPs) into
teraFLOP/s per GPU, exactly as the published figure was computed. Then `tessera.search.search`
plans the same model on the same GPUs, batch and sequence length; "search" is its prediction in
the same units, and the search is "not worse" when its predicted step is no slower than the
published plan's.

H100: the brief also asks for Megatron-Core's H100 table (NVIDIA/Megatron-LM README, "Training
Speed and Scalability", 2B-462B on up to 6,144 H100s). That table is published only as an image
(`images/model_table.png`); its text gives only the range (41% MFU for the smallest model, 47-48%
for the largest, GPT-3 175B strong-scaled from 96 to 4,608 GPUs at batch 1,152 going from 47% to
42%) but not the parallel configurations per row. No row can be encoded without guessing, so none
is; the summary's `spearman_min` is over the table that could be read (`tables=1`).

Run: python benchmarks/published_runs.py [--no-search]
Last line: summary: rows=<n> median_err_pct=<x> max_err_pct=<y> spearman_min=<z> search_not_worse=<k>/<n>
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scipy.stats import spearmanr  # noqa: E402

from tessera.cost import evaluate  # noqa: E402
from tessera.plan import Plan  # noqa: E402
from tessera.search import manual_plan, search  # noqa: E402
from tessera.spec import ModelSpec, TransformerConfig, Workload  # noqa: E402
from tessera.spec.presets import make_cluster  # noqa: E402

SEQ, VOCAB = 2048, 51200


@dataclass(frozen=True)
class Row:
    params_b: float  # the paper's parameter count (billions)
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    micro_batch: int  # run_table_1.sh MBS
    layers_per_virtual_stage: int  # run_table_1.sh --num-layers-per-virtual-pipeline-stage (0: not interleaved)
    tflops: float  # published achieved teraFLOP/s per GPU


# Narayanan et al. SC'21, Table 1 (and run_table_1.sh for MBS and interleaving).
SC21 = [
    Row(1.7, 24, 2304, 24, 1, 1, 32, 512, 16, 0, 137),
    Row(3.6, 32, 3072, 30, 2, 1, 64, 512, 16, 0, 138),
    Row(7.5, 32, 4096, 36, 4, 1, 128, 512, 16, 0, 142),
    Row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 8, 0, 135),
    Row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 4, 0, 138),
    Row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 2, 5, 140),
    Row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 2, 5, 148),
    Row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 1, 3, 155),
    Row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 1, 1, 163),
    Row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 1, 0, 163),
]


def megatron_flops(row: Row) -> float:
    """FLOPs of one iteration, Narayanan et al. eq. 3 (with activation recomputation)."""
    B, s, l, h, V = row.batch, SEQ, row.layers, row.hidden, VOCAB
    return 96.0 * B * s * l * h * h * (1 + s / (6.0 * h) + V / (16.0 * l * h))


def model_of(row: Row) -> ModelSpec:
    cfg = TransformerConfig(name=f"megatron-gpt-{row.params_b:g}b", family="gpt2", vocab_size=VOCAB,
                            hidden=row.hidden, num_layers=row.layers, num_heads=row.heads, num_kv_heads=row.heads,
                            ffn_hidden=4 * row.hidden, max_seq_len=SEQ, norm="layernorm", mlp="gelu",
                            position="learned", linear_bias=True, tie_embeddings=True)
    return ModelSpec.from_config(cfg, attention="unfused", kernels="fused", dropout=True)


def published_plan(row: Row, model: ModelSpec, cluster, workload: Workload) -> Plan:
    """The published configuration as a plan: Megatron's equal stages of blocks."""
    v = row.layers // (row.pp * row.layers_per_virtual_stage) if row.layers_per_virtual_stage else 1
    plan = manual_plan(model, cluster, workload, tp=row.tp, pp=row.pp, recompute="full",
                       micro_batch_size=row.micro_batch, schedule="interleaved_1f1b" if v > 1 else "1f1b",
                       virtual_stages=v, name="published")
    chunks = row.pp * v
    per = row.layers // chunks
    cuts = [0] + [1 + per * i for i in range(1, chunks)] + [row.layers + 2]  # +1: the embedding layer
    stages = tuple(zip(cuts[:-1], cuts[1:]))
    plan = plan.model_copy(update={"pipeline": plan.pipeline.model_copy(update={"stages": stages})})
    return plan.model_copy(update={"prediction": evaluate(plan)})


def describe(plan: Plan) -> str:
    s = plan.layers[len(plan.layers) // 2]
    v = plan.pipeline.virtual_stages
    return (f"pp{plan.pipeline.degree}{f'v{v}' if v > 1 else ''} m{plan.num_micro_batches}x{plan.micro_batch_size} "
            f"{s.describe()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-search", action="store_true", help="skip the free searches (faster)")
    args = ap.parse_args()
    print(f"{'model':>8} {'GPUs':>5} {'TP':>3} {'PP':>3} {'v':>2} {'MBS':>4} {'GBS':>5} | {'published':>9} "
          f"{'predicted':>9} {'error':>7} | {'step s':>7} {'comm s':>6} {'bubble':>6} {'GiB':>5} | "
          f"{'search':>7} {'search s':>8} {'time s':>6}  searched plan")
    errors, published, predicted, not_worse, searched = [], [], [], 0, 0
    for row in SC21:
        model, cluster = model_of(row), make_cluster("a100-80gb", row.gpus)
        workload = Workload(global_batch=row.batch, seq_len=SEQ, dtype="fp16")
        plan = published_plan(row, model, cluster, workload)
        p = plan.prediction
        tf = megatron_flops(row) / p.step_time_s / row.gpus / 1e12
        err = 100.0 * (tf / row.tflops - 1.0)
        errors.append(abs(err))
        published.append(row.tflops)
        predicted.append(tf)
        line = (f"{row.params_b:>7g}B {row.gpus:>5} {row.tp:>3} {row.pp:>3} {plan.pipeline.virtual_stages:>2} "
                f"{row.micro_batch:>4} {row.batch:>5} | {row.tflops:>9.0f} {tf:>9.1f} {err:>+6.1f}% | "
                f"{p.step_time_s:>7.2f} {p.exposed_comm_s:>6.2f} {p.bubble_s:>6.2f} "
                f"{p.peak_memory / 2**30:>5.1f} |")
        if not args.no_search:
            t0 = time.process_time()
            best = search(model, cluster, workload)
            dt = time.process_time() - t0
            bp = best.prediction
            searched += 1
            ok = bp.step_time_s <= p.step_time_s * (1 + 1e-9)
            not_worse += ok
            line += (f" {megatron_flops(row) / bp.step_time_s / row.gpus / 1e12:>7.1f} {bp.step_time_s:>8.2f} "
                     f"{dt:>6.1f}  {describe(best)}{'' if ok else '  (SLOWER than published)'}")
        print(line, flush=True)
    rho = spearmanr(published, predicted).statistic
    print(f"A100 (SC'21 Table 1): spearman={rho:.2f} over {len(SC21)} rows; H100 (Megatron-Core README): "
          f"no row (the table is an image, see the docstring); tables=1")
    print("teraFLOP/s per GPU by the paper's formula; search: the free search's plan in the same units "
          "(its plan may differ from the published one); process time on this machine")
    print(f"summary: rows={len(SC21)} median_err_pct={statistics.median(errors):.1f} "
          f"max_err_pct={max(errors):.1f} spearman_min={rho:.2f} "
          f"search_not_worse={not_worse}/{searched if searched else len(SC21)}")


if __name__ == "__main__":
    main()
