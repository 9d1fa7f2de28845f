"""Spindle wave packing against brute force, the wave and Optimus simulators' sanity, bad input."""
import itertools
import math

import numpy as np
import pytest

from tessera.adapt.bubbles import PassTime, PipelineWindows, assign, exact, least_extra, price, refine
from tessera.adapt.optimus import optimus_schedule
from tessera.adapt.spindle import Operator, pack_waves, plan_spindle, sequential_baseline
from tessera.errors import TesseraError
from tessera.search.multimodal import PartPricer, plan_vlm_task
from tessera.spec.multimodal import resolve_vlm
from tessera.spec.presets.clusters import make_cluster
from tessera.spec.tasks import TaskSpec, load_tasks, parse_tasks


def _brute_force(ops, sizes, fwd, bwd, total, mem=None, budget=math.inf):
    """Every ordered sequence of waves (sets of ready operators) and every allocation of each
    (with `mem`: only those whose waves' largest per-device bytes add up to <= budget)."""
    n = len(ops)
    best = math.inf

    def rec(done, acc, used):
        nonlocal best
        if done == (1 << n) - 1:
            best = min(best, acc)
            return
        ready = [o for o in range(n) if not done >> o & 1 and all(done >> a & 1 for a in ops[o].after)]
        for k in range(1, len(ready) + 1):
            for members in itertools.combinations(ready, k):
                for alloc in itertools.product(range(len(sizes)), repeat=k):
                    if sum(sizes[i] for i in alloc) > total:
                        continue
                    f = max(fwd[o, i] for o, i in zip(members, alloc))
                    b = max(bwd[o, i] for o, i in zip(members, alloc))
                    m = max(mem[o, i] for o, i in zip(members, alloc)) if mem is not None else 0.0
                    if math.isfinite(f + b) and used + m <= budget:
                        rec(done | sum(1 << o for o in members), acc + f + b, used + m)

    rec(0, 0.0, 0.0)
    return best


def _four_operators() -> list[Operator]:
    """Task a (encoder, then its LLM), and LLM-only tasks b and c."""
    return [Operator("a/enc", "a", "vision_encoder"), Operator("a/llm", "a", "llm", (0,)),
            Operator("b/llm", "b", "llm"), Operator("c/llm", "c", "llm")]


def _times(rng, n: int, sizes: list[int]):
    """Forward and backward seconds per operator and group size: random work, sub-linear speed-up."""
    work = rng.uniform(0.5, 4.0, size=n)
    fwd = np.array([[w / 3 / g ** 0.8 for g in sizes] for w in work])
    return fwd, 2 * fwd


@pytest.mark.parametrize("seed", range(6))
def test_wave_packing_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    ops = [Operator("a/enc", "a", "vision_encoder"), Operator("a/llm", "a", "llm", (0,)),
           Operator("b/llm", "b", "llm"), Operator("c/enc", "c", "vision_encoder"),
           Operator("c/llm", "c", "llm", (3,))]
    sizes = [1, 2, 4]
    work = rng.uniform(0.5, 4.0, size=len(ops))
    scaling = rng.uniform(0.5, 1.0, size=len(ops))  # sub-linear speed-up with more devices
    fwd = np.array([[w / 3 / g ** s for g in sizes] for w, s in zip(work, scaling)])
    bwd = fwd * rng.uniform(1.5, 2.5, size=fwd.shape)
    fwd[2, 0] = np.inf  # an operator that does not fit on one device
    cost, waves = pack_waves(ops, sizes, fwd, bwd, 4)
    assert cost == pytest.approx(_brute_force(ops, sizes, fwd, bwd, 4), rel=1e-12)
    seen = [o for members, _ in waves for o in members]
    assert sorted(seen) == list(range(len(ops)))
    position = {o: k for k, (members, _) in enumerate(waves) for o in members}
    assert position[1] > position[0] and position[4] > position[3]
    assert all(sum(groups) <= 4 for _, groups in waves)


def test_wave_packing_under_a_memory_budget_matches_brute_force():
    ops = _four_operators()
    sizes = [1, 2, 4]
    tight = 0
    for seed in range(6):
        rng = np.random.default_rng(seed)
        fwd, bwd = _times(rng, len(ops), sizes)
        # Model states shard over the group (1 / g per device), activations a little on top.
        mem = np.array([[s / g + a for g in sizes]
                        for s, a in zip(rng.uniform(4, 8, len(ops)), rng.uniform(0, 0.2, len(ops)))])
        free, free_waves = pack_waves(ops, sizes, fwd, bwd, 4)
        assert pack_waves(ops, sizes, fwd, bwd, 4, mem=mem, budget=math.inf)[0] == pytest.approx(free)
        free_mem = sum(max(mem[o, sizes.index(g)] for o, g in zip(members, groups)) for members, groups in free_waves)
        for budget in free_mem * np.linspace(0.5, 0.99, 8):
            want = _brute_force(ops, sizes, fwd, bwd, 4, mem, budget)
            cost, waves = pack_waves(ops, sizes, fwd, bwd, 4, mem=mem, budget=budget)
            if not math.isfinite(want):
                assert waves == []
                continue
            assert cost == pytest.approx(want, rel=1e-12)
            used = sum(max(mem[o, sizes.index(g)] for o, g in zip(members, groups)) for members, groups in waves)
            assert used <= budget
            tight += cost > free * (1 + 1e-9)
    assert tight >= 3  # budgets that bind: slower schedules that fit


