"""Per-operation compute (cost/compute.py) against hand-computed numbers."""
import math

import numpy as np
import pytest

from tessera.cost.compute import (attention_seconds, gemm_seconds, layer_compute_time, linear_seconds,
                                  memory_bound_seconds)
from tessera.cost.layer import StepContext, StrategyTable, layer_costs
from tessera.plan import LayerStrategy
from tessera.search import manual_plan
from tessera.spec import ModelSpec, TransformerConfig, Workload
from tessera.spec.presets import get_model, local_cpu_cluster, make_cluster

H100 = make_cluster("h100-80gb", 8)
PEAK, EFF = 989e12, H100.compute_efficiency
BW = 3350e9 * 0.87


def test_presets_use_sustained_gemm_efficiency():
    # MAMF (80.3% / 86.9%) times the H200's MSMF / MAMF (755 / 834).
    assert EFF == pytest.approx(0.803 * 755 / 834)
    assert make_cluster("a100-80gb", 8).compute_efficiency == pytest.approx(0.869 * 755 / 834)


def test_large_gemm_pays_wave_quantisation_and_launch():
    m = n = k = 4096
    tiles = (4096 / 128) * (4096 / 256)  # 512 tiles of 128 x 256 on 132 SMs: 4 waves
    waves = tiles / (4 * 132)
    compute = 2 * m * n * k / (PEAK * EFF * waves)
    memory = 2 * (3 * 4096 * 4096) / BW
    assert max(compute, memory) == compute
    assert float(gemm_seconds(H100, "bf16", 2, m, n, k)) == pytest.approx(compute + 3e-6)


def test_a_skinny_gemm_is_slowed_by_its_short_k_and_bound_by_memory():
    # k = 96: prologue/epilogue cost ~128 k-steps: rate x (96/224) / (4096/4224).
    m, n, k = 2048, 2048, 96
    ramp = (96 / 224) / (4096 / 4224)
    tiles = 16 * 8
    compute = 2 * m * n * k / (PEAK * EFF * (tiles / 132) * ramp)
    memory = 2 * (m * k + k * n + m * n) / BW
    assert float(gemm_seconds(H100, "bf16", 2, m, n, k)) == pytest.approx(max(compute, memory) + 3e-6)
    # A matrix-vector shaped GEMM is memory-bound.
    m, n, k = 8, 8192, 8192
    assert float(gemm_seconds(H100, "bf16", 2, m, n, k)) == pytest.approx(2 * (m * k + k * n + m * n) / BW + 3e-6)


def test_a_cpu_prices_gemms_by_flops_at_its_flat_efficiency():
    cpu = local_cpu_cluster(2)
    assert float(gemm_seconds(cpu, "fp32", 4, 100, 200, 300)) == pytest.approx(2 * 100 * 200 * 300 / (50e9 * 0.5))


def test_tensor_parallel_shards_columns_and_rows():
    block = get_model("llama2-7b").layers[1]
    t, tp = 4096, 4
    fwd, dgrad, wgrad = linear_seconds(block, H100, "bf16", 2, np.array([t]), np.array([tp]), np.array([1]))
    exp_f = exp_d = exp_w = 0.0
    for mm in block.matmuls:
        n = mm.n / tp if mm.shard == "col" else mm.n
        k = mm.k / tp if mm.shard == "row" else mm.k
        exp_f += float(gemm_seconds(H100, "bf16", 2, t, n, k))
        exp_d += float(gemm_seconds(H100, "bf16", 2, t, k, n))
        exp_w += float(gemm_seconds(H100, "bf16", 2, k, n, t))
    assert (fwd[0], dgrad[0], wgrad[0]) == pytest.approx((exp_f, exp_d, exp_w))
    # The GEMMs are those the runtime issues: wq, wk, wv, wo, w1, w3, w2, FLOPs = the spec's.
    assert len(block.matmuls) == 7
    assert sum(2 * mm.n * mm.k for mm in block.matmuls) == pytest.approx(block.flops_per_token)


