"""Context parallelism in the cost model, term by term against hand computation, and in the search:
the 405B model at 128K tokens on 16,384 H100s uses it, and a plan whose bubble exceeds half of
its step says so."""
import numpy as np
import pytest

from tessera.cost.compute import ATTENTION_BACKWARD_FLOPS, _waves, attention_seconds
from tessera.cost.layer import (StepContext, StrategyTable, layer_costs, overlap_extra, ring_attention_comm,
                                ring_buffer_bytes, shape_key, transition_time)
from tessera.plan import LayerStrategy
from tessera.search import SearchOptions, manual_plan, search
from tessera.search.explain import bubble_warning
from tessera.spec import ModelSpec, TransformerConfig, Workload
from tessera.spec.presets import make_cluster
from tessera.spec.presets.models import get_model_config

# GQA: 32 query heads, 8 K/V heads of 128.
CFG = TransformerConfig(name="gqa", hidden=4096, num_layers=2, num_heads=32, num_kv_heads=8, ffn_hidden=14336,
                        vocab_size=32000, max_seq_len=65536)
SEQ = 65536


def setup(gpus=16, seq=SEQ, batch=2):
    model = ModelSpec.from_config(CFG.model_copy(update={"max_seq_len": seq}))
    cluster = make_cluster("h100-80gb", gpus)
    workload = Workload(global_batch=batch, seq_len=seq)
    return model, cluster, workload


def costs(layer, ctx, **kw):
    return layer_costs(layer, StrategyTable.build([LayerStrategy(**kw)]), ctx)


def test_ring_messages_and_their_exposure_by_hand():
    model, cluster, workload = setup()
    block = model.layers[1]
    t = StrategyTable.build([LayerStrategy(dp=1, tp=2, cp=8, sp="megatron")])
    tokens = 2.0 * SEQ  # 2 sequences per micro-batch, one replica
    # K and V of the local 2 x 8192 tokens, 8 / tp = 4 K/V heads of 128, bf16: 33.5 MB per block.
    kv = 2 * (tokens / 8) * 4 * 128
    assert kv * 2 == 2 * 16384 * 4 * 128 * 2
    # cp group: stride tp = 2, 8 members -> ranks 0, 2, ..., 14 over two 8-GPU nodes: the network.
    link = cluster.inter_node
    p_kv = kv * 2 / link.bandwidth + link.latency
    p_grad = kv * 4 / link.bandwidth + link.latency
    af, ab = 0.010, 0.025  # attention core seconds per micro-batch (forward, backward)
    slow = cluster.overlap_slowdown
    fwd, bwd = ring_attention_comm(block, cluster, 2.0, tokens, t, np.array([af]), np.array([ab]), slow)
    assert fwd[0] == pytest.approx(7 * overlap_extra(af / 8, p_kv, slow), rel=1e-9)
    assert bwd[0] == pytest.approx(7 * overlap_extra(ab / 8, p_kv + p_grad, slow) + p_grad, rel=1e-9)
    # Inside a node (tp 1, cp 8: ranks 0..7) the blocks go over NVLink.
    t1 = StrategyTable.build([LayerStrategy(dp=2, cp=8)])
    intra = cluster.intra_node
    fwd1, _ = ring_attention_comm(block, cluster, 2.0, tokens / 2, t1, np.array([af]), np.array([ab]), slow)
    kv1 = 2 * (tokens / 2 / 8) * 8 * 128 * 2
    assert fwd1[0] == pytest.approx(7 * overlap_extra(af / 8, kv1 / intra.bandwidth + intra.latency, slow), rel=1e-9)
    # No ring without context parallelism.
    t0 = StrategyTable.build([LayerStrategy(dp=2, tp=8, sp="megatron")])
    assert ring_attention_comm(block, cluster, 2.0, tokens, t0, np.array([af]), np.array([ab]), slow)[0][0] == 0