def test_exact_memory_packing_matches_brute_force():
    """A* against every wave sequence of the same space (each wave's Pareto allocations), scored
    by `device_memory` (rounds as early as the dependencies allow)."""
    from types import SimpleNamespace as NS

    from tessera.adapt.spindle import Placed, Wave, _pack_waves_exact_memory, _wave_options, device_memory
    ops = _four_operators()
    sizes = [1, 2, 4]
    binding = 0
    for seed in range(4):
        rng = np.random.default_rng(seed)
        fwd, bwd = _times(rng, len(ops), sizes)
        states = np.array([[s / g for g in sizes] for s in rng.uniform(2, 6, len(ops))])
        act = np.array([[a / g for g in sizes] for a in rng.uniform(1, 4, len(ops))])
        buf = np.full_like(fwd, 0.1)
        costs = {(o, g, "fastest"): NS(states_bytes=states[o, i], act_bytes=act[o, i], buf_bytes=0.1)
                 for o in range(len(ops)) for i, g in enumerate(sizes)}
        schedules = []  # (time, peak) of every sequence

        def rec(done, time, waves):
            if done == 15:
                placed = []
                for members, chosen in waves:
                    first, row = 0, []
                    for o, i in zip(members, chosen):
                        row.append(Placed(o, sizes[i], first, 0.0, 0.0))
                        first += sizes[i]
                    placed.append(Wave(tuple(row)))
                schedules.append((time, float(device_memory(ops, placed, costs, 4).max())))
                return
            ready = [o for o in range(4) if not done >> o & 1 and all(done >> a & 1 for a in ops[o].after)]
            for k in range(1, len(ready) + 1):
                for members in itertools.combinations(ready, k):
                    for t, _, chosen in _wave_options(members, np.array(sizes, float), fwd, bwd, states + act, 4):
                        rec(done | sum(1 << o for o in members), time + t, waves + [(members, chosen)])

        rec(0, 0.0, [])
        fastest = min(t for t, _ in schedules)
        for budget in np.quantile([m for _, m in schedules], [0.05, 0.3, 0.6]):
            want = min((t for t, m in schedules if m <= budget), default=math.inf)
            cost, waves = _pack_waves_exact_memory(ops, sizes, fwd, bwd, states, act, buf, 4, budget)
            assert cost == pytest.approx(want, rel=1e-12)
            binding += want > fastest * (1 + 1e-9)
    assert binding >= 3


def test_device_memory_adds_up_states_across_waves_and_every_waves_activations():
    from types import SimpleNamespace as NS

    from tessera.adapt.spindle import Placed, Wave, device_memory, round_ends
    ops = _four_operators()
    costs = {(0, 2, "fastest"): NS(states_bytes=10.0, act_bytes=1.0, buf_bytes=0.5),
             (1, 4, "fastest"): NS(states_bytes=100.0, act_bytes=2.0, buf_bytes=3.0),
             (2, 2, "fastest"): NS(states_bytes=200.0, act_bytes=4.0, buf_bytes=1.0),
             (3, 4, "lean"): NS(states_bytes=120.0, act_bytes=8.0, buf_bytes=2.0)}
    waves = [Wave((Placed(0, 2, 0, 0, 0), Placed(2, 2, 2, 0, 0))),  # a's encoder on 0-1, b's LLM on 2-3
             Wave((Placed(1, 4, 0, 0, 0),)),  # a's LLM on all four
             Wave((Placed(3, 4, 0, 0, 0, "lean"),))]  # c's LLM (lean plan) on the same group of four: one LLM copy
    one_round = device_memory(ops, waves, costs, 4, ends=(2,))
    # devices 0-1: encoder states + one LLM copy on the 4-group (the larger of a's and c's) + acts + largest buffer
    assert one_round[0] == one_round[1] == 10 + 120 + (1 + 2 + 8) + 3
    # devices 2-3: b's LLM group of 2 holds its own copy beside the 4-group's
    assert one_round[2] == one_round[3] == 200 + 120 + (4 + 2 + 8) + 3
    # Rounds: after wave 2 every operator that depends on a finished one has finished (a's LLM
    # follows a's encoder): that round's backward runs and frees its activations.
    assert round_ends(ops, waves) == (1, 2)
    got = device_memory(ops, waves, costs, 4)
    assert got[0] == got[1] == 10 + 120 + max(1 + 2, 8) + 3
    assert got[2] == got[3] == 200 + 120 + max(4 + 2, 8) + 3


@pytest.fixture(scope="module")
def tiny():
    vlm = resolve_vlm("tiny-vlm")
    tasks = parse_tasks({"tasks": [
        {"name": "caption", "modalities": ["image", "text"], "batch": 16, "images_per_sample": 1, "text_tokens": 16},
        {"name": "text", "modalities": ["text"], "batch": 16, "text_tokens": 128},
        {"name": "interleaved", "modalities": ["image", "text"], "batch": 8, "images_per_sample": 2,
         "text_tokens": 64}]})
    return vlm, tasks, PartPricer(vlm, make_cluster(num_gpus=16))


