"""The dry run: a plan's ranks at its real world size on the fake process group.

Checked against hand computation (FSDP2's shard sizes, its collectives per micro-batch), against
itself (fake tensors give exactly what real ones give), against the cost model, and at 16,384
ranks. Every dry run forks a process per rank.
"""
from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

from tessera.cost.collectives import step_collectives
from tessera.errors import TesseraError
from tessera.search import manual_plan
from tessera.spec import Workload
from tessera.spec.presets import get_model, make_cluster

torch = pytest.importorskip("torch")

from tessera.runtime.comm_count import CollectiveRecord  # noqa: E402
from tessera.runtime.dryrun.run import dry_run, parse_ranks  # noqa: E402


def tiny(world=8, batch=16, seq=64, dtype="bf16", **kw):
    return manual_plan(get_model("tiny-llama"), make_cluster("h100-80gb", world),
                       Workload(global_batch=batch, seq_len=seq, dtype=dtype), **kw)


def test_zero3_rank_matches_hand_computation():
    # tiny-llama (hidden 256, 4 blocks of 725,504 parameters, vocabulary 50,257), dp8 ZeRO-3,
    # 2 micro-batches. FSDP2 pads each parameter's rows to a multiple of 8: the embedding and
    # the head to 50,264 rows, i.e. 6,283 rows of 256 on every rank; rank 0's shard of a block
    # is 725,504 / 8 = 90,688 elements. Local elements: 4 * 90,688 + 2 * 6,283 * 256 + 32.
    local = 4 * 90_688 + 2 * 6_283 * 256 + 32
    plan = tiny(zero=3)
    m = dry_run(plan, [0]).ranks[0].measurement
    assert m.mode == "materialized" and m.counted_step == 1
    assert m.device.params == 0  # no bf16 copy outlives a ZeRO-3 unit's use
    assert m.device.grads == 4 * local  # sharded, fp32 (reduce dtype)
    assert m.device.optimizer == 4 * local + 8 * local + 4 * 39  # fp32 master + AdamW m, v + 39 step counts
    # One unit per plan layer: the root holds the embedding, the head unit the final norm and output.
    blocks, emb, head = 725_504, 50_264 * 256, 50_264 * 256 + 256
    assert Counter(m.collectives) == {
        CollectiveRecord("all_gather", 8, 2 * blocks): 4 * 2 * 2,  # bf16, forward + backward, per micro-batch
        CollectiveRecord("reduce_scatter", 8, 4 * blocks): 4 * 2,  # fp32, per micro-batch
        CollectiveRecord("all_gather", 8, 2 * emb): 2 * 2,
        CollectiveRecord("reduce_scatter", 8, 4 * emb): 2,
        CollectiveRecord("all_gather", 8, 2 * head): 2 * 2,
        CollectiveRecord("reduce_scatter", 8, 4 * head): 2,
        CollectiveRecord("all_reduce", 8, 4): 2,  # the loss, and the gradient norm (one sharding group)
    }


def test_zero3_against_the_cost_model():
    plan = tiny(zero=3)
    c = dry_run(plan, [7]).ranks[0].comparison
    assert abs(c.state_error) < 0.01  # 16 bytes per parameter on both sides, split differently
    rows = {(r.kind, r.group_size, r.bytes): r for r in c.collectives}
    assert rows[("all_gather", 8, 2 * 725_504)].predicted == rows[("all_gather", 8, 2 * 725_504)].measured == 16
    assert rows[("all_reduce", 8, 4)].matches
    # Gradients reduced in fp32 on both sides (`Workload.grad_dtype`).
    assert rows[("reduce_scatter", 8, 4 * 725_504)].predicted == rows[("reduce_scatter", 8, 4 * 725_504)].measured == 8
    assert all(r.matches for r in c.collectives)


