"""Collectives (cost/comm.py): group layout, NCCL's ring and tree terms, against hand-computed numbers."""
import math

import numpy as np
import pytest

from tessera.cost.comm import collective_time, collective_times, group_layout, tree_correction
from tessera.cost.layer import StepContext, StrategyTable, layer_costs
from tessera.plan import LayerStrategy
from tessera.spec import Workload
from tessera.spec.presets import get_model, make_cluster

A100 = make_cluster("a100-80gb", 8192)
US = 1e-6


def test_groups_that_do_not_divide_a_node_span_nodes():
    assert group_layout(6, 1, 8) == (True, 2, 2)  # ranks 6-11: 2 on one node, 4 on the next
    assert group_layout(4, 2, 8) == (False, 4, 1)
    assert group_layout(8, 8, 8) == (True, 1, 8)  # one member per node
    assert group_layout(32, 1, 8) == (True, 8, 4)
    assert group_layout(3, 1, 8)[0] is True  # ranks 6, 7, 8
    c = make_cluster("h100-80gb", 48)
    n = 256e6
    # tp 6 is costed over the network (bus: the 2 NICs of the node holding 2 members), not NVLink.
    latency = 8.4 * US + 8 * 3.4 * US + 2 * 9.6 * US  # 10 ring steps, 2 between the two nodes
    assert collective_time(c, "all_reduce", n, 6, 1) == pytest.approx(1.9 * latency + 2 * 5 / 6 * n / (2 * 0.9 * 50e9))
    assert collective_time(c, "all_reduce", n, 4, 1) == pytest.approx(8.4 * US + 6 * 3.4 * US + 2 * 3 / 4 * n / 360e9)


def test_ring_all_reduce_over_four_full_nodes():
    n, p = 1e9, 32
    bus = min(235e9, 8 * 0.9 * 25e9)  # 8 members per node: one NIC each
    latency = 8.4 * US + (62 - 6) * 3.4 * US + 6 * 9.6 * US  # 62 steps, 6 of them between nodes
    ring = 1.9 * latency + 2 * 31 / 32 * n / bus  # NCCL's plateau factor for large multi-node messages
    tree = 2 * (7 * 28 * US + 2 * 50 * US) + n / (0.5 * min(0.9 * bus, 80e9))
    assert ring < tree
    assert collective_time(A100, "all_reduce", n, p, 1) == pytest.approx(ring)


def test_trees_take_over_across_a_thousand_nodes():
    n, p = 64 * 2**20, 1024
    latency = 8.4 * US + 2 * 1023 * 9.6 * US  # one member per node: every step crosses the network
    ring = 1.9 * latency + 2 * 1023 / 1024 * n / (0.9 * 25e9)
    correction = 0.8  # NCCL treeCorrectionFactor[Simple] at 64 MiB = 64 B x 2^20
    tree = 2 * (0 * 28 * US + 10 * 50 * US) + n / (0.5 * 0.9 * (0.9 * 25e9) * correction)
    assert tree < ring
    assert collective_time(A100, "all_reduce", n, p, 8) == pytest.approx(tree)
    assert float(tree_correction(np.array([n]))[0]) == 0.8


def test_rings_lose_bandwidth_with_node_count():
    # A ZeRO-3 gather of a fixed message: the ring's per-step latency grows with the group while
    # each step carries n / p bytes, so the achieved bandwidth falls.
    n = 220e6
    for p in (8, 96, 1024):
        t = collective_time(A100, "all_gather", n, p, 8)
        assert t == pytest.approx(8.4 * US + (p - 1) * 9.6 * US + (p - 1) / p * n / (0.9 * 25e9))
    busbw = [(p - 1) / p * n / collective_time(A100, "all_gather", n, p, 8) for p in (8, 96, 1024)]
    assert busbw[0] > busbw[1] > busbw[2]
    assert busbw[2] < 0.7 * 0.9 * 25e9


def test_vector_and_scalar_agree():
    sizes = np.array([2, 6, 8, 32, 1024, 8])
    strides = np.array([1, 1, 8, 1, 8, 1])
    nbytes = np.array([1e6, 5e7, 3e8, 1e9, 6e7, 2e5])
    for coll in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        vec = collective_times(A100, coll, nbytes, sizes, strides)
        for i in range(len(sizes)):
            assert vec[i] == pytest.approx(collective_time(A100, coll, nbytes[i], int(sizes[i]), int(strides[i])))