def test_wave_simulator_sanity(tiny):
    vlm, tasks, pricer = tiny
    plan = plan_spindle(pricer, tasks, 16)
    timeline = plan.timeline()
    names = [op.name for op in plan.ops]
    # Every operator runs its forward once and its backward once.
    for name in names:
        assert sorted(k for n, k, *_ in timeline if n == name) == ["B", "F"]
    # Groups of one wave never overlap and fit the devices; the step is the waves' sum plus extras.
    for w in plan.waves:
        spans = sorted((p.first_gpu, p.first_gpu + p.gpus) for p in w.ops)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= 16
    end = max(e for *_, e in timeline)
    assert end == pytest.approx(plan.waves_s)
    assert plan.step_s == pytest.approx(end + plan.combine_s + plan.tail_s)
    # The encoder's forward ends before its LLM's starts; its backward starts after the LLM's ends.
    t = {(n, k): (s, e) for n, k, _, _, s, e in timeline}
    for task in ("caption", "interleaved"):
        assert t[f"{task}/vision_encoder", "F"][1] <= t[f"{task}/llm", "F"][0] + 1e-12
        assert t[f"{task}/llm", "B"][1] <= t[f"{task}/vision_encoder", "B"][0] + 1e-12
    # The baseline runs each task's best plan on all devices.
    base = sequential_baseline(pricer, tasks, 16)
    assert base.busy_s == pytest.approx(sum(plan_vlm_task(pricer, t, 16).busy_s for t in tasks.tasks))


def _as_pass(x) -> PassTime:
    return x if isinstance(x, PassTime) else PassTime(x)


def _check_passes(windows, placed, f, b, images):
    """Every encoder pass inside its rank's bubbles and after / before its micro-batch's LLM work."""
    counts = placed.counts
    assert [sum(row[j] for row in counts) for j in range(len(images))] == list(images)
    by_rank: dict = {}
    for p in placed.passes:
        by_rank.setdefault((p.rank, p.kind), []).append(p)
        assert p.end - p.start == pytest.approx(_as_pass(f if p.kind == "EF" else b)(p.images))
        if p.kind == "EF":
            assert p.start >= -placed.shift_s - 1e-9
            assert p.end <= min(windows.deadlines[p.micro_batch], windows.warm[p.rank]) + 1e-9
        else:
            assert p.start >= max(windows.releases[p.micro_batch], windows.cool[p.rank]) - 1e-9
            assert p.end <= windows.horizon + placed.extension_s + 1e-9
    for passes in by_rank.values():  # one pass at a time per rank, in micro-batch order
        for a, c in zip(passes, passes[1:]):
            assert a.micro_batch < c.micro_batch and a.end <= c.start + 1e-9


