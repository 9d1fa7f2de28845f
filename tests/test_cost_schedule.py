"""The pipeline simulator against the closed forms it must reproduce, and its dependencies."""
import pytest

from tessera.cost.schedule import in_flight, simulate

F, B = 1.0, 2.0


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16), (8, 8)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_equal_stages_bubble_is_p_minus_1_over_m_plus_p_minus_1(schedule, pp, m):
    r = simulate(schedule, [F] * pp, [B] * pp, m, pp)
    assert r.step_time == pytest.approx((m + pp - 1) * (F + B))
    assert r.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))


@pytest.mark.parametrize("v", [2, 4])
def test_interleaving_divides_the_bubble_by_v(v):
    pp, m = 4, 8
    plain = simulate("1f1b", [F] * pp, [B] * pp, m, pp)
    inter = simulate("interleaved_1f1b", [F / v] * (pp * v), [B / v] * (pp * v), m, pp, v)
    bubble_plain = plain.step_time - m * (F + B)
    bubble_inter = inter.step_time - m * (F + B)
    assert bubble_inter == pytest.approx(bubble_plain / v)


def test_zero_bubble_beats_1f1b_and_keeps_its_peak_memory():
    pp, m = 4, 8
    one = simulate("1f1b", [F] * pp, [B] * pp, m, pp)
    zb = simulate("zero_bubble", [F] * pp, [B] * pp, m, pp, wgrad=[B / 2] * pp)
    assert zb.step_time < one.step_time
    assert max(zb.peak_in_flight) <= max(one.peak_in_flight)
    # Every F, B and W of every micro-batch runs exactly once.
    assert sorted((e.stage, e.kind, e.micro_batch) for e in zb.events) == sorted(
        (s, k, i) for s in range(pp) for k in "FBW" for i in range(m))


@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1)])
def test_simulated_peak_in_flight_matches_the_closed_form(schedule, v):
    pp, m = 4, 8
    r = simulate(schedule, [F / v] * (pp * v), [B / v] * (pp * v), m, pp, v)
    for rank in range(pp):
        bound = in_flight(schedule, pp, rank, m, v) * v
        if schedule == "zero_bubble":
            assert r.peak_in_flight[rank] <= bound
        else:
            assert r.peak_in_flight[rank] == bound


@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1)])
def test_events_honour_dependencies_and_one_op_per_rank(schedule, v):
    pp, m, hop = 3, 6, 0.25
    fwd = [0.5 + 0.1 * c for c in range(pp * v)]
    bwd = [1.0 + 0.2 * c for c in range(pp * v)]
    if schedule == "interleaved_1f1b":
        m = 6  # multiple of pp
    r = simulate(schedule, fwd, bwd, m, pp, v, p2p=hop)
    end = {(e.kind, e.micro_batch, e.chunk): e.end for e in r.events}
    last = pp * v - 1
    for e in r.events:
        if e.kind == "F" and e.chunk > 0:
            assert e.start >= end[("F", e.micro_batch, e.chunk - 1)] + hop - 1e-12
        if e.kind == "B":
            dep = end[("F", e.micro_batch, last)] if e.chunk == last else end[("B", e.micro_batch, e.chunk + 1)] + hop
            assert e.start >= dep - 1e-12
        if e.kind == "W":
            assert e.start >= end[("B", e.micro_batch, e.chunk)] - 1e-12
    for rank in range(pp):
        spans = sorted((e.start, e.end) for e in r.events if e.stage == rank)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))


def test_single_micro_batch_pays_every_hop():
    r = simulate("1f1b", [1.0, 2.0], [3.0, 4.0], 1, 2, p2p=0.5)
    assert r.step_time == pytest.approx(1 + 0.5 + 2 + 4 + 0.5 + 3)


def test_bad_input_is_refused_in_one_sentence():
    with pytest.raises(ValueError, match="multiple of pp"):
        simulate("interleaved_1f1b", [1.0] * 8, [2.0] * 8, 6, 4, 2)
    with pytest.raises(ValueError, match="unknown schedule"):
        simulate("pipedream", [1.0], [2.0], 1, 1)


def _events_peak(events, pp, release):
    """Activations held at once per rank, counted from the events (release before acquire)."""
    peaks = []
    for r in range(pp):
        marks = sorted((e.start, 1, 1) if e.kind == "F" else (e.end, 0, -1)
                       for e in events if e.stage == r and e.kind in ("F", release))
        level = peak = 0
        for _, _, delta in marks:
            level += delta
            peak = max(peak, level)
        peaks.append(peak)
    return tuple(peaks)


