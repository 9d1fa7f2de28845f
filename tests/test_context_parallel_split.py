"""Context parallelism without processes: the load-balanced split, the activation layouts with a
cp axis, the blocks each ring step computes (against the dense document-causal mask), and the
block kernels against their plain-tensor reference."""
import itertools

import pytest
import torch

from tessera.models.attention import document_causal_mask
from tessera.plan import LayerStrategy
from tessera.runtime.context_parallel import (_math_backward, _math_forward, block_backward, block_forward,
                                              ring_schedule)
from tessera.runtime.layout import ActLayout, load_balanced_ranges
from tessera.runtime.mesh import LayerLayout, layer_coords


def positions(ranges) -> list[int]:
    return [p for a, b in ranges for p in range(a, b)]


def test_load_balanced_split_gives_chunks_c_and_2cp_minus_1_minus_c():
    assert load_balanced_ranges(16, 2, 0) == ((0, 4), (12, 16))
    assert load_balanced_ranges(16, 2, 1) == ((4, 12),)  # chunks 1 and 2 touch: one range
    assert load_balanced_ranges(16, 4, 0) == ((0, 2), (14, 16))
    assert load_balanced_ranges(16, 4, 2) == ((4, 6), (10, 12))
    assert load_balanced_ranges(16, 1, 0) == ((0, 16),)
    with pytest.raises(ValueError, match="2 x cp = 8 equal chunks"):
        load_balanced_ranges(12, 4, 0)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_every_rank_has_the_same_causal_work(cp):
    seq = 8 * cp
    parts = [positions(load_balanced_ranges(seq, cp, c)) for c in range(cp)]
    assert sorted(itertools.chain(*parts)) == list(range(seq))
    work = {sum(q + 1 for q in part) for part in parts}  # keys each query attends (causal)
    assert work == {seq * (seq + 1) // (2 * cp)}


def test_act_layout_splits_each_cp_rank_local_sequence_inside():
    # (dp 1, cp 2, Ulysses 2): cp rank c holds chunks c and 3 - c; Ulysses halves its local sequence.
    lay = ActLayout(dp=1, sp=2, tp=1, cp=2)
    assert [lay.seq_ranges(r, 16) for r in range(4)] == [((0, 4),), ((12, 16),), ((4, 8),), ((8, 12),)]
    assert lay.seq_multiple == 4 and lay.seq_parts == 4
    # Megatron SP inside cp: the tp ranks split the local sequence.
    lay = ActLayout(dp=2, sp=1, tp=2, seq_over_tp=True, cp=2)
    assert lay.coords(5) == (1, 0, 0, 1) and lay.rows(5, 8) == (4, 8)
    assert lay.seq_ranges(5, 16) == ((12, 16),)
    assert ActLayout(dp=1, sp=1, tp=1, cp=4).seq_multiple == 8
    assert ActLayout(dp=1, sp=3, tp=1, cp=2).seq_multiple == 12
    # A cp layout refines the whole-sequence layout of the same batch split (no communication).
    assert ActLayout(dp=2, sp=1, tp=2, cp=1).refines(ActLayout(dp=2, sp=1, tp=2), 8, 16)
    assert ActLayout(dp=2, sp=1, tp=1, cp=2).refines(ActLayout(dp=2, sp=1, tp=2), 8, 16)
    assert not ActLayout(dp=1, sp=1, tp=1, cp=4).refines(ActLayout(dp=1, sp=4, tp=1), 8, 16)
    with pytest.raises(ValueError, match="use seq_ranges"):
        ActLayout(dp=1, sp=1, tp=1, cp=2).block(0, 2, 16)


def test_mesh_coordinates_and_shard_groups_with_cp():
    # stage_rank = ((d cp + c) sp + s) tp + t
    c = layer_coords(13, 16, dp=2, sp=1, tp=2, cp=4)
    assert (c.dp, c.cp, c.sp, c.tp) == (1, 2, 0, 1)
    zero3 = LayerLayout.of(LayerStrategy(dp=2, cp=2, zero=3))
    assert (zero3.shard, zero3.shard_dp, zero3.shard_cp, zero3.replicate) == (4, 2, 2, 1)
    hsdp = LayerLayout.of(LayerStrategy(dp=4, cp=2, zero=2, dp_shard=2))
    assert (hsdp.shard, hsdp.shard_dp, hsdp.replicate) == (4, 2, 2)
    ddp = LayerLayout.of(LayerStrategy(dp=2, cp=2))
    assert (ddp.shard, ddp.shard_cp, ddp.replicate) == (1, 1, 4)
    assert LayerStrategy(dp=2, cp=4, tp=2).devices == 16
    assert LayerStrategy(dp=2, cp=4, zero=1).shard_degree == 8


def _visible(sched, cp, rank, seq, doc_ids):
    """{(row, q position, k position)} the schedule computes, steps 0..cp-1."""
    idx = [positions(load_balanced_ranges(seq, cp, c)) for c in range(cp)]
    mine, got = idx[rank], set()
    b = doc_ids.shape[0] if doc_ids is not None else 1
    for row in range(b):
        ids = doc_ids[row] if doc_ids is not None else torch.zeros(seq, dtype=torch.long)
        for i, q in enumerate(mine):  # step 0: document-causal in local order
            got |= {(row, q, k) for k in mine[:i + 1] if ids[k] == ids[q]}
    for j in range(1, cp):
        src = (rank - j) % cp
        for r in sched.steps[j]:
            rows = range(b) if isinstance(r.rows, slice) else r.rows
            got |= {(row, mine[r.q0 + a], idx[src][r.k0 + c]) for row in rows for a in range(r.nq) for c in range(r.nk)}
    return got


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("with_docs", [False, True])
def test_ring_steps_compute_exactly_the_visible_pairs(cp, with_docs):
    seq = 32
    doc_ids = None
    if with_docs:
        lengths = [[5, 20, 7], [32], [3, 1, 1, 27], [16, 16], [9, 9, 9, 5]]
        doc_ids = torch.stack([torch.repeat_interleave(torch.arange(len(x)), torch.tensor(x)) for x in lengths])
    rows = doc_ids.shape[0] if with_docs else 1
    mask = document_causal_mask(doc_ids if with_docs else torch.zeros(1, seq, dtype=torch.long))[:, 0]
    work = []
    for rank in range(cp):
        sched = ring_schedule(cp, rank, seq, doc_ids)
        got = _visible(sched, cp, rank, seq, doc_ids)
        mine = positions(load_balanced_ranges(seq, cp, rank))
        want = {(b, q, k) for b in range(rows) for q in mine for k in range(seq) if mask[b, q, k]}
        assert got == want, (rank, sorted(want - got)[:5], sorted(got - want)[:5])
        if not with_docs:  # every step after the first is an unmasked rectangle of (seq/cp)^2 / 2 pairs
            work.append([r.nq * r.nk for step in sched.steps[1:] for r in step])
    if not with_docs:
        assert all(w == [(seq // cp) ** 2 // 2] * (cp - 1) for w in work)


def test_fully_masked_blocks_are_skipped():
    # One document per chunk: no key of another rank's chunks shares a document with my queries.
    cp, seq = 4, 32
    doc_ids = torch.arange(2 * cp).repeat_interleave(seq // (2 * cp))[None]
    for rank in range(cp):
        assert all(step == [] for step in ring_schedule(cp, rank, seq, doc_ids).steps[1:])


@pytest.mark.parametrize("causal", [False, True])
def test_block_kernels_match_the_plain_tensor_reference(causal):
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, 6, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    if not causal:
        k, v = k[:, :, :5], v[:, :, :5]
    out, lse, _ = block_forward(q, k, v, causal, 0.3)
    ref_out, ref_lse, _ = _math_forward(q, k, v, causal, 0.3)
    assert torch.allclose(out, ref_out, atol=1e-12) and torch.allclose(lse, ref_lse, atol=1e-12)
    # The backward with another block's merged statistics (as the ring calls it).
    out2, lse2 = out * 0.5, lse + 0.7
    for a, b in zip(block_backward(do, q, k, v, out2, lse2, causal, 0.3),
                    _math_backward(do, q, k, v, out2, lse2, causal, 0.3)):
        assert torch.allclose(a, b, atol=1e-12)