@pytest.mark.parametrize("pp,m,per_mb", [(2, 3, 2), (3, 3, 1), (2, 4, 1)])
def test_bubble_assignment_is_near_brute_force(pp, m, per_mb):
    """Every whole-image assignment priced by the same formulas: the search's S + E is within one
    image's forward + backward of the best (it water-fills divisible work, then rounds)."""
    from tessera.cost.schedule import simulate
    sim = simulate("1f1b", [1.0] * pp, [2.0] * pp, m, pp, 1, 0.1)
    windows = PipelineWindows.from_events(sim.events, pp, m, sim.step_time, 0.1)
    for f, b in ((0.3, 0.6), (1.0, 2.5), (0.1, 0.2), (PassTime(0.1, 0.2), PassTime(0.2, 0.3)),
                 (PassTime.from_table((0.4, 0.5), 1), PassTime.from_table((0.8, 1.1), 1))):
        placed = assign(windows, [per_mb] * m, f, b)
        _check_passes(windows, placed, f, b, [per_mb] * m)
        splits = [c for c in itertools.product(range(per_mb + 1), repeat=pp) if sum(c) == per_mb]
        best = math.inf
        for choice in itertools.product(splits, repeat=m):
            counts = [[choice[j][r] for j in range(m)] for r in range(pp)]
            got = price(windows, counts, f, b)
            best = min(best, got.shift_s + got.extension_s)
        one = _as_pass(f)(1) + _as_pass(b)(1)  # one image's passes (a pass's fixed part included)
        assert best - 1e-9 <= placed.shift_s + placed.extension_s <= best + one
        assert least_extra(windows, [per_mb] * m, f, b) <= best + 1e-9  # the pruning bound holds
        better = refine(windows, placed, f, b)  # moves of images between ranks: never worse
        _check_passes(windows, better, f, b, [per_mb] * m)
        assert best - 1e-9 <= better.shift_s + better.extension_s <= placed.shift_s + placed.extension_s
        # A rank's memory holds `limit` images: the placement keeps within it, at some cost.
        limit = m + -(-per_mb * m // pp)
        capped = assign(windows, [per_mb] * m, f, b, limit=limit)
        _check_passes(windows, capped, f, b, [per_mb] * m)
        assert max(capped.images_per_rank) <= limit
        assert max(refine(windows, capped, f, b, limit).images_per_rank) <= limit
        assert capped.shift_s + capped.extension_s >= best - 1e-9
        # The MILP finds the brute-force optimum (these are small enough to prove it), and its bound holds.
        solved = exact(windows, [per_mb] * m, f, b)
        _check_passes(windows, solved.placed, f, b, [per_mb] * m)
        assert solved.optimal and solved.placed.shift_s + solved.placed.extension_s == pytest.approx(best, abs=1e-7)
        assert solved.bound_s <= best + 1e-7
        capped_best = min((price(windows, [[choice[j][r] for j in range(m)] for r in range(pp)], f, b)
                           for choice in itertools.product(splits, repeat=m)
                           if all(sum(choice[j][r] for j in range(m)) <= limit for r in range(pp))),
                          key=lambda a: a.shift_s + a.extension_s)
        solved = exact(windows, [per_mb] * m, f, b, limit)
        assert max(solved.placed.images_per_rank) <= limit
        assert solved.placed.shift_s + solved.placed.extension_s == pytest.approx(
            capped_best.shift_s + capped_best.extension_s, abs=1e-7)
    assert assign(windows, [per_mb] * m, 1.0, 2.0, limit=m) is None  # no room for any image


def test_placement_with_each_ranks_own_pass_times_and_memory_matches_brute_force():
    """Replicas that recompute different blocks pass at different speeds and hold different image
    counts (`adapt/optimus._rank_plans`): with pass times and limits per rank, the MILP finds the
    brute-force optimum, the search and its refinement keep every rank within its limit and are
    no better than it, and the pruning bound holds."""
    from tessera.cost.schedule import simulate
    pp, m, per_mb = 3, 3, 2
    sim = simulate("1f1b", [1.0] * pp, [2.0] * pp, m, pp, 1, 0.1)
    windows = PipelineWindows.from_events(sim.events, pp, m, sim.step_time, 0.1)
    # rank 0 recomputes everything (slow backward, holds many), rank 2 nothing (fast, holds few)
    f = tuple(PassTime.from_table((0.3, 0.45), 1) for _ in range(pp))
    b = (PassTime.from_table((1.0, 1.6), 1), PassTime.from_table((0.8, 1.3), 1), PassTime.from_table((0.6, 1.0), 1))
    splits = [c for c in itertools.product(range(per_mb + 1), repeat=pp) if sum(c) == per_mb]
    for limits in ((6, 6, 6), (9, 4, 2), (6, 5, 4), (2, 2, 3)):
        placements = [[[choice[j][r] for j in range(m)] for r in range(pp)]
                      for choice in itertools.product(splits, repeat=m)]
        priced = [price(windows, c, f, b) for c in placements
                  if all(sum(c[r]) <= limits[r] for r in range(pp))]
        best = min(a.shift_s + a.extension_s for a in priced)
        solved = exact(windows, [per_mb] * m, f, b, limits)
        assert solved.optimal and solved.placed.shift_s + solved.placed.extension_s == pytest.approx(best, abs=1e-7)
        assert all(k <= lim for k, lim in zip(solved.placed.images_per_rank, limits))
        assert least_extra(windows, [per_mb] * m, f, b) <= best + 1e-9
        placed = assign(windows, [per_mb] * m, f, b, limits)
        if placed is None:  # the search's rounding room (one image per micro-batch) can leave none
            assert sum(max(0, lim - m) for lim in limits) < per_mb * m
            continue
        better = refine(windows, placed, f, b, limits)
        for got in (placed, better):
            assert all(k <= lim for k, lim in zip(got.images_per_rank, limits))
            assert got.shift_s + got.extension_s >= best - 1e-9
        assert better.shift_s + better.extension_s <= placed.shift_s + placed.extension_s
    with pytest.raises(ValueError, match="2 pass times for 3 pipeline ranks"):
        price(windows, [[1] * m] * pp, f[:2], b)


def test_exact_placement_prices_passes_of_a_group_by_their_slowest_device():
    """With pass times stepped by a rank group's width (`PassTime.table`), the MILP's placement is
    the brute-force optimum over every whole-image assignment, and a one-rank limit it cannot meet
    gives no placement."""
    from tessera.cost.schedule import simulate
    pp, m, per_mb, width = 2, 3, 6, 4
    sim = simulate("1f1b", [1.0] * pp, [2.0] * pp, m, pp, 1, 0.1)
    windows = PipelineWindows.from_events(sim.events, pp, m, sim.step_time, 0.1)
    f, b = PassTime.from_table((0.5, 0.6), width), PassTime.from_table((0.9, 1.2), width)
    best = min((price(windows, [list(row), [per_mb - a for a in row]], f, b)
                for row in itertools.product(range(per_mb + 1), repeat=m)), key=lambda a: a.shift_s + a.extension_s)
    solved = exact(windows, [per_mb] * m, f, b)
    assert solved.placed.shift_s + solved.placed.extension_s == pytest.approx(best.shift_s + best.extension_s, abs=1e-7)
    assert f(5) == f(8) == 0.6  # a pass of 5 images costs its slowest device's 2
    assert exact(windows, [per_mb] * m, f, b, limit=5) is None  # 18 images on 2 ranks of 5


def _pass_work(res, task) -> float:
    """The encoder seconds of an Optimus result's passes, each priced at its own size by its
    rank's encoder plan."""
    from tessera.adapt.optimus import encoder_pass_times
    per_mb = max(sum(row[j] for row in res.counts) for j in range(res.num_micro_batches))
    total = 0.0
    for r, row in enumerate(res.counts):
        f, b = encoder_pass_times(res.rank_encoder(r).plan, per_mb)
        total += sum(f(a) + b(a) for a in row if a)
    return total


def test_pass_times_charge_each_pass_its_zero3_gathers():
    """A ZeRO-3 encoder gathers its parameters again in every pass: a one-image pass costs more
    than its share of a large one (a fixed part), and a pass of k images per device is the cost
    model's one micro-batch of k; without ZeRO-3 the pass time is (nearly) linear in images."""
    from tessera.adapt.bubbles import PassTime
    from tessera.adapt.optimus import encoder_pass_times
    from tessera.cost.evaluate import chunk_times
    from tessera.search.multimodal import LEAN_OPTIONS
    vlm = resolve_vlm("vit6b-llama3-70b")
    pricer = PartPricer(vlm, make_cluster(num_gpus=512))
    lean = pricer.cost("vision_encoder", 128, 768, vlm.encoder_seq_len, LEAN_OPTIONS)
    d = lean.plan.dp_of_batch
    f, b = encoder_pass_times(lean.plan, 3 * d)
    assert len(f.table) == 3 and f.width == d
    assert f.fixed > 0 and b.fixed > 0  # ZeRO-3: each pass re-gathers every layer
    assert f(1) == f(d) == f.table[0] and f(d + 1) == f.table[1]  # the slowest device's images decide
    assert f(5 * d) == pytest.approx(f.table[-1] + 2 * d * f.per_image)
    one = chunk_times(lean.plan.model_copy(update={
        "workload": lean.plan.workload.model_copy(update={"global_batch": 2 * d}), "micro_batch_size": 2,
        "num_micro_batches": 1}))
    assert f(2 * d) == pytest.approx(one[0][0]) and b(2 * d) == pytest.approx(one[1][0])
    # Per image, small passes cost more than large ones, with ZeRO-3.
    assert f(d) / d > f(3 * d) / (3 * d)
    linear = PassTime(0.5)
    assert linear(3) == 1.5 and linear(0) == 0.0
    # ZeRO-2 keeps the parameters gathered over the step: a pass only reduce-scatters gradients,
    # so a small pass costs far less than ZeRO-3's re-gathering one.
    from tessera.adapt.optimus import _encoder_plans
    fast, lean_again, kept = _encoder_plans(pricer, 128, 768)
    assert lean_again is lean and {s.zero for s in kept.plan.layers[1:-1]} == {2}
    assert [(s.recompute, s.dp) for s in kept.plan.layers] == [(s.recompute, s.dp) for s in lean.plan.layers]
    kf, kb = encoder_pass_times(kept.plan, 3 * kept.plan.dp_of_batch)
    assert kf(1) < f(1) and kb(1) < b(1) and kf.fixed < f.fixed


def test_whole_images_round_to_whole_passes_of_a_group():
    """Rounded in quanta of a rank group's width, every share but one remainder per micro-batch is
    a multiple of it, and each micro-batch's images are all placed."""
    from tessera.adapt.bubbles import _whole_images
    split = [[100.0, 30.5, 0.0], [200.0, 60.2, 64.0], [84.0, 37.3, 0.0]]
    images = [384, 128, 64]
    for quantum in (1, 64, 128):
        counts = _whole_images(split, images, quantum)
        assert [sum(row[j] for row in counts) for j in range(3)] == images
        for j in range(3):
            off = [row[j] % quantum for row in counts if row[j] % quantum]
            assert len(off) <= 1 and sum(off) == images[j] % quantum
    assert [row[0] for row in _whole_images(split, images, 128)] == [128, 128, 128]  # largest remainders


def test_optimus_schedule_on_a_tiny_pipeline():
    from tessera.search.planner import search
    from tessera.search.space import SearchOptions
    from tessera.spec.workload import Workload
    vlm = resolve_vlm("tiny-vlm")
    pricer = PartPricer(vlm, make_cluster(num_gpus=8))
    task = TaskSpec(name="t", modalities=("image", "text"), batch=32, images_per_sample=2, text_tokens=96)
    plan = search(vlm.llm, make_cluster(num_gpus=8), Workload(global_batch=32, seq_len=task.llm_seq_len(vlm)),
                  SearchOptions(pp=4, schedules=("1f1b",), allow_offload=False, allow_ulysses=False))
    res = optimus_schedule(pricer, task, plan)
    enc = [p for p in res.pieces if p.kind in ("EF", "EB")]
    work = sum(p.end - p.start for p in enc)
    assert work == pytest.approx(_pass_work(res, task), rel=1e-6)
    assert sum(map(sum, res.counts)) == task.images()
    stage0 = {(p.kind, p.micro_batch): p for p in res.pieces if p.rank == 0 and p.kind in ("F", "B")}
    for p in enc:  # forward pieces before their micro-batch's LLM forward, backward after its backward
        if p.kind == "EF":
            assert p.end <= stage0["F", p.micro_batch].start + 1e-9
        else:
            assert p.start >= stage0["B", p.micro_batch].end - 1e-9
    assert res.step_s >= res.pipeline_s


def test_bad_input_answers_in_one_line(tmp_path, tiny):
    vlm, tasks, pricer = tiny
    f = tmp_path / "tasks.yaml"
    f.write_text("tasks:\n  - {name: speech, modalities: [audio, text], batch: 4, text_tokens: 8}\n")
    with pytest.raises(TesseraError, match="task 'speech': unknown modality 'audio'; known: image, text"):
        load_tasks(f)
    f.write_text("tasks:\n  - {name: t, modalities: [text], batch: 4, text_tokens: 8, parts: [llm, audio_encoder]}\n")
    with pytest.raises(TesseraError, match="task 't': unknown model part 'audio_encoder'"):
        load_tasks(f)
    wrong = parse_tasks({"tasks": [{"name": "c", "modalities": ["image", "text"], "batch": 4,
                                    "images_per_sample": 1, "text_tokens": 8, "image_size": 64}]})
    with pytest.raises(TesseraError, match="task 'c': images are 64 px but tiny-vlm's encoder takes 32 px"):
        plan_spindle(pricer, wrong, 16)
    big = resolve_vlm("llava-1.5-7b")
    task = TaskSpec(name="c", modalities=("image", "text"), batch=8, images_per_sample=1, text_tokens=64)
    with pytest.raises(TesseraError, match="encoder placement on 1 of 2 GPUs does not fit"):
        plan_vlm_task(PartPricer(big, make_cluster(gpu="a100-40gb", num_gpus=2)), task, 2, encoder_gpus=1)


def test_cli_plans_tasks_and_shows_waves(tmp_path, capsys):
    from tessera.cli import main
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text("tasks:\n"
                     "  - {name: caption, modalities: [image, text], batch: 16, images_per_sample: 1, text_tokens: 16}\n"
                     "  - {name: text, modalities: [text], batch: 16, text_tokens: 128}\n")
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "tiny-vlm", "--gpus", "16", "--tasks", str(tasks), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Spindle waves" in text and "wave 1:" in text
    # Every plan kind priced, the fastest chosen and said why.
    import json
    record = json.loads(out.read_text())
    steps = {k["kind"]: k["step_s"] for k in record["kinds"]}
    assert set(steps) == {"Spindle waves", "tasks one after another"}
    assert record["chosen"]["step_s"] == min(steps.values()) and record["chosen"]["kind"] in text
    assert f"chosen: {record['chosen']['kind']}" in text and "fastest of the 2 plan kinds" in text
    assert main(["show", str(out)]) == 0
    assert (tmp_path / "plan-waves.svg").is_file()
    tasks.write_text("tasks:\n  - {name: s, modalities: [audio], batch: 4, text_tokens: 8}\n")
    assert main(["plan", "--model", "tiny-vlm", "--gpus", "16", "--tasks", str(tasks)]) != 0
    assert "unknown modality 'audio'" in capsys.readouterr().err


def test_cli_plan_of_one_task_shows_the_encoder_in_the_bubbles(tmp_path, capsys):
    """`tessera plan -o` of one image-text task records the Optimus placement; `tessera show` says it
    and draws the encoder's passes in the LLM pipeline's bubbles (boxes with SVG ids)."""
    import json

    from tessera.cli import main
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "tiny-vlm", "--gpus", "16", "--global-batch", "32", "-o", str(out)]) == 0
    record = json.loads(out.read_text())
    o = record["optimus"]
    assert {k["kind"] for k in record["kinds"]} >= {"Optimus"}
    assert sum(map(sum, o["counts"])) == 32 and len(o["counts"]) == o["pp"]
    encoder = [p for p in o["pieces"] if p[1] in ("EF", "EB")]
    assert {p[1] for p in encoder} == {"EF", "EB"}
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    assert f"{o['bubble_filled']:.0%} of the bubbles filled" in capsys.readouterr().out
    svg = (tmp_path / "plan-optimus.svg").read_text()
    r, kind, j = encoder[0][:3]
    assert f"event-{kind}-r{r}-m{j}" in svg