def test_attention_work_and_kernels_per_rank():
    model, cluster, _ = setup()
    block = model.layers[1]
    one = attention_seconds(block, cluster, "bf16", 2.0, 2.0, SEQ, 1, 1, 1)
    eight = attention_seconds(block, cluster, "bf16", 2.0, 2.0, SEQ, 1, 1, 8)
    launch = cluster.device.kernel_launch_s
    # Load-balanced causal split: 1/8 of the work on each rank, in 8 kernels (one per ring step)
    # of 2 x 32 x 64 thread blocks (8 K local query rows / 128) instead of one of 2 x 32 x 512.
    waves = _waves(2 * 32 * 64, 132) / _waves(2 * 32 * 512, 132)
    assert eight[0] - 8 * launch == pytest.approx((one[0] - launch) / 8 / waves, rel=1e-9)
    assert eight[1] - 8 * launch == pytest.approx((one[1] - launch) / 8 / waves, rel=1e-9)
    assert (one[1] - launch) / (one[0] - launch) == pytest.approx(
        ATTENTION_BACKWARD_FLOPS * cluster.device.attention_efficiency[0] / cluster.device.attention_efficiency[1])


def test_activations_states_and_buffers_divide_as_the_runtime_holds_them():
    model, cluster, workload = setup()
    block = model.layers[1]
    ctx = StepContext(cluster=cluster, workload=workload, stage_size=16, micro_batch_seqs=2)
    cp8 = costs(block, ctx, dp=1, tp=2, cp=8, sp="megatron", zero=3)
    cp4 = costs(block, ctx, dp=1, tp=4, cp=4, sp="megatron", zero=3)
    dp2 = costs(block, ctx, dp=2, tp=2, cp=4, sp="megatron", zero=3)
    # Every per-token activation is divided by cp (and by dp's share of the batch).
    tp2 = costs(block, StepContext(cluster=cluster, workload=workload, stage_size=2, micro_batch_seqs=2),
                dp=1, tp=2, sp="megatron")
    assert cp8.act[0] == pytest.approx(tp2.act[0] / 8, rel=1e-9)
    assert dp2.act[0] == pytest.approx(cp8.act[0], rel=1e-9)
    # ZeRO-3 shards over dp x cp: the same 16-way shard of a tp-2 slice as dp 2 x cp 4 (the fp32
    # gradient shard; the bf16 parameters exist only while gathered).
    assert cp8.grads[0] == pytest.approx(dp2.grads[0], rel=1e-12)
    assert cp8.grads[0] == pytest.approx(4 * block.dense_params / 2 / 8, rel=1e-12)
    assert cp4.grads[0] == pytest.approx(4 * block.dense_params / 4 / 4, rel=1e-12)
    # The ring's backward buffers: L = 16384 local rows, 16 query and 4 K/V heads of 128 per rank.
    t = StrategyTable.build([LayerStrategy(dp=1, tp=2, cp=8, sp="megatron")])
    want = 16384 * 128 * (16 * (4 + 5 * 2) + 4 * (24 + 4 * 2))
    assert float(ring_buffer_bytes(block, 2.0, 2.0 * SEQ, t)[0]) == pytest.approx(want, rel=1e-12)
    t0 = StrategyTable.build([LayerStrategy(dp=1, tp=2, sp="megatron")])
    assert float(ring_buffer_bytes(block, 2.0, 2.0 * SEQ, t0)[0]) == 0.0


def test_layouts_that_differ_in_cp_pay_a_reshard():
    model, cluster, workload = setup()
    ctx = StepContext(cluster=cluster, workload=workload, stage_size=16, micro_batch_seqs=2)
    a, b = LayerStrategy(dp=2, tp=8, sp="megatron"), LayerStrategy(dp=2, tp=2, cp=4, sp="megatron")
    assert shape_key(b) == (2, 2, 1, True, 4)
    assert transition_time(4096, shape_key(a), shape_key(b), ctx) > 0
    assert transition_time(4096, shape_key(b), shape_key(b), ctx) == 0
    assert transition_time(4096, (2, 8, 1, True), shape_key(a), ctx) == 0  # a 4-element key means cp 1


def test_hand_plan_with_cp_and_its_refusals():
    model, cluster, workload = setup(gpus=16)
    plan = manual_plan(model, cluster, workload, tp=2, cp=8, sp="megatron", zero=1)
    assert {s.cp for s in plan.layers} == {8} and plan.layers[1].describe() == "dp1 tp2+sp cp8 zero1"
    with pytest.raises(ValueError, match="2 x cp = 16 equal chunks"):
        manual_plan(model, cluster, Workload(global_batch=2, seq_len=65528), tp=2, cp=8)
    with pytest.raises(ValueError, match="shorter than a flash-attention tile"):
        manual_plan(model, cluster, Workload(global_batch=2, seq_len=1024), tp=2, cp=8)
    with pytest.raises(ValueError, match="ep needs cp=1"):
        LayerStrategy(dp=2, cp=2, ep=2)


