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