def test_spindle_keeps_every_device_within_memory():
    from tessera.adapt.spindle import device_memory
    from tessera.cost.memory import memory_budget
    from tessera.search.multimodal import LEAN_OPTIONS
    vlm = resolve_vlm("tiny-vlm")
    tasks = parse_tasks({"tasks": [
        {"name": "caption", "modalities": ["image", "text"], "batch": 16, "images_per_sample": 1, "text_tokens": 16},
        {"name": "text", "modalities": ["text"], "batch": 16, "text_tokens": 128},
        {"name": "interleaved", "modalities": ["image", "text"], "batch": 8, "images_per_sample": 2,
         "text_tokens": 64}]})
    base = make_cluster(num_gpus=16)
    roomy = plan_spindle(PartPricer(vlm, base), tasks, 16)
    assert not roomy.memory_bound and roomy.peak_bytes <= roomy.usable_bytes
    # 2.14 GiB devices (2 GiB of them the framework's reserve): each operator's plan still fits its
    # group, the fastest schedule (the one above) overflows a device, a slower one fits.
    small = base.model_copy(update={"device": base.device.model_copy(update={"memory_bytes": 2.14 * 2**30})})
    pricer = PartPricer(vlm, small)
    plan = plan_spindle(pricer, tasks, 16)
    assert plan.memory_bound and plan.step_s > roomy.step_s
    by_name = {t.name: t for t in tasks.tasks}
    costs = {(o, g, v): (pricer.encoder if op.part == "vision_encoder" else pricer.llm)(
                 by_name[op.task], g, LEAN_OPTIONS if v == "lean" else None)
             for o, op in enumerate(plan.ops) for g in (1, 2, 4, 8, 16) for v in ("fastest", "lean")}
    assert device_memory(plan.ops, plan.waves, costs, 16).max() <= memory_budget(small)
    assert device_memory(roomy.ops, roomy.waves, costs, 16).max() > memory_budget(small)
    assert "the fastest schedule did not fit: the fastest that fits" in "\n".join(plan.describe())
    tiny_dev = base.model_copy(update={"device": base.device.model_copy(update={"memory_bytes": 2.11 * 2**30})})
    with pytest.raises(TesseraError, match="no wave schedule of the 5 operators fits in device memory on 16 GPUs"):
        plan_spindle(PartPricer(vlm, tiny_dev), tasks, 16)


