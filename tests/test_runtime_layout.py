"""Rank arithmetic, activation layouts and the runtime's refusals: pure, no processes."""
import itertools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "dist"))

from runtime_common import LLAMA, MOE, S, make_plan  # noqa: E402
from tessera.cli import main  # noqa: E402
from tessera.errors import TesseraError  # noqa: E402
from tessera.plan import LayerStrategy, SPKind  # noqa: E402
from tessera.runtime.layout import ActLayout  # noqa: E402
from tessera.runtime.mesh import LayerLayout, ParallelDims, axis_groups, layer_coords  # noqa: E402
from tessera.runtime.parallelize import check_plan_supported, uses_ddp  # noqa: E402


def test_axis_groups_match_megatron_layout():
    shape = {"pp": 2, "dp": 2, "sp": 1, "tp": 2}
    assert axis_groups(shape, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axis_groups(shape, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_groups(shape, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert axis_groups(shape, ("dp", "tp")) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="unknown mesh axis 'ep'"):
        axis_groups(shape, "ep")


@pytest.mark.parametrize("dp,sp,tp", [(4, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 1), (1, 1, 4)])
def test_layer_coords_invert_the_layout(dp, sp, tp):
    stage = dp * sp * tp
    seen = set()
    for rank in range(2 * stage):  # two pipeline stages
        c = layer_coords(rank, stage, dp, sp, tp)
        assert rank == c.pp * stage + (c.dp * sp + c.sp) * tp + c.tp
        seen.add((c.pp, c.dp, c.sp, c.tp))
        # the tp group of `rank` is the axis group that contains it
        groups = axis_groups({"pp": 2, "dp": dp, "sp": sp, "tp": tp}, "tp")
        assert any(rank in g and len(g) == tp for g in groups)
    assert len(seen) == 2 * stage


def test_parallel_dims_validate_and_pick_the_common_layout():
    plan = make_plan(LLAMA, 4, [S(dp=2, tp=2)] + [S(dp=4)] * 4 + [S(dp=2, tp=2)])
    dims = ParallelDims.from_plan(plan, 4)
    assert dims.reference == LayerLayout(dp=4, sp=1, tp=1, shard=1)
    assert (dims.pp, dims.stage_size) == (1, 4)
    with pytest.raises(TesseraError, match="world size 8"):
        ParallelDims(pp=1, stage_size=4, world_size=8, reference=LayerLayout(4, 1, 1, 1))
    with pytest.raises(ValueError, match="made for 4 ranks, but 2 are running"):
        ParallelDims.from_plan(plan, 2)
    assert LayerLayout.of(S(dp=4, zero=3, dp_shard=2)).replicate == 2
    assert LayerLayout.of(S(dp=2, sp="ulysses", sp_degree=2, zero=0)).replicate == 4


def test_act_layout_blocks_tile_the_activation():
    """Distinct blocks of a layout cover the (batch, seq) grid exactly; replicas repeat one."""
    for lay in [ActLayout(4, 1, 1), ActLayout(2, 1, 2), ActLayout(2, 1, 2, True), ActLayout(1, 2, 2, True),
                ActLayout(2, 2, 1)]:
        blocks = {lay.block(r, 8, 16) for r in range(lay.stage_size)}
        assert len(blocks) == lay.dp * lay.seq_parts
        cells = {(b, s) for b0, b1, s0, s1 in blocks for b in range(b0, b1) for s in range(s0, s1)}
        assert len(cells) == 8 * 16
    # a (dp=4) layer's block on rank r is the (r % 2)-th half of rank r's (dp=2, tp=2) block
    assert ActLayout(4, 1, 1).refines(ActLayout(2, 1, 2), 8, 16)
    assert not ActLayout(2, 1, 2).refines(ActLayout(4, 1, 1), 8, 16)
    assert ActLayout(2, 1, 2, True).refines(ActLayout(2, 1, 2), 8, 16)
    assert ActLayout(2, 1, 2).block(3, 8, 16) == (4, 8, 0, 16)
    assert ActLayout(2, 1, 2, True).block(3, 8, 16) == (4, 8, 8, 16)


def _layouts(stage: int, cps=(1, 2)):
    out = []
    for cp in cps:
        for dp in range(1, stage // cp + 1):
            for sp in range(1, stage // (dp * cp) + 1):
                tp = stage // (dp * sp * cp)
                if dp * sp * tp * cp == stage:
                    out += [ActLayout(dp, sp, tp, cp=cp)] + ([ActLayout(dp, sp, tp, True, cp)] if tp > 1 else [])
    return out


def _cells(rects):
    return {(i, j) for b0, b1, s0, s1 in rects for i in range(b0, b1) for j in range(s0, s1)}


@pytest.mark.parametrize("stage", [4, 6, 8])
def test_resharding_exchanges_rebuild_every_block_moving_only_what_changes_hands(stage):
    """Every pair of layouts of a stage (context parallel ones too, whose blocks are two ranges),
    simulated over all ranks: each rank's target block is rebuilt exactly from what it holds and
    what its peers send; nothing is sent twice to a rank, no rank sends what the receiver holds,
    and the volumes the cost model prices are the sent ones."""
    from tessera.cost import reshard as rs

    batch, seq = 24, 48  # divisible by every degree of the stages (and 2 cp chunks)
    for a, b in itertools.product(_layouts(stage), repeat=2):
        sent_total = 0
        for r in range(stage):
            ex = rs.exchange(a.key, b.key, r, batch, seq)
            want = _cells(rs.block(b.key, r, batch, seq))
            mine = _cells(rs.block(a.key, r, batch, seq))
            got = _cells(ex.local)
            assert got <= mine
            for peer, rect in ex.recvs:
                sender = rs.exchange(a.key, b.key, ex.first + peer, batch, seq)
                assert (r - ex.first, rect) in sender.sends  # the peer sends it
                assert _cells([rect]) <= _cells(rs.block(a.key, ex.first + peer, batch, seq))
                assert not _cells([rect]) & mine  # nothing the rank holds itself crosses the network
                assert not _cells([rect]) & got  # received once
                got |= _cells([rect])
            assert got == want
            sent_total += sum((x[1] - x[0]) * (x[3] - x[2]) for _, x in ex.sends)
            if b.refines(a, batch, seq):
                assert not ex.sends and not ex.recvs
        sent, received = rs.exchange_volume(a.key, b.key)
        groups = stage // len(sent)
        assert sent_total == pytest.approx(groups * sent.sum() * batch * seq)
        assert sent.sum() == pytest.approx(received.sum())
        assert (rs.busiest_share(a.key, b.key) == 0) == (sent_total == 0)


def test_ddp_path_only_for_homogeneous_plain_data_parallel():
    assert uses_ddp(make_plan(LLAMA, 4, S(dp=4)))
    assert not uses_ddp(make_plan(LLAMA, 4, S(dp=4, zero=1)))  # ZeRO-1 runs on FSDP2 (grad_sync)
    assert uses_ddp(make_plan(LLAMA, 4, S(dp=2, sp="ulysses", sp_degree=2)))
    assert not uses_ddp(make_plan(LLAMA, 4, S(dp=4, zero=2)))
    assert not uses_ddp(make_plan(LLAMA, 4, S(dp=2, tp=2)))
    assert not uses_ddp(make_plan(LLAMA, 4, [S(dp=2, tp=2)] + [S(dp=4)] * 5))


def test_refusals_name_the_field():
    ep_plan = make_plan(MOE, 4, [LayerStrategy(dp=4, ep=2)] + [LayerStrategy(dp=4, ep=2)] * 2 + [S(dp=4)])
    with pytest.raises(TesseraError, match=r"plan.layers\[0\] \(embedding\).ep=2: expert parallelism applies to "
                                           r"MoE layers only"):
        check_plan_supported(ep_plan, 4)
    with pytest.raises(TesseraError, match="pipeline.degree=2"):
        check_plan_supported(make_plan(LLAMA, 4, S(dp=2), num_micro_batches=2, stages=((0, 3), (3, 6))), 4)
    with pytest.raises(TesseraError, match=r"plan.layers\[1\] \(block0\).tp=4 does not divide the 4 heads / 2 KV"):
        check_plan_supported(make_plan(LLAMA, 4, S(tp=4)), 4)
    one_mb = make_plan(LLAMA, 4, S(dp=2), num_micro_batches=1, stages=((0, 3), (3, 6)))
    with pytest.raises(TesseraError, match="plan.num_micro_batches=1: schedule 1f1b needs at least pipeline.degree=2"):
        check_plan_supported(one_mb, 4, pipeline_available=True)
    with pytest.raises(TesseraError, match="offload_optimizer needs zero"):
        check_plan_supported(make_plan(LLAMA, 4, S(dp=4).model_copy(update={"offload_optimizer": True})), 4)


def test_layouts_the_search_emits_are_accepted():
    """Tied embeddings sharded two ways (the head holds a copy), dps that do not nest (the batch
    is then loaded in gcd(dp) blocks), ZeRO with offload on one rank, a sequence that does not
    split into the sequence shards (padded, padding ignored by the loss)."""
    from tessera.runtime.parallel_model import data_parallel_size

    gpt = make_plan(LLAMA.model_copy(update={"tie_embeddings": True}), 4, [S(dp=4)] * 5 + [S(dp=2, tp=2)])
    check_plan_supported(gpt, 4)
    check_plan_supported(make_plan(LLAMA, 2, S(tp=2, zero=1, offload=True)), 2)
    six = make_plan(LLAMA, 6, [S(dp=2, tp=3)] + [S(dp=3, tp=2)] * 4 + [S(dp=6)], global_batch=12)
    check_plan_supported(six, 6)
    check_plan_supported(make_plan(LLAMA, 4, S(tp=2, dp=2, sp="megatron"), seq_len=9), 4)  # padded to 10
    assert data_parallel_size(six) == 1 and data_parallel_size(gpt) == 2


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_cli_errors_are_one_line(tmp_path, capsys):
    plan4 = tmp_path / "plan4.json"
    make_plan(LLAMA, 4, S(dp=4)).save(plan4)
    err = _one_line_error(capsys, ["train", "--plan", str(plan4), "--nproc", "2"])
    assert err == "tessera train: error: plan was made for 4 ranks, but 2 are running"
    ep = tmp_path / "ep.json"
    make_plan(MOE, 4, [LayerStrategy(dp=4, ep=2)] + [LayerStrategy(dp=4, ep=2)] * 2 + [S(dp=4)]).save(ep)
    err = _one_line_error(capsys, ["train", "--plan", str(ep), "--nproc", "4"])
    assert "plan.layers[0] (embedding).ep=2" in err
    err = _one_line_error(capsys, ["train", "--plan", str(plan4), "--nproc", "4", "--data", str(tmp_path / "nope")])
    assert err == f"tessera train: error: data directory {tmp_path / 'nope'} does not exist"


def test_every_single_layout_of_four_ranks_is_a_valid_plan():
    """The runtime accepts every (dp, sp, tp, zero) it claims to support on 4 ranks."""
    for dp, tp, zero in itertools.product((1, 2, 4), (1, 2, 4), (0, 1, 2, 3)):
        if dp * tp != 4 or (tp == 4):  # tiny test model has 2 KV heads
            continue
        check_plan_supported(make_plan(LLAMA, 4, S(dp=dp, tp=tp, zero=zero if dp > 1 else 0,
                                                    sp="megatron" if tp > 1 else "none")), 4)
    assert SPKind.ULYSSES.value == "ulysses"


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_default_local_plan_runs_on_this_runtime(nproc):
    """`tessera train --model tiny-llama --nproc N` plans something the runtime accepts."""
    from tessera.cli.train import make_local_plan
    from tessera.spec.workload import Workload

    plan = make_local_plan("tiny-llama", nproc, Workload(global_batch=8, seq_len=128, dtype="fp32"))
    assert plan.world_size == nproc
    check_plan_supported(plan, nproc, pipeline_available=True)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gpt2", "gpt2", "tiny-moe"])
def test_searched_plans_are_accepted_by_the_runtime(model):
    """Every plan the search emits for local ranks (free, and forced into each pipeline schedule)
    is one the runtime runs, expert parallelism included."""
    from tessera.search import search
    from tessera.search.space import ALL_SCHEDULES, SearchOptions
    from tessera.spec.presets.clusters import local_cpu_cluster
    from tessera.spec.presets.models import get_model
    from tessera.spec.workload import Workload

    workload = Workload(global_batch=16, seq_len=128, dtype="fp32")
    for nproc in (2, 4, 8):
        options = [SearchOptions()] + [SearchOptions(pp=2, schedules=(s,)) for s in ALL_SCHEDULES]
        for opts in options:
            plan = search(get_model(model), local_cpu_cluster(nproc), workload, options=opts)
            check_plan_supported(plan, nproc, pipeline_available=True)


def test_sequences_pad_to_the_shards():
    import torch

    from tessera.runtime.parallel_model import IGNORE, pad_sequences, sequence_multiple

    plan = make_plan(LLAMA, 4, [S(dp=4)] + [S(sp="ulysses", sp_degree=2, dp=2)] * 2 + [S(tp=2, dp=2, sp="megatron")] * 3)
    assert sequence_multiple(plan) == 2
    tokens = torch.arange(14).view(2, 7) + 1
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]])
    t, l, p, d = pad_sequences(4, tokens, tokens, None, docs)
    assert t.shape == (2, 8) and t[:, 7].eq(0).all() and l[:, 7].eq(IGNORE).all()
    assert p[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 0]
    # The padding is a document of its own: no real token attends to it.
    assert d.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0, 0, 1]]
    assert pad_sequences(7, tokens, tokens)[0] is tokens