def test_fake_tensors_measure_what_real_ones_do():
    plans = [tiny(tp=2, sp="megatron", zero=2),
             tiny(pp=2, zero=3, dtype="fp32"),
             tiny(sp="ulysses", sp_degree=2, zero=1)]  # the DDP path (+ ZeroRedundancyOptimizer)
    for plan in plans:
        real = dry_run(plan, [7], materialize=True).ranks[0].measurement
        fake = dry_run(plan, [7], materialize=False).ranks[0].measurement
        assert (real.mode, fake.mode) == ("materialized", "fake")
        assert Counter(real.collectives) == Counter(fake.collectives), plan.layers[1].describe()
        assert (real.device, real.host) == (fake.device, fake.host)


def test_tensor_parallel_and_pipeline_collectives():
    plan = tiny(tp=2, sp="megatron", zero=2)
    rows = dry_run(plan, [0], materialize=False).ranks[0].comparison.collectives
    tp = {(r.kind, r.bytes): r for r in rows if r.group_size == 2}
    act = 64 * 256 * 2  # tokens x hidden x bf16 per micro-batch
    # Per micro-batch and block, 2 all-gather / reduce-scatter pairs forward and 2 backward
    # (Megatron); the head one all-gather forward, its reduce-scatter backward; the
    # vocabulary-parallel embedding one reduce-scatter forward, its all-gather backward.
    assert tp[("all_gather", act)].measured == tp[("all_gather", act)].predicted == 4 * (4 * 4 + 2)
    assert tp[("reduce_scatter", act)].measured == tp[("reduce_scatter", act)].predicted == 4 * (4 * 4 + 2)
    pp = tiny(pp=2, zero=1, batch=32)
    rows = dry_run(pp, [7], materialize=False).ranks[0].comparison.collectives
    p2p = {r.kind: r for r in rows if r.kind in ("send", "recv")}
    assert p2p["send"].measured == p2p["send"].predicted == pp.num_micro_batches  # gradients back
    assert p2p["recv"].measured == p2p["recv"].predicted


def test_interleaved_pipeline_gathers_zero1_units_once_per_step():
    # tiny-llama with 6 blocks (8 plan layers) on pp2 x dp4, interleaved over 4 chunks of one layer
    # per rank, 8 micro-batches. torch's multi-chunk schedule keeps at most 3 chunks gathered and
    # reshards the one it evicts: ZeRO-1 chunks were gathered again on every re-entry (each block
    # 3 times a step, the embedding 6 times), where the plan gathers them once.
    from tessera.spec.model import ModelSpec
    from tessera.spec.presets.models import get_model_config

    model = ModelSpec.from_config(get_model_config("tiny-llama").model_copy(update={"num_layers": 6}))
    plan = manual_plan(model, make_cluster("h100-80gb", 8), Workload(global_batch=32, seq_len=64),
                       pp=2, zero=1, schedule="interleaved_1f1b", virtual_stages=4)
    assert len(plan.pipeline.stages) == 8 and plan.num_micro_batches == 8
    (r,) = dry_run(plan, [0], materialize=False).ranks  # chunks 0, 2, 4, 6: the embedding, 3 blocks
    gathers = [row for row in r.comparison.collectives if row.kind == "all_gather"]
    assert {(row.bytes, row.predicted, row.measured) for row in gathers} == {
        (2 * 725_504, 3, 3),  # each block's unit once per step (bf16)
        (2 * 50_260 * 256, 1, 1)}  # the embedding (the chunk's root; rows padded to 4 ranks, as FSDP2 pads)
    assert all(row.matches for row in r.comparison.collectives)
    assert abs(r.comparison.state_error) < 0.02


def test_big_plans_without_materialising():
    # llama2-7b on 64 ranks, ZeRO-3: 16 bytes per parameter on every rank, one micro-batch.
    plan = manual_plan(get_model("llama2-7b"), make_cluster("h100-80gb", 64), Workload(global_batch=64, seq_len=512),
                       zero=3)
    r = dry_run(plan, [63]).ranks[0]
    assert r.measurement.mode == "fake" and r.measurement.peak_rss_bytes < 2 * 2**30
    assert abs(r.comparison.state_error) < 0.01
    block = plan.model.layers[1].params
    assert Counter(r.measurement.collectives)[CollectiveRecord("all_gather", 64, 2 * block)] == 2 * 32