def test_extra_stage_split_is_the_best_that_fits_in_memory():
    from tessera.adapt.optimus import _min_max_split, _stage_memory_check
    rng = np.random.default_rng(3)
    checked = binding = 0
    for _ in range(30):
        L, pp, m = 9, 3, 4
        weights = list(rng.uniform(0.5, 2.0, L))
        memory = [(float(rng.uniform(1, 3)), float(rng.uniform(0.2, 1)), float(rng.uniform(0, 0.5))) for _ in range(L)]
        budget = float(rng.uniform(8, 16))
        fits = _stage_memory_check(memory, pp, m, budget)
        # by hand: rank r holds min(pp - r, m) micro-batches of activations
        assert fits.allocated(1, 2, 5) == pytest.approx(sum(x[0] for x in memory[2:5]) + 2 * sum(x[1] for x in memory[2:5])
                                                        + max(x[2] for x in memory[2:5]))
        best = math.inf
        for cut in itertools.combinations(range(1, L), pp - 1):
            split = list(zip((0,) + cut, cut + (L,)))
            if all(fits(r, s, e) for r, (s, e) in enumerate(split)):
                best = min(best, max(sum(weights[s:e]) for s, e in split))
        got = _min_max_split(weights, pp, fits)
        if not math.isfinite(best):
            assert got is None
            continue
        assert len(got) == pp and got[0][0] == 0 and got[-1][1] == L
        assert all(a[1] == b[0] for a, b in zip(got, got[1:]))
        assert all(fits(r, s, e) for r, (s, e) in enumerate(got))
        assert max(sum(weights[s:e]) for s, e in got) == pytest.approx(best, rel=1e-9)
        checked += 1
        free = max(sum(weights[s:e]) for s, e in _min_max_split(weights, pp))
        binding += best > free * (1 + 1e-9)
    assert checked >= 10 and binding >= 3


