"""Predicted vs published training throughput of published large training runs, each as a hand plan.

A100 (Megatron-LM's own runs):

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
  scores materialised (no flash attention). Its trainer of that year (megatron/training.py
  `train_step`, `--DDP-impl local`, the default) all-reduced the data-parallel gradients after
  `forward_backward_func` had returned, i.e. after the whole backward, not overlapped with it; its
  activation checkpointing (megatron/mpu/random.py `CheckpointFunction`, reentrant) re-ran each
  checkpointed layer's whole forward in the backward, both tensor-parallel all-reduces included
  (Tessera's runtime, a non-reentrant checkpoint, stops at the last saved tensor). The model is
  built that way (`ModelSpec.from_config(..., attention="unfused", kernels="fused", dropout=True,
  checkpoint="reentrant", grad_sync="after_backward")`; the runtime refuses such a spec). The plan:
  tensor parallel without sequence parallelism, pipeline stages of equal numbers of blocks (the
  embedding on the first, the head on the last), 1F1B or interleaved 1F1B, no ZeRO.

Each row's predicted step time is converted with the paper's own FLOP formula (its eq. 3: a
training iteration with full recompute is 96 B s l h^2 (1 + s / 6h + V / 16 l h) FLOPs) into
teraFLOP/s per GPU, exactly as the published figure was computed. Then `tessera.search.search`
plans the same model on the same GPUs, batch and sequence length; "search" is its prediction in
the same units, and the search is "not worse" when its predicted step is no slower than the
published plan's.

H100. Megatron-Core's own H100 figures are published as text only for FP8 runs of dense
models: every DGX-H100 dense-model pretraining row of the NeMo framework performance summaries
(24.07 to 25.07, docs.nvidia.com/nemo-framework/user-guide/<release>/performance/
performance_summary.html) and of Megatron-Bridge's (25.09 to 26.02, docs.nvidia.com/nemo/
megatron-bridge/latest/performance-summary.html and performance-summary-archive.html) is FP8; the
only BF16 DGX-H100 rows there are mixture-of-experts models with expert parallelism (GPT-OSS
120B, EP 8), and the Megatron-LM README's table is an image. A plan here has no FP8 and no EP
rows to stand for them, so the H100 table falls back to the published BF16 H100 runs whose
configuration is given in full:

  Llama Team, AI @ Meta, "The Llama 3 Herd of Models", arXiv 2407.21783 (July 2024), Table 4:
  Llama 3 405B pre-training on 8,192 and 16,384 H100-80GB (700 W, HBM3; 8 per server over
  NVLink, 400 Gb/s RoCE per GPU: the DGX-H100 preset's figures), TP 8, PP 16, CP 1, BF16,
  sequences of 8,192 tokens, 16M tokens per batch (32 and 16 sequences per data-parallel
  replica: global batch 2,048), 430 and 400 TFLOP/s per GPU; and its third row, the long-context
  stage: 16,384 GPUs, TP 8, CP 16, PP 16, DP 8, sequences of 131,072 tokens, 16 per replica
  (global batch 128, 16M tokens), 380 TFLOP/s per GPU, encoded like the other two (ZeRO-2, no
  recomputation, v = 2, one sequence per micro-batch, Megatron SP) with the plan's context
  parallelism, which the runtime runs as ring attention (the paper's CP all-gathers K/V instead,
  section 3.3.2; with grouped-query attention both move little next to the attention they
  overlap: the cost model prices the ring). As the paper describes the run (section
  3.3.2): FSDP sharding optimizer states and gradients but not re-sharding parameters after the
  forward, gradients accumulated over the micro-batches in FP32 and then reduce-scattered in FP32
  (section 3.3.4): one reduce-scatter per step, ZeRO-1 in Tessera's contract (ZeRO-2 would
  reduce-scatter every micro-batch; gradients fp32, the workload's default), no activation recomputation at 8K tokens, the interleaved schedule with
  the first and last stages one Transformer layer short (here: 128 layers = embedding + 126
  blocks + head in 16 v equal chunks, so the embedding and head take a block's place). Not given
  there, chosen and stated: one sequence per micro-batch (32 and 16 micro-batches: the 16K-GPU
  row runs as many as pipeline stages, the smallest count the schedule allows); v = 2 virtual
  stages per rank, as the paper's Figure 6 draws its schedule (v = 4 gives +8.5% / +4.8%, v = 8
  +13% / +13%, v = 1 -17% / -33%); Megatron-style sequence parallelism inside TP (torchtitan's
  TP plan, Meta's, applies it; without it a rank's activations alone would exceed 80 GB); and
  Megatron-like fused kernels with flash attention (`kernels="fused"`).
  FLOP formula: the paper gives none. Converted with Meta's own MFU formula (torchtitan,
  `get_num_flop_per_token`; PaLM, Chowdhery et al. 2022, appendix B): 6 N + 12 L H Q T FLOPs per
  token, N the parameters without the embedding, L layers, H heads, Q head dimension, T the
  sequence length (the attention term is 8% of it here; torchtitan's table below checks the
  formula: 5,762 tokens/s on Llama 3.1 8B is its stated 33% MFU of 989 TFLOP/s).

  Reference rows, not scored: torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (Dec 2024),
  Llama 3.1 8B, FSDP on 8 and 128 GPUs, BF16 (eager and torch.compile; the other rows are
  Float8). Their plan is not one the plan space holds: torchtitan's "op" selective activation
  checkpointing recomputes every other matmul and all element-wise work, which neither the
  runtime's selective recompute (matmul outputs kept) nor full recompute is; and their H100s are
  an HBM2e 96 GB part at a 500 W limit whose sustained clock nobody publishes (the page says its
  peak lies between the SXM's and the NVL's). They are printed beside their nearest expressible
  plan (selective recompute, the SXM's compute, the page's 2.4 TB/s) to show the size of that
  gap, and left out of the summary.

Run: python benchmarks/published_runs.py [--no-search]
Last line: summary: rows=<n> median_err_pct=<x> max_err_pct=<y> spearman_min=<z> search_not_worse=<k>/<n>
(rows, errors and searches over both tables; spearman_min the smaller of their rank correlations)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scipy.stats import spearmanr  # noqa: E402

from tessera.cost import evaluate  # noqa: E402
from tessera.plan import Plan  # noqa: E402
from tessera.search import manual_plan, search  # noqa: E402
from tessera.spec import ModelSpec, TransformerConfig, Workload  # noqa: E402
from tessera.spec.presets import make_cluster  # noqa: E402
from tessera.spec.presets.models import get_model_config  # noqa: E402

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


@dataclass(frozen=True)
class H100Row:
    label: str
    model: str  # preset name (tessera.spec.presets.models)
    gpus: int
    tp: int
    pp: int
    virtual: int  # chunks per pipeline rank (1: plain 1F1B)
    batch: int  # global batch (sequences)
    micro_batch: int
    seq: int
    zero: int
    sp: str
    recompute: str
    kernels: str
    published_tflops: float = 0.0  # as published, in the source's units
    published_tokens_per_gpu: float = 0.0  # torchtitan publishes tokens/s per GPU
    cp: int = 1  # context-parallel degree


# Llama 3 paper, Table 4 (see the module docstring for what is read and what is chosen).
LLAMA3 = [
    H100Row("Llama3 405B", "llama3-405b", 8192, 8, 16, 2, 2048, 1, 8192, 1, "megatron", "none", "fused",
            published_tflops=430),
    H100Row("Llama3 405B", "llama3-405b", 16384, 8, 16, 2, 2048, 1, 8192, 1, "megatron", "none", "fused",
            published_tflops=400),
    H100Row("Llama3 405B CP16", "llama3-405b", 16384, 8, 16, 2, 128, 1, 131072, 2, "megatron", "none", "fused",
            published_tflops=380, cp=16),
]
# torchtitan, benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3, BF16 rows (not scored).
TORCHTITAN = [
    H100Row("tt 8B FSDP", "llama3-8b", 8, 1, 1, 1, 16, 2, 8192, 3, "none", "selective", "eager",
            published_tokens_per_gpu=5762),
    H100Row("tt 8B FSDP+compile", "llama3-8b", 8, 1, 1, 1, 16, 2, 8192, 3, "none", "selective", "fused",
            published_tokens_per_gpu=6667),
    H100Row("tt 8B FSDP", "llama3-8b", 128, 1, 1, 1, 256, 2, 8192, 3, "none", "selective", "eager",
            published_tokens_per_gpu=5605),
    H100Row("tt 8B FSDP+compile", "llama3-8b", 128, 1, 1, 1, 256, 2, 8192, 3, "none", "selective", "fused",
            published_tokens_per_gpu=6514),
]


def megatron_flops(row: Row) -> float:
    """FLOPs of one iteration, Narayanan et al. eq. 3 (with activation recomputation)."""
    B, s, l, h, V = row.batch, SEQ, row.layers, row.hidden, VOCAB
    return 96.0 * B * s * l * h * h * (1 + s / (6.0 * h) + V / (16.0 * l * h))


def palm_flops_per_token(cfg: TransformerConfig, seq: int) -> float:
    """Meta's MFU numerator (torchtitan `get_num_flop_per_token`, PaLM appendix B): 6 N + 12 L H Q T,
    N the parameters without the token embedding."""
    n = ModelSpec.from_config(cfg).num_params - cfg.vocab_size * cfg.hidden
    return 6.0 * n + 12.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq


def model_of(row: Row) -> ModelSpec:
    cfg = TransformerConfig(name=f"megatron-gpt-{row.params_b:g}b", family="gpt2", vocab_size=VOCAB,
                            hidden=row.hidden, num_layers=row.layers, num_heads=row.heads, num_kv_heads=row.heads,
                            ffn_hidden=4 * row.hidden, max_seq_len=SEQ, norm="layernorm", mlp="gelu",
                            position="learned", linear_bias=True, tie_embeddings=True)
    return ModelSpec.from_config(cfg, attention="unfused", kernels="fused", dropout=True, checkpoint="reentrant",
                                 grad_sync="after_backward")


def equal_chunks(plan: Plan, chunks: int) -> Plan:
    """The plan with its layers (embedding and head included) cut into `chunks` equal runs."""
    n = len(plan.model.layers)
    if n % chunks:
        raise SystemExit(f"{n} layers do not split into {chunks} equal chunks")
    per = n // chunks
    stages = tuple((i * per, (i + 1) * per) for i in range(chunks))
    plan = plan.model_copy(update={"pipeline": plan.pipeline.model_copy(update={"stages": stages})})
    return plan.model_copy(update={"prediction": evaluate(plan)})


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


def h100_case(row: H100Row, device_note: bool = False):
    """(model config, plan) of an H100 row (see the module docstring)."""
    cfg = get_model_config(row.model).model_copy(update={"max_seq_len": row.seq})
    model = ModelSpec.from_config(cfg, kernels=row.kernels)
    cluster = make_cluster("h100-80gb", row.gpus)
    if device_note:  # torchtitan's H100s: 96 GB of HBM2e at 2.4 TB/s (compute as the SXM's, see the docstring)
        cluster = cluster.model_copy(update={"device": cluster.device.model_copy(
            update={"name": "h100-96gb-hbm2e", "memory_bytes": 96e9, "memory_bandwidth": 2.4e12})})
    # Gradients in fp32 (the default): Llama 3 accumulated gradients over micro-batches and
    # reduce-scattered them in FP32 (paper, section 3.3.4); torchtitan's FSDP2 reduces in fp32.
    workload = Workload(global_batch=row.batch, seq_len=row.seq, dtype="bf16")
    plan = manual_plan(model, cluster, workload, tp=row.tp, pp=row.pp, zero=row.zero, sp=row.sp,
                       recompute=row.recompute, micro_batch_size=row.micro_batch,
                       schedule="interleaved_1f1b" if row.virtual > 1 else "1f1b", virtual_stages=row.virtual,
                       name="published", cp=row.cp)
    if row.pp > 1:
        plan = equal_chunks(plan, row.pp * row.virtual)
    return cfg, plan


def describe(plan: Plan) -> str:
    s = plan.layers[len(plan.layers) // 2]
    v = plan.pipeline.virtual_stages
    return (f"pp{plan.pipeline.degree}{f'v{v}' if v > 1 else ''} m{plan.num_micro_batches}x{plan.micro_batch_size} "
            f"{s.describe()}")


@dataclass
class Scored:
    published: list = field(default_factory=list)
    predicted: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    not_worse: int = 0
    searched: int = 0

    def spearman(self) -> float:
        return float(spearmanr(self.published, self.predicted).statistic)


def score(table: Scored, published: float, predicted: float, plan: Plan, to_units, model, cluster, workload,
          do_search: bool) -> str:
    """Record one row; return the right-hand part of its line (search and memory)."""
    p = plan.prediction
    err = 100.0 * (predicted / published - 1.0)
    table.published.append(published)
    table.predicted.append(predicted)
    table.errors.append(abs(err))
    line = (f"{published:>9.0f} {predicted:>9.1f} {err:>+6.1f}% | {p.step_time_s:>7.2f} {p.exposed_comm_s:>6.2f} "
            f"{p.bubble_s:>6.2f} {p.peak_memory / 2**30:>5.1f}{'' if p.fits else '!'} |")
    if do_search:
        t0 = time.process_time()
        best = search(model, cluster, workload)
        dt = time.process_time() - t0
        bp = best.prediction
        table.searched += 1
        ok = bp.step_time_s <= p.step_time_s * (1 + 1e-9)
        table.not_worse += ok
        line += (f" {to_units(bp.step_time_s):>7.1f} {bp.step_time_s:>8.2f} {dt:>6.1f}  {describe(best)}"
                 f"{'' if ok else '  (SLOWER than published)'}")
    return line


HEADER = (f"{'published':>9} {'predicted':>9} {'error':>7} | {'step s':>7} {'comm s':>6} {'bubble':>6} {'GiB':>5} | "
          f"{'search':>7} {'search s':>8} {'time s':>6}  searched plan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-search", action="store_true", help="skip the free searches (faster)")
    args = ap.parse_args()
    a100, h100 = Scored(), Scored()
    print("A100 — Megatron-LM SC'21 Table 1, teraFLOP/s per GPU by the paper's eq. 3")
    print(f"{'model':>8} {'GPUs':>5} {'TP':>3} {'PP':>3} {'v':>2} {'MBS':>4} {'GBS':>5} | " + HEADER)
    for row in SC21:
        model, cluster = model_of(row), make_cluster("a100-80gb", row.gpus)
        # Gradients in fp16: Megatron-LM forces fp32 gradient accumulation and all-reduce for bf16
        # only; CONFIG.sh's --fp16 runs without --accumulate-allreduce-grads-in-fp32.
        workload = Workload(global_batch=row.batch, seq_len=SEQ, dtype="fp16", grad_dtype="fp16")
        plan = published_plan(row, model, cluster, workload)
        units = lambda step, row=row: megatron_flops(row) / step / row.gpus / 1e12  # noqa: E731
        line = score(a100, row.tflops, units(plan.prediction.step_time_s), plan, units, model, cluster, workload,
                     not args.no_search)
        print(f"{row.params_b:>7g}B {row.gpus:>5} {row.tp:>3} {row.pp:>3} {plan.pipeline.virtual_stages:>2} "
              f"{row.micro_batch:>4} {row.batch:>5} | " + line, flush=True)
    print(f"A100: spearman={a100.spearman():.2f} over {len(SC21)} rows")

    print("\nH100 — Llama 3 paper Table 4 (BF16; NVIDIA publishes Megatron-Core's H100 dense rows as FP8 only, "
          "see the docstring), teraFLOP/s per GPU by 6N + 12LHQT")
    print(f"{'model':>19} {'GPUs':>5} {'TP':>3} {'CP':>3} {'PP':>3} {'v':>2} {'MBS':>4} {'GBS':>5} | " + HEADER)
    for row in LLAMA3:
        cfg, plan = h100_case(row)
        per_token = palm_flops_per_token(cfg, row.seq)
        units = lambda step, row=row, k=per_token: row.batch * row.seq / step / row.gpus * k / 1e12  # noqa: E731
        line = score(h100, row.published_tflops, units(plan.prediction.step_time_s), plan, units, plan.model,
                     plan.cluster, plan.workload, not args.no_search)
        print(f"{row.label:>19} {row.gpus:>5} {row.tp:>3} {row.cp:>3} {row.pp:>3} {row.virtual:>2} "
              f"{row.micro_batch:>4} {row.batch:>5} | " + line, flush=True)
    print(f"H100: spearman={h100.spearman():.2f} over {len(LLAMA3)} rows")
    print("\nReference, not scored — torchtitan Dec 2024 BF16 rows (op-level selective checkpointing and a 500 W "
          "HBM2e H100: outside the plan space and the presets; nearest plan: selective recompute, SXM compute)")
    for row in TORCHTITAN:
        cfg, plan = h100_case(row, device_note=True)
        per_token = palm_flops_per_token(cfg, row.seq)
        pub = row.published_tokens_per_gpu * per_token / 1e12
        pred = row.batch * row.seq / plan.prediction.step_time_s / row.gpus * per_token / 1e12
        print(f"{row.label:>19} {row.gpus:>5} {row.tp:>3} {row.cp:>3} {row.pp:>3} {row.virtual:>2} "
              f"{row.micro_batch:>4} {row.batch:>5} | {pub:>9.0f} {pred:>9.1f} {100 * (pred / pub - 1):>+6.1f}%  "
              f"({row.published_tokens_per_gpu:,.0f} tokens/s/GPU published, {row.kernels} kernels)")
    print("\npublished/predicted in each table's units; GiB: the predicted peak ('!': above the planner's budget); "
          "search: the free search's plan in the same units; time s: process time on this machine")
    errors = a100.errors + h100.errors
    n = len(errors)
    searched = a100.searched + h100.searched
    print(f"summary: rows={n} median_err_pct={statistics.median(errors):.1f} max_err_pct={max(errors):.1f} "
          f"spearman_min={min(a100.spearman(), h100.spearman()):.2f} "
          f"search_not_worse={a100.not_worse + h100.not_worse}/{searched if searched else n}")


if __name__ == "__main__":
    main()