def test_llama3_405b_at_16384_ranks_builds_in_little_memory():
    # pp16 tp8 dp128 ZeRO-1: the last stage holds blocks 120-126 and the head. FSDP2 shards
    # each TP shard 128 ways: a block's 3,187,703,808 parameters (norms 2 x 16,384 not split
    # by TP) give 3,113,216 elements per rank; the head's 16,032 local vocabulary rows pad to
    # 126 x 128; its norm 128. Built only: the fp32 sharded weights are the master copies.
    plan = manual_plan(get_model("llama3-405b"), make_cluster("h100-80gb", 16384),
                       Workload(global_batch=2048, seq_len=8192), tp=8, sp="megatron", pp=16, zero=1)
    m = dry_run(plan, [16383], step=False).ranks[0].measurement
    assert m.device.optimizer == 4 * (7 * 3_113_216 + 126 * 16_384 + 128)
    assert m.peak_rss_bytes < 2 * 2**30


def test_predicted_collectives_by_hand():
    plan = tiny(tp=2, sp="megatron", zero=3, batch=8)  # dp4, 2 micro-batches of 4 sequences
    got = [c for c in step_collectives(plan, 0)
           if c.layer == plan.model.layers[1].name and not c.why.startswith("bookkeeping")]
    act, params = 64 * 256 * 2, 725_504 / 2
    assert {(c.kind, c.group_size, c.bytes, c.count) for c in got} == {
        ("all_gather", 2, act, 8), ("reduce_scatter", 2, act, 8),  # 2 + 2 per micro-batch, each a pair
        ("all_gather", 4, 2 * params, 4), ("reduce_scatter", 4, 4 * params, 2)}  # ZeRO-3: bf16 gathers, fp32 reduces
    norms = [c for c in step_collectives(plan, 0) if c.why == "bookkeeping: sequence-parallel norm gradients"]
    assert sum(c.count for c in norms) == 2 * (4 * 2 + 1)  # per micro-batch: 2 norms per block, the final one
    step = [c for c in step_collectives(plan, 0) if c.layer == "step"]
    assert {(c.kind, c.group_size, c.count) for c in step} == {
        ("all_reduce", 8, 1),  # loss
        ("all_reduce", 4, 1), ("all_reduce", 2, 1)}  # gradient norm: the shard group, then (shard, tp)


def test_errors_are_one_sentence():
    plan = tiny(tp=2)
    assert parse_ranks("first,last,3", plan) == [0, 3, 7]
    with pytest.raises(TesseraError, match="rank 9 is outside the plan's world of 8 ranks"):
        parse_ranks("9", plan)
    with pytest.raises(TesseraError, match="'x' is not a rank number"):
        parse_ranks("x", plan)
    no_config = plan.model_copy(update={"model": plan.model.model_copy(update={"config": None})})
    with pytest.raises(TesseraError, match="plan.model.config is missing"):
        dry_run(no_config)  # refused before any process starts


def test_a_plan_that_does_not_fit_names_rank_and_memory():
    plan = tiny(zero=0)
    small = plan.cluster.model_copy(update={"device": plan.cluster.device.model_copy(update={"memory_bytes": 2**20})})
    result = dry_run(plan.model_copy(update={"cluster": small}), [0])
    (line,) = result.not_fitting()
    assert line.startswith("rank 0 (pipeline stage 0) needs ") and line.endswith("the device has 0.0 GiB")


def test_cli(tmp_path):
    path = tmp_path / "plan.json"
    tiny(tp=2, sp="megatron", zero=2).save(path)
    run = lambda *a: subprocess.run([sys.executable, "-m", "tessera", "dryrun", "--plan", str(path), *a],  # noqa: E731
                                    capture_output=True, text=True)
    ok = run("--ranks", "last", "--fake")
    assert ok.returncode == 0, ok.stderr
    assert "rank 7 (pipeline stage 0) of 8: fake tensors" in ok.stdout and "model states per device" in ok.stdout
    bad = run("--ranks", "8")
    assert bad.returncode == 2
    assert bad.stderr.strip() == "tessera dryrun: error: --ranks: rank 8 is outside the plan's world of 8 ranks"


