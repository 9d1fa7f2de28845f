"""The rank dynamic program (search/dp.py) against enumeration of every assignment."""
import itertools

import numpy as np
import pytest

from tessera.search.dp import Slot, solve_rank


def _instance(rng, layers, options, layouts):
    kinds = []
    for _ in range(rng.integers(1, 3)):  # layers repeat one or two kinds (shared arrays, as in the planner)
        t = rng.uniform(1.0, 10.0, options)
        mem = rng.uniform(1.0, 10.0, options) * (12.0 - t) / 6  # faster tends to need more memory
        buf = rng.choice([0.0, 0.5, 2.0], options)
        kinds.append((t, mem, buf, rng.integers(0, layouts, options)))
    slots = []
    for i in range(layers):
        t, mem, buf, lay = kinds[rng.integers(len(kinds))]
        slots.append(Slot(time=t, mem=mem, buf=buf, layout=lay, chunk_start=i == 0 or rng.random() < 0.2))
    trans = rng.uniform(0.0, 1.0, (layouts, layouts))
    np.fill_diagonal(trans, 0.0)
    return slots, trans


def _enumerate(slots, trans, budget):
    best = np.inf
    for pick in itertools.product(*[range(len(s.time)) for s in slots]):
        mem = sum(s.mem[j] for s, j in zip(slots, pick)) + max(s.buf[j] for s, j in zip(slots, pick))
        if mem > budget:
            continue
        t = sum(s.time[j] for s, j in zip(slots, pick))
        t += sum(trans[slots[k - 1].layout[pick[k - 1]], slots[k].layout[pick[k]]]
                 for k in range(1, len(slots)) if not slots[k].chunk_start)
        best = min(best, t)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_rank_program_is_the_optimum_or_says_how_close(seed):
    rng = np.random.default_rng(seed)
    slots, trans = _instance(rng, layers=int(rng.integers(3, 6)), options=int(rng.integers(2, 5)), layouts=3)
    smallest = sum(float(s.mem.min()) for s in slots) + max(float(s.buf.min()) for s in slots)
    largest = sum(float(s.mem.max()) for s in slots) + max(float(s.buf.max()) for s in slots)
    for budget in np.linspace(smallest * 0.98, largest * 1.02, 7):
        opt = _enumerate(slots, trans, budget)
        exact = solve_rank(slots, trans, budget, gap=0.0)
        loose = solve_rank(slots, trans, budget, bins=32, max_bins=64, gap=0.05)
        if not np.isfinite(opt):
            assert exact.solution is None and loose.solution is None
            continue
        for res, gap in ((exact, 0.0), (loose, 0.05)):
            sol = res.solution
            used = sum(s.mem[j] for s, j in zip(slots, sol.choice)) + max(s.buf[j] for s, j in zip(slots, sol.choice))
            assert used <= budget * (1 + 1e-12)
            assert res.bound <= opt * (1 + 1e-9) and sol.time >= opt * (1 - 1e-9)
            if res.certified:  # proved optimal: equals the enumeration
                assert sol.time == pytest.approx(opt, rel=1e-9)
        # With the default resolution and no tolerance these small programs are always proved.
        assert exact.certified and exact.solution.time == pytest.approx(opt, rel=1e-9)
