"""Data-parallel rank balancing (tessera.adapt.balance) against brute force and the plain split."""
from __future__ import annotations

import itertools

import numpy as np

from tessera.adapt.balance import (balance_ranks, best_partition, karmarkar_karp_partition, lpt_partition,
                                   part_loads, sequence_costs, strided_ranks, token_split_ranks)


def brute_force_makespan(costs, parts: int) -> float:
    best = np.inf
    for assign in itertools.product(range(parts), repeat=len(costs)):
        loads = np.bincount(assign, weights=costs, minlength=parts)
        best = min(best, loads.max())
    return best


def test_partitions_against_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(20):
        costs = sequence_costs(rng.integers(50, 5000, 8), lin=1.0, attn=1e-3)
        optimum = brute_force_makespan(costs, 3)
        lpt, kk, best = (part_loads(costs, f(costs, 3)).max() for f in (lpt_partition, karmarkar_karp_partition, best_partition))
        assert optimum * (1 - 1e-12) <= best <= min(lpt, kk)
        assert lpt <= optimum * 4 / 3 + 1e-9  # Graham's bound for LPT


def test_every_sequence_once_and_deterministic():
    rng = np.random.default_rng(1)
    lens = rng.integers(10, 20_000, 300)
    a = balance_ranks(lens, 8, 2, lin=1.0, attn=1e-4)
    b = balance_ranks(lens.copy(), 8, 2, lin=1.0, attn=1e-4)
    assert a.parts == b.parts
    flat = sorted(i for mb in a.parts for rank in mb for i in rank)
    assert flat == list(range(len(lens)))
    assert a.loads.shape == (2, 8)


def test_balancing_beats_the_plain_splits_on_real_length_mix():
    rng = np.random.default_rng(2)
    lens = np.minimum((rng.pareto(1.1, 512) * 300 + 30).astype(int), 131_072)
    lin, attn = 1.0, 2.6e-5  # attention weight per token^2 relative to the linear term (7B-like)
    costs = sequence_costs(lens, lin, attn)
    balanced = balance_ranks(lens, 16, lin=lin, attn=attn)
    # balanced up to the one sequence no split can cut
    assert balanced.loads.max() <= max(costs.max(), costs.sum() / 16) * 1.02
    short = np.minimum(lens, 8192)  # no single sequence dominates: strictly better than plain splits
    costs = sequence_costs(short, lin, attn)
    balanced = balance_ranks(short, 16, lin=lin, attn=attn)
    assert balanced.imbalance < 1.01
    for plain in (strided_ranks(costs, 16), token_split_ranks(short, costs, 16)):
        assert plain.imbalance > 1.1


def test_rows_go_in_equal_numbers_and_balance_time():
    """Packed rows (equal tokens, unequal work) to 4 ranks x 2 micro-batches: 4 rows each, every
    row once, the slowest part within the bound one row sets, better than the contiguous split."""
    from tessera.adapt.balance import balance_rows

    rng = np.random.default_rng(5)
    costs = rng.pareto(1.3, 32) + 0.2
    a = balance_rows(costs, 4, 2)
    assert all(len(p) == 4 for mb in a.parts for p in mb)
    assert sorted(i for mb in a.parts for p in mb for i in p) == list(range(32))
    assert a.loads.max() <= max(costs.max() + 3 * np.sort(costs)[:3].sum(), costs.sum() / 8) * 1.05
    contiguous = part_loads(costs, [list(range(4 * k, 4 * k + 4)) for k in range(8)]).max()
    assert a.loads.max() < contiguous
    assert balance_rows(costs, 4, 2).parts == a.parts  # deterministic


def test_rows_against_brute_force():
    from tessera.adapt.balance import balance_rows

    rng = np.random.default_rng(6)
    for _ in range(10):
        costs = rng.pareto(1.2, 8) + 0.1
        best = min(max(costs[list(c)].sum(), costs[[i for i in range(8) if i not in c]].sum())
                   for c in itertools.combinations(range(8), 4))
        got = balance_rows(costs, 2).loads.max()
        assert best * (1 - 1e-12) <= got <= best * 1.1