def test_expert_parallel_collectives_match_the_cost_model():
    """A MoE plan on fake tensors (uniform routing): every all-to-all and every MoE collective the
    runtime issues is one the cost model lists (cost/moe.py `ep_collectives`), with its bytes and
    count: tokens x top_k x hidden x 2 bytes per dispatch, combine and their gradients."""
    model = get_model("tiny-qwen-moe")
    plan = manual_plan(model, make_cluster("h100-80gb", 8), Workload(global_batch=16, seq_len=64), ep=4, tp=2,
                       sp="megatron", zero=1, recompute="full", micro_batch_size=2)  # dp4 ep4 tp2 + SP, 2 micro-batches
    (r,) = dry_run(plan, [5], materialize=False).ranks
    moe = [row for row in r.comparison.collectives
           if row.kind == "all_to_all" or row.why.startswith(("expert parallel", "experts:"))]
    assert moe and all(row.matches for row in moe), [row for row in moe if not row.matches]
    layer = model.layers[1]
    tokens = 16 // 4 // plan.num_micro_batches * 64  # a rank's tokens per micro-batch (gathered under SP)
    dispatch = tokens * layer.top_k * layer.hidden * 2
    # 4 MoE layers x 2 micro-batches x (dispatch, combine, 2 gradients, 2 replayed by recompute)
    assert {(row.bytes, row.measured) for row in moe if row.kind == "all_to_all" and row.bytes > 1000} == \
        {(dispatch, 4 * plan.num_micro_batches * 6)}


def test_context_parallel_ring_against_the_cost_model():
    # tiny-llama (8 heads, 4 K/V heads of 32) on 32 ranks: dp2 tp2 cp2 Ulysses 4, ZeRO-3 over
    # dp x cp, selective recompute, 2 micro-batches of one 512-token sequence. A tensor-parallel
    # rank holds 2 K/V heads; Ulysses 4 repeats them twice, so the ring carries 1 K/V head of
    # 256 tokens: K and V 2 x 256 x 32 x 2 bytes, their fp32 gradients twice that.
    plan = manual_plan(get_model("tiny-llama"), make_cluster("h100-80gb", 32), Workload(global_batch=4, seq_len=512),
                       tp=2, sp="ulysses", sp_degree=4, cp=2, zero=3, recompute="selective")
    assert plan.num_micro_batches == 2
    rows = dry_run(plan, [31], materialize=False).ranks[0].comparison.collectives
    got = {(r.kind, r.group_size, r.bytes): (r.predicted, r.measured) for r in rows}
    kv, m, blocks = 2 * 256 * 32 * 2, 2, 4
    for kind in ("send", "recv"):
        # Per block and micro-batch: cp - 1 K/V blocks forward, again in the selective replay,
        # and backward; cp fp32 dK/dV accumulators backward.
        assert got[(kind, 2, kv)] == (blocks * m * 3, blocks * m * 3)
        assert got[(kind, 2, 2 * kv)] == (blocks * m * 2, blocks * m * 2)
    # Ulysses: q, k, v, output each way and in the replay; k and v repeated to q's size.
    tokens = 512 // (2 * 4)
    assert got[("all_to_all", 4, tokens * 256 * 2 / 2)] == (blocks * m * 12, blocks * m * 12)
    # ZeRO-3 shards a block's tp half over dp x cp = 4 ranks: gathered forward and backward.
    assert got[("all_gather", 4, 725_504 / 2 * 2)] == (blocks * m * 2, blocks * m * 2)
    assert not [r for r in rows if r.why.startswith(("ring", "Ulysses")) and not r.matches]


