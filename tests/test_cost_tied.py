"""A tied embedding and LM head: one layout from the search, shard-to-shard sums otherwise (cost/tied.py)."""
import numpy as np
import pytest

from tessera.cost.tied import TableShards, exchange
from tessera.plan import LayerStrategy, SPKind
from tessera.search import search
from tessera.search.space import param_layouts
from tessera.spec import Workload
from tessera.spec.presets import get_model, make_cluster


def S(**kw):
    return LayerStrategy(**kw)


@pytest.mark.parametrize("a, b", [
    (S(dp=4, tp=2, zero=3), S(dp=8, zero=1)),
    (S(dp=2, tp=4, zero=2), S(dp=8, zero=3, dp_shard=4)),
    (S(dp=8), S(tp=8, sp=SPKind.MEGATRON)),
    (S(dp=2, cp=2, tp=2, zero=3), S(dp=4, sp=SPKind.ULYSSES, sp_degree=2, zero=2)),
])
def test_every_rank_receives_the_other_copys_rows_of_its_shard_exactly_once(a, b):
    vocab, n = 103, 8  # rows that split unevenly: short and empty shards
    copies = [TableShards.of(a, 0, n), TableShards.of(b, 0, n)]
    for c in copies:  # the distinct blocks tile the table
        cover = np.zeros(vocab, dtype=int)
        for start, stop in c.holders(vocab)[1]:
            cover[start:stop] += 1
        assert (cover == 1).all()
    plans = {r: exchange(copies, vocab, r) for r in range(n)}
    for r, (_, receives) in plans.items():
        for p in receives:  # the peer sends exactly that piece, in the same order
            assert [(q.dest_copy, q.source_copy, q.start, q.stop) for q in plans[p.peer][0] if q.peer == r] == \
                [(q.dest_copy, q.source_copy, q.start, q.stop) for q in receives if q.peer == p.peer]
        for i, c in enumerate(copies):
            got = np.zeros(vocab, dtype=int)
            for p in receives:
                if p.dest_copy == i:
                    got[p.start:p.stop] += 1
            start, stop = c.rows(r, vocab)
            assert (got[start:stop] == 1).all() and got.sum() == stop - start


def test_the_search_gives_a_tied_pair_one_parameter_layout():
    # gpt2 on 8 GPUs: before the constraint the embedding took dp2 tp4 + SP and the head dp8,
    # pricing the tied table once while the runtime kept a second copy.
    plan = search(get_model("gpt2"), make_cluster("h100-80gb", 8), Workload(global_batch=32, seq_len=1024))
    first, last = plan.layers[0], plan.layers[-1]
    assert (first.dp, first.sp_degree, first.tp, first.shard_degree, first.cp) == \
        (last.dp, last.sp_degree, last.tp, last.shard_degree, last.cp)


def test_param_layouts_name_what_the_runtime_compares():
    from tessera.cost.layer import StrategyTable

    table = StrategyTable.build([S(dp=4, tp=2, zero=3), S(dp=8, zero=3, dp_shard=4), S(dp=8)])
    assert param_layouts(table) == [(4, 1, 2, 4, 1), (8, 1, 1, 4, 1), (8, 1, 1, 1, 1)]