def test_optimus_prices_whole_images_per_rank_and_the_baseline_checks_memory():
    from tessera.adapt.optimus import extra_stage_baseline
    from tessera.cost.evaluate import usable_memory
    from tessera.search.planner import search
    from tessera.search.space import SearchOptions
    from tessera.spec.workload import Workload
    vlm = resolve_vlm("tiny-vlm")
    cluster = make_cluster(num_gpus=8)
    pricer = PartPricer(vlm, cluster)
    # 6 samples of one image: 2 micro-batches of 3 images over 4 pipeline ranks. Whole images: the
    # fullest rank group takes 1 image of each micro-batch, 2 in all (8 image slots for 6 images).
    task = TaskSpec(name="t", modalities=("image", "text"), batch=6, images_per_sample=1, text_tokens=96)
    plan = search(vlm.llm, cluster, Workload(global_batch=6, seq_len=task.llm_seq_len(vlm)),
                  SearchOptions(pp=4, schedules=("1f1b",), allow_offload=False, allow_ulysses=False))
    m = plan.num_micro_batches
    res = optimus_schedule(pricer, task, plan)
    assert res.encoder.samples == m * math.ceil(6 / (m * 4))
    work = sum(p.end - p.start for p in res.pieces if p.kind in ("EF", "EB"))
    assert work == pytest.approx(_pass_work(res, task), rel=1e-6)
    # Whole images: every micro-batch's images are all placed, on ranks that hold whole images.
    assert [sum(row[j] for row in res.counts) for j in range(m)] == [6 // m + (j < 6 % m) for j in range(m)]
    base = extra_stage_baseline(pricer, task, plan)
    assert 0 < base.peak_bytes <= usable_memory(cluster)


def test_one_task_picks_the_fastest_plan_kind():
    from tessera.adapt.optimus import compare
    from tessera.adapt.vlm_choice import choose
    from tessera.spec.tasks import MultiTaskWorkload
    vlm = resolve_vlm("tiny-vlm")
    pricer = PartPricer(vlm, make_cluster(num_gpus=16))
    task = TaskSpec(name="t", modalities=("image", "text"), batch=16, images_per_sample=2, text_tokens=64)
    choice = choose(pricer, MultiTaskWorkload(tasks=(task,)), 16, degrees=(2, 4))
    by_kind = {k.kind: k.step_s for k in choice.kinds}
    flat = plan_vlm_task(pricer, task, 16)
    opt, base = compare(pricer, task, 16, (2, 4))
    # compare skips pipeline plans whose LLM step alone is no faster than its best Optimus step:
    # the best is still the best over every plan.
    from tessera.adapt.optimus import extra_stage_baseline, llm_pipeline_plans
    plans = llm_pipeline_plans(pricer, task, 16, (2, 4))
    # Per pipeline degree the fastest LLM plan and the fastest with a node's widest TP (once when
    # they are the same plan); both Optimus and the baseline are the best over all of them.
    assert {p.pipeline.degree for p in plans} == {2, 4}
    assert len({(p.pipeline.degree, p.layers[1].tp, p.num_micro_batches) for p in plans}) == len(plans)
    assert all(sum(p.pipeline.degree == pp for p in plans) in (1, 2) for pp in (2, 4))
    # The best plan's placement is then refined (per-rank recompute, moves, the MILP): no slower.
    unrefined = {id(p): optimus_schedule(pricer, task, p).step_s for p in plans}
    best_plan = min(plans, key=lambda p: unrefined[id(p)])
    assert opt.llm_plan.layers == best_plan.layers and opt.num_micro_batches == best_plan.num_micro_batches
    assert opt.step_s <= unrefined[id(best_plan)]
    assert opt.step_s == optimus_schedule(pricer, task, best_plan, refined=True).step_s
    assert base.step_s == min(extra_stage_baseline(pricer, task, p).step_s for p in plans)
    assert by_kind == {f"no pipeline ({flat.placement})": flat.step_s, "Optimus": opt.step_s,
                       "encoder as extra pipeline stages": base.step_s}
    assert choice.best.step_s == min(by_kind.values())
    assert choice.why().startswith(f"{choice.best.kind} is the fastest of the 3 plan kinds priced")
    forced = choose(pricer, MultiTaskWorkload(tasks=(task,)), 16, encoder_gpus=16)
    assert [k.kind for k in forced.kinds] == ["no pipeline (colocated)"]
    assert forced.skipped == (("pipeline kinds", "--encoder-gpus 16 fixes the placement"),)


def test_optimus_recomputes_fewer_encoder_blocks_where_a_pipeline_rank_has_room():
    """ViT-6B + a 70B LLM at pp8 (12 tiles a sample, benchmarks/multimodal.py's case): 1F1B's later
    stages hold fewer LLM micro-batches, so refined Optimus gives their encoder replicas fewer
    blocks to recompute; every rank's LLM stage + encoder replica + its images' activations fit
    its memory, the pass times are each rank's own plan's, and the runtime gets each rank's blocks."""
    from tessera.adapt.optimus import _encoder_bytes, encoder_pass_times, llm_pipeline_plans
    from tessera.cost.evaluate import usable_memory
    from tessera.adapt.optimus import recomputed_blocks
    from tessera.runtime.multimodal import from_optimus
    vlm = resolve_vlm("vit6b-llama3-70b")
    pricer = PartPricer(vlm, make_cluster(num_gpus=512))
    task = TaskSpec(name="hires12", modalities=("image", "text"), batch=256, images_per_sample=12,
                    text_tokens=4096 - 12 * vlm.image_tokens)
    plan = next(p for p in llm_pipeline_plans(pricer, task, 512, degrees=(8,)) if p.num_micro_batches == 16)
    res = optimus_schedule(pricer, task, plan, refined=True)
    blocks = [recomputed_blocks(res.rank_encoder(r).plan) for r in range(8)]
    full = len(recomputed_blocks(res.encoder.plan))
    assert full == vlm.config.encoder_layers_run and min(map(len, blocks)) < full
    peaks = [plan.prediction.stage_memory[r].total for r in range(8)]
    assert peaks[-1] < peaks[0]  # the last stage holds one LLM micro-batch, the first eight
    for r, images in enumerate(res.counts):
        assert _encoder_bytes(plan, res.rank_encoder(r), r, sum(images))[0] <= usable_memory(plan.cluster)
        assert res.problem.f[r] == encoder_pass_times(res.rank_encoder(r).plan, max(res.problem.images))[0]
    again = price(res.problem.windows, res.counts, res.problem.f, res.problem.b)
    assert again.shift_s + again.extension_s == pytest.approx(res.shift_s + res.extension_s)
    _, strategy = from_optimus(res, 512)
    assert strategy.recompute_blocks == tuple(blocks) and strategy.recompute


def test_optimus_calls_meanwhile_once_whatever_it_returns():
    """`compare` prices its baselines in `meanwhile` while the MILPs run: it is called exactly once,
    with or without a MILP, and when no placement can beat `beat`."""
    vlm = resolve_vlm("tiny-vlm")
    pricer = PartPricer(vlm, make_cluster(num_gpus=16))
    task = TaskSpec(name="t", modalities=("image", "text"), batch=16, images_per_sample=2, text_tokens=64)
    from tessera.adapt.optimus import llm_pipeline_plans
    plan = llm_pipeline_plans(pricer, task, 16, (2,))[0]
    for kw in (dict(refined=True), dict(refined=False), dict(refined=True, beat=1e-9)):
        calls = []
        res = optimus_schedule(pricer, task, plan, meanwhile=lambda: calls.append(1), **kw)
        assert len(calls) == 1 and (res is None) == ("beat" in kw)