def test_gpipe_measures_the_gradients_accumulated_over_the_step():
    """Under GPipe every backward follows every forward: the ZeRO-1 gradients a stage accumulates
    unsharded peak between backwards, where the probe samples too (it once saw a quarter of them)."""
    plan = tiny(pp=2, zero=1, dtype="fp32", schedule="gpipe", batch=32)
    rows = {row.name: row for row in dry_run(plan, [0], materialize=False).ranks[0].comparison.state}
    for name in ("params", "grads", "optimizer"):
        assert rows[name].measured == pytest.approx(rows[name].predicted, rel=0.02), name


def test_tied_head_in_another_layout_exchanges_shards_as_predicted():
    """tiny-gpt2 ties its LM head to the embedding. Sharded two ways (the embedding tp2 x ZeRO-3
    over 4, the head tp4 + SP x ZeRO-1 over 2; a hand-made plan, the search gives the pair one
    layout) the head holds its own copy, priced as one, and the tied gradient is summed shard to
    shard: one all-to-all over the 8 ranks of what each rank's two shards owe the other copy
    (rank 0: rows 0-6,282 of each, 2 x 6,283 rows x 256 x 4 bytes), and no collective carries
    the whole table (50,257 x 256 x 4 bytes), as gathering whole gradients did."""
    from tessera.cost.evaluate import evaluate
    from tessera.cost.tied import sent_rows, tied_copies
    from tessera.plan import LayerStrategy, SPKind

    base = manual_plan(get_model("tiny-gpt2"), make_cluster("h100-80gb", 8), Workload(global_batch=16, seq_len=64))
    layers = ((LayerStrategy(dp=4, tp=2, zero=3),) + (LayerStrategy(dp=8, zero=2),) * (len(base.layers) - 2)
              + (LayerStrategy(dp=2, tp=4, sp=SPKind.MEGATRON, zero=1),))
    plan = base.model_copy(update={"layers": layers})
    plan = plan.model_copy(update={"prediction": evaluate(plan)})
    result = dry_run(plan, [0, 7], materialize=False)
    # Each rank's own pieces of the tables (rank 7's are the short last ones: `rank_states`).
    assert result.count_mismatches == 0 and result.max_state_error < 1e-4
    assert sent_rows(tied_copies(plan), 50_257, 0) == 2 * 6_283
    for r in result.ranks:
        m = r.measurement
        (row,) = [row for row in r.comparison.collectives if row.why.startswith("bookkeeping: tied embedding")]
        assert (row.kind, row.group_size, row.predicted, row.measured) == ("all_to_all", 8, 1, 1)
        assert row.bytes == sent_rows(tied_copies(plan), 50_257, m.rank) * 256 * 4
        assert max(c.bytes for c in m.collectives) < 50_257 * 256 * 4
    # Across a pipeline (the copies on stages 0 and 2 of 3, the embedding tp2, the head ZeRO-3
    # over dp2): the exchange runs over both stages' 4 ranks, as priced.
    pipe = manual_plan(get_model("tiny-gpt2"), make_cluster("h100-80gb", 6), Workload(global_batch=16, seq_len=64),
                       pp=3, zero=1)
    layers = ((LayerStrategy(tp=2, sp=SPKind.MEGATRON),) + (LayerStrategy(dp=2, zero=1),) * (len(pipe.layers) - 2)
              + (LayerStrategy(dp=2, zero=3),))
    pipe = pipe.model_copy(update={"layers": layers})
    pipe = pipe.model_copy(update={"prediction": evaluate(pipe)})
    result = dry_run(pipe, [0, 5], materialize=False)
    assert result.count_mismatches == 0 and result.max_state_error < 1e-4
    for r in result.ranks:
        (row,) = [row for row in r.comparison.collectives if row.why.startswith("bookkeeping: tied embedding")]
        assert (row.kind, row.group_size, row.measured) == ("all_to_all", 4, 1)
    # The search's plans share one weight: no copy, no exchange.
    shared = manual_plan(get_model("tiny-gpt2"), make_cluster("h100-80gb", 8), Workload(global_batch=16, seq_len=64),
                         tp=2, zero=3)
    assert tied_copies(shared) is None
    assert not [c for c in step_collectives(shared, 0) if c.kind == "all_to_all"]