def test_step_time_without_events_equals_the_full_simulation(monkeypatch):
    """The closed form (GPipe) and the certified extension of a shorter simulation (the others)
    give the makespan of the full event simulation, and the peak activation counts agree."""
    import random

    from tessera.cost import schedule

    extended = []
    real = schedule._extension
    monkeypatch.setattr(schedule, "_extension", lambda *a: extended.append(real(*a)) or extended[-1])
    rng = random.Random(7)
    for _ in range(120):
        name = rng.choice(["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"])
        pp = rng.choice([2, 3, 4, 6])
        v = rng.choice([2, 3]) if name == "interleaved_1f1b" else 1
        m = pp * rng.choice([1, 3, 8, 11]) if v > 1 else rng.choice([1, 3, 7, 30, 61])
        equal = rng.random() < 0.4
        fwd = [1.0 if equal else rng.uniform(0.2, 2.0) for _ in range(pp * v)]
        bwd = [2.0 if equal else rng.uniform(0.4, 4.0) for _ in range(pp * v)]
        wgrad = [b * rng.uniform(0.2, 0.8) for b in bwd]
        r = simulate(name, fwd, bwd, m, pp, v, p2p=rng.choice([0.0, 0.05, 0.4]), wgrad=wgrad)
        assert r.step_time == pytest.approx(max(e.end for e in r.events), rel=1e-9)
        assert r.peak_in_flight == _events_peak(r.events, pp, "W" if name == "zero_bubble" else "B")
        assert r.busy == pytest.approx([sum(e.end - e.start for e in r.events if e.stage == k) for k in range(pp)])
    assert sum(x is not None for x in extended) >= 20  # the extension did the work, not the fallback


def test_a_large_pipeline_is_simulated_quickly_and_exactly():
    import time

    pp, m = 64, 1024
    fwd = [1.3] + [1.0] * (pp - 2) + [1.6]
    t0 = time.process_time()
    r = simulate("1f1b", fwd, [2.0] * pp, m, pp, p2p=0.01)
    assert time.process_time() - t0 < 5.0  # the full simulation of 131,072 events takes longer
    # The slowest stage sets the pace; the first micro-batch fills, the last one drains.
    assert r.step_time == pytest.approx(max(e.end for e in r.events), rel=1e-9)


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1)])
def test_orders_are_those_torch_runs(schedule, v):
    """The simulated order of each rank is the one torch.distributed.pipelining's schedule builds
    (the runtime runs that schedule for the plan)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    from tessera.cost.schedule import _rank_order

    build = getattr(schedules, "_get_1f1b_rank_ops", None)
    warmup = getattr(schedules, "_get_warmup_ops", None)
    if build is None or warmup is None:
        pytest.skip("this torch builds its schedules differently")
    kinds = {schedules._ComputationType.FORWARD: 0, schedules._ComputationType.FULL_BACKWARD: 1,
             schedules._ComputationType.BACKWARD_INPUT: 1, schedules._ComputationType.BACKWARD_WEIGHT: 2}
    zb = schedule == "zero_bubble"
    for pp in (2, 3, 4):
        for m in ([1, 2, 3, 5, 8] if v == 1 else [pp, 2 * pp, 3 * pp]):
            for r in range(pp):
                per_round = m // max(1, m // pp)
                warm = warmup(r, v, per_round, pp, m, multiply_factor=1 if zb else 2)
                fwd_index = lambda k: ((k // per_round) % v) * pp + r  # noqa: E731
                bwd_index = lambda k: (v - 1 - ((k - warm) // per_round) % v) * pp + r  # noqa: E731
                if schedule == "1f1b":  # Schedule1F1B: the same warm-up, one chunk
                    ops = build(1, pp, min(pp - r - 1, m), m - min(pp - r - 1, m), min(pp - r - 1, m), r,
                                lambda k: r, lambda k: r)
                else:
                    ops = build(v, pp, warm, v * m - warm, warm, r, fwd_index, bwd_index,
                                r if zb else 0, enable_zero_bubble=zb)
                theirs = [(kinds[a.computation_type], a.microbatch_index, a.stage_index) for a in ops if a]
                assert _rank_order(schedule, pp, m, v, r) == theirs, (pp, m, r)