def test_full_recompute_replays_the_tensor_parallel_collectives():
    c = make_cluster("h100-80gb", 8)
    ctx = StepContext(cluster=c, workload=Workload(global_batch=8, seq_len=4096), stage_size=8, micro_batch_seqs=1)
    block = get_model("llama2-7b").layers[1]
    t = StrategyTable.build([LayerStrategy(tp=8, sp="megatron"), LayerStrategy(tp=8, sp="megatron", recompute="full")])
    costs = layer_costs(block, t, ctx)
    msg = 4096 * 4096 * 2
    pair = collective_time(c, "all_gather", msg, 8) + collective_time(c, "reduce_scatter", msg, 8)
    comm_b = costs.bwd - costs.compute_bwd
    assert comm_b[0] == pytest.approx(2 * pair)
    ag = collective_time(c, "all_gather", msg, 8)
    assert comm_b[1] == pytest.approx(2 * pair + pair + ag)  # the forward's replayed but its last reduce-scatter


def test_ulysses_beyond_the_kv_heads_repeats_them():
    c = make_cluster("h100-80gb", 16)
    ctx = StepContext(cluster=c, workload=Workload(global_batch=1, seq_len=32768), stage_size=16, micro_batch_seqs=1)
    block = get_model("llama3-8b").layers[1]  # 32 heads, 8 KV heads
    t = StrategyTable.build([LayerStrategy(dp=1, sp="ulysses", sp_degree=8),
                             LayerStrategy(dp=1, sp="ulysses", sp_degree=16)])
    costs = layer_costs(block, t, ctx)
    for i, u in enumerate((8, 16)):
        q_msg = 32768 / u * 4096 * 2
        kv = 8 * (2 if u == 16 else 1) / 32  # 16 ranks: each KV head repeated twice
        a2a = (2 * collective_time(c, "all_to_all", q_msg, u, 1)
               + 2 * collective_time(c, "all_to_all", q_msg * kv, u, 1))
        assert float(costs.fwd[i] - costs.compute_fwd[i]) == pytest.approx(a2a)
    # The repeated K and V are what attention saves: 2 x 2 bytes x kv_dim more per token; and
    # the output projection saves the all-to-all's copy of the attention output (2 x 4096).
    plain = 32768 / 16 * (block.act_bytes_tp + block.act_bytes_replicated + block.act_fp32_tp
                          + block.act_fp32_replicated)
    assert float(costs.act[1]) == pytest.approx(plain + 32768 / 16 * (4 * 8 * 128 + 2 * 4096))


def test_gradient_sync_follows_the_runtime_contract():
    """Per micro-batch vs once per step, with no overlap (slowdown 2: overlapped(c, x) = c + x)."""
    c = make_cluster("h100-80gb", 16).model_copy(update={"overlap_slowdown": 2.0})
    ctx = StepContext(cluster=c, workload=Workload(global_batch=16, seq_len=1024), stage_size=16, micro_batch_seqs=16)
    layer = get_model("llama2-7b").layers[1]
    t = StrategyTable.build([LayerStrategy(dp=16, zero=z) for z in range(4)]
                            + [LayerStrategy(dp=16, zero=3, dp_shard=8)])
    k = layer_costs(layer, t, ctx)
    n, g = 2 * layer.params, 4 * layer.params  # bf16 parameters gathered, fp32 gradients reduced
    ag = lambda s: collective_time(c, "all_gather", n, s)  # noqa: E731
    rs = lambda s: collective_time(c, "reduce_scatter", g, s)  # noqa: E731
    fwd, bwd, once = k.fwd - k.compute_fwd, k.bwd - k.compute_bwd, k.step - k.optimizer_time
    # ZeRO-0: one all-reduce per step. ZeRO-1: one reduce-scatter + one all-gather per step.
    assert (fwd[0], bwd[0], once[0]) == pytest.approx((0, 0, collective_time(c, "all_reduce", g, 16)))
    assert (fwd[1], bwd[1], once[1]) == pytest.approx((0, 0, ag(16) + rs(16)))
    # ZeRO-2: reduce-scatter every micro-batch, parameters gathered once per step.
    assert (fwd[2], bwd[2], once[2]) == pytest.approx((0, rs(16), ag(16)))
    # ZeRO-3: gather forward, gather + reduce-scatter backward, every micro-batch.
    assert (fwd[3], bwd[3], once[3]) == pytest.approx((ag(16), ag(16) + rs(16), 0))
    # HSDP: the shard group of 8, then the replica all-reduce of the 1/8 shard once per step.
    rep = collective_time(c, "all_reduce", g / 8, 2, 8)
    assert (fwd[4], bwd[4], once[4]) == pytest.approx((ag(8), ag(8) + rs(8), rep))