def test_flash_attention_runs_at_the_kernel_throughput():
    block = get_model("llama2-7b").layers[1]
    seqs, s = 8, 4096
    fwd, bwd = attention_seconds(block, H100, "bf16", 2, np.array([seqs]), s, np.array([1]), np.array([1]))
    flops = seqs * s * block.attn_flops_coeff * s  # causal FLOPs of the spec
    blocks = seqs * 32 * s / 128  # thread blocks: batch x heads x query tiles, 8192 on 132 SMs
    waves = blocks / (math.ceil(blocks / 132) * 132)
    eff_f, eff_b = H100.device.attention_efficiency
    assert fwd[0] == pytest.approx(flops / (PEAK * eff_f * waves) + 3e-6)
    assert bwd[0] == pytest.approx(2.5 * flops / (PEAK * eff_b * waves) + 3e-6)


def test_unfused_attention_materialises_the_scores():
    cfg = TransformerConfig(name="g", family="gpt2", vocab_size=1000, hidden=2304, num_layers=1, num_heads=24,
                            num_kv_heads=24, ffn_hidden=4 * 2304, norm="layernorm", mlp="gelu", position="learned",
                            linear_bias=True)
    block = ModelSpec.from_config(cfg, attention="unfused", kernels="fused", dropout=True).layers[1]
    assert (block.score_bytes_fwd, block.score_bytes_bwd, block.act_score_bytes) == (9.0, 11.0, 5.0)
    a100 = make_cluster("a100-80gb", 8)
    seqs, s, d = 2, 2048, 96
    fwd, bwd = attention_seconds(block, a100, "fp16", 2, np.array([seqs]), s, np.array([1]), np.array([1]))
    batch = seqs * 24
    qk = gemm_seconds(a100, "fp16", 2, s, s, d, batch)
    av = gemm_seconds(a100, "fp16", 2, s, d, s, batch)
    scores = batch * s * s
    bw = a100.device.streaming_bandwidth
    assert fwd[0] == pytest.approx(float(qk + av) + scores * 9.0 / bw)
    assert bwd[0] == pytest.approx(float(qk + 3 * av) + scores * 11.0 / bw)


def test_memory_bound_work_is_bytes_over_bandwidth():
    block = get_model("llama2-7b").layers[1]
    # eager: norms 8h, residual adds 12h (replicated); rope 48 (q + kv), attention copy 4q, SwiGLU 10f.
    h, f = 4096, 11008
    assert block.elementwise_bytes_replicated == 20 * h
    assert block.elementwise_bytes_tp == 48 * (h + h) + 4 * h + 10 * f
    fwd, bwd = memory_bound_seconds(block, H100, 2, 1000.0, 2, 1)
    moved = 1000 * (block.elementwise_bytes_tp / 2 + block.elementwise_bytes_replicated)
    assert fwd == pytest.approx(moved / BW + block.kernels * 3e-6)
    assert bwd == pytest.approx(2 * fwd)


def test_small_micro_batches_cost_more_per_token():
    block = get_model("llama2-7b").layers[1]
    wl = Workload(global_batch=64, seq_len=4096)
    per_token = []
    for B in (8, 64):  # 1 and 8 sequences per device at dp 8
        ctx = StepContext(cluster=H100, workload=wl, stage_size=8, micro_batch_seqs=B)
        c = layer_costs(block, StrategyTable.build([LayerStrategy(dp=8)]), ctx)
        per_token.append(float(c.compute_fwd[0] + c.compute_bwd[0]) / (B / 8 * 4096))
    assert per_token[0] > per_token[1]
    # At tp 8 a single short sequence leaves the GEMMs' waves half empty: far costlier per token.
    ctx = StepContext(cluster=H100, workload=Workload(global_batch=8, seq_len=512), stage_size=8, micro_batch_seqs=1)
    small = layer_costs(block, StrategyTable.build([LayerStrategy(dp=1, tp=8)]), ctx)
    ctx = StepContext(cluster=H100, workload=Workload(global_batch=8, seq_len=512), stage_size=8, micro_batch_seqs=8)
    big = layer_costs(block, StrategyTable.build([LayerStrategy(dp=1, tp=8)]), ctx)
    assert float(small.compute_fwd[0]) * 8 > 1.3 * float(big.compute_fwd[0])