@pytest.fixture(scope="module")
def llama3_405b_128k():
    cfg = get_model_config("llama3-405b").model_copy(update={"max_seq_len": 131072})
    return (ModelSpec.from_config(cfg), make_cluster("h100-80gb", 16384),
            Workload(global_batch=128, seq_len=131072))


def test_search_uses_context_parallelism_for_405b_at_128k(llama3_405b_128k):
    model, cluster, workload = llama3_405b_128k
    plan = search(model, cluster, workload)
    blocks = [s for s, layer in zip(plan.layers, model.layers) if layer.num_heads]
    assert all(s.cp > 1 for s in blocks)
    p = plan.prediction
    assert p.bubble_s < 0.1 * p.step_time_s and p.mfu > 0.25 and p.fits
    assert not any(line.startswith("warning:") for line in plan.search.explanation)
    # Without context parallelism the best plan is a deep pipeline of few micro-batches: most of
    # its step is bubble, and the planner says so.
    flat = search(model, cluster, workload, SearchOptions(allow_cp=False))
    assert flat.prediction.step_time_s > 5 * p.step_time_s
    assert flat.prediction.bubble_s > 0.5 * flat.prediction.step_time_s
    warning = [line for line in flat.search.explanation if line.startswith("warning:")]
    assert warning == [bubble_warning(flat)] and "pipeline bubble is" in warning[0]


def test_bubble_warning_threshold():
    model = ModelSpec.from_config(CFG.model_copy(update={"num_layers": 14, "max_seq_len": 8192}))
    cluster = make_cluster("h100-80gb", 64)
    # 8 stages of 2 layers and 2 micro-batches: 7 of 9 slots idle on each rank.
    deep = manual_plan(model, cluster, Workload(global_batch=2, seq_len=8192), tp=8, pp=8, sp="megatron")
    assert deep.prediction.bubble_s > 0.5 * deep.prediction.step_time_s
    assert bubble_warning(deep).startswith("warning: the pipeline bubble is")
    assert "8 stages, 2 micro-batches" in bubble_warning(deep)
    flat = manual_plan(model, cluster, Workload(global_batch=2, seq_len=8192), tp=8, cp=4, dp=2, sp="megatron")
    assert flat.prediction.bubble_s == 0 and bubble_warning(flat) is None


def test_ring_collectives_by_hand():
    # tiny-llama with room for 1,024 tokens, 8 ranks: dp2 cp4, ZeRO-3 sharded over cp only
    # (HSDP: dp_shard 1, two replicas), full recompute, 8 micro-batches of one sequence.
    from tessera.cost.collectives import step_collectives

    cfg = get_model_config("tiny-llama").model_copy(update={"max_seq_len": 1024})
    plan = manual_plan(ModelSpec.from_config(cfg), make_cluster("h100-80gb", 8),
                       Workload(global_batch=16, seq_len=1024), cp=4, zero=3, dp_shard=1, recompute="full")
    m, cp, blocks = 8, 4, 4
    got = {}
    for c in step_collectives(plan, 5):
        key = (c.kind, c.group_size, c.bytes)
        got[key] = got.get(key, 0) + c.count
    kv = 2 * 256 * 4 * 32 * 2  # K and V: 256 local tokens, 4 K/V heads of 32, bf16
    for kind in ("send", "recv"):
        assert got[(kind, 2, kv)] == blocks * m * (cp - 1) * 3  # forward, replay, backward
        assert got[(kind, 2, kv * 2)] == blocks * m * cp  # fp32 dK/dV, backward
    params = 2 * 725_504
    assert got[("all_gather", 4, params)] == blocks * m * 2  # ZeRO-3 over the cp group
    assert got[("all_reduce", 2, 2 * params / 4)] == blocks  # HSDP: the fp32 shard's replica all-reduce
    assert got[("all_reduce", 4, 4)] == 1  # gradient norm over the shard group
    assert got[("all_reduce", 8, 4)] == 1  # the step's loss