def test_a_measured_layer_is_priced_by_its_profile():
    block = get_model("llama2-7b").layers[1].model_copy(update=dict(compute_measured=True, linear_time_scale=1.5,
                                                                     attn_time_scale=2.0))
    wl = Workload(global_batch=8, seq_len=4096)
    ctx = StepContext(cluster=H100, workload=wl, stage_size=8, micro_batch_seqs=8)
    c = layer_costs(block, StrategyTable.build([LayerStrategy(dp=8)]), ctx)
    tokens = 4096
    expected = tokens * (block.flops_per_token * 1.5 + block.attn_flops_coeff * 4096 * 2.0) / (PEAK * EFF)
    assert float(c.compute_fwd[0]) == pytest.approx(expected)
    assert layer_compute_time(block, 4096, tokens, 1, H100, "bf16")[0] == pytest.approx(expected)


def test_mfu_is_not_capped_by_hand():
    # Large GEMMs on H100: MFU above the old flat 60% is possible only when GEMM-bound; a small model
    # with short sequences stays well below it.
    big = manual_plan(get_model("llama2-70b"), make_cluster("h100-80gb", 64), Workload(global_batch=64, seq_len=4096),
                      tp=8, pp=2, sp="megatron", micro_batch_size=1, recompute="selective").prediction
    small = manual_plan(get_model("gpt2"), make_cluster("h100-80gb", 8), Workload(global_batch=64, seq_len=1024),
                        micro_batch_size=1).prediction
    assert small.mfu < big.mfu < EFF


def test_another_trainers_execution_is_priced_and_refused_by_the_runtime():
    """Megatron-LM 2021's reentrant checkpoint replays every TP collective of a block (one more
    all-reduce each way than the runtime's early-stopping checkpoint), and its sync after the
    whole backward exposes the data-parallel all-reduce in full; the runtime refuses such a spec."""
    from tessera.cost import evaluate
    from tessera.cost.collectives import step_collectives
    from tessera.errors import TesseraError
    from tessera.runtime.parallelize import check_plan_supported

    cfg = get_model("llama2-7b").config
    cluster = make_cluster("a100-80gb", 16)
    workload = Workload(global_batch=64, seq_len=2048)
    plans = {}
    for name, kw in (("tessera", {}), ("replay", dict(checkpoint="reentrant")),
                     ("after", dict(grad_sync="after_backward"))):
        model = ModelSpec.from_config(cfg, **kw)
        plans[name] = manual_plan(model, cluster, workload, tp=2, dp=8, recompute="full", micro_batch_size=2)

    def tp_all_reduces(plan):
        return sum(c.count for c in step_collectives(plan, 0) if c.kind == "all_reduce" and c.group_size == 2
                   and c.layer.startswith("block"))

    blocks = cfg.num_layers
    assert tp_all_reduces(plans["replay"]) - tp_all_reduces(plans["tessera"]) == blocks * plans["tessera"].num_micro_batches
    base, replay, after = (evaluate(plans[k]) for k in ("tessera", "replay", "after"))
    assert replay.step_time_s > base.step_time_s and after.step_time_s > base.step_time_s
    assert after.exposed_comm_s > base.exposed_comm_s
    for name in ("replay", "after"):
        with pytest.raises(TesseraError, match=r"plan\.model\.layers\[0\]\.(recompute_replays_all|grad_sync_after_backward)"):
            check_plan_supported(plans[name], 16)
    with pytest.raises(ValueError, match="checkpoint must be"):
        ModelSpec.from_config(cfg, checkpoint="sometimes")
