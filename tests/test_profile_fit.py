"""Torch-free profile pieces: the least-squares fits, applying profiles, refusing the wrong ones."""
import json

import numpy as np
import pytest

from tessera.errors import TesseraError
from tessera.profile.apply import apply_model_profile, load_cluster_profile, load_model_profile, write_atomic
from tessera.profile.fit import (LayerMeasurement, ModelProfile, fit_activation_bytes, fit_layer_kind,
                                 fit_time_model)
from tessera.spec.model import LayerKind
from tessera.spec.presets import get_model, local_cpu_cluster


def test_fit_recovers_known_coefficients_from_noisy_timings():
    rng = np.random.default_rng(0)
    sizes = [(b, s) for b in (1, 2, 4) for s in (64, 128, 256, 512)]
    lin = np.array([b * s * 1.5e6 for b, s in sizes])
    att = np.array([b * s * s * 512.0 for b, s in sizes])
    a, b, c = 2.0e-11, 7.0e-11, 3e-4
    t = (a * lin + b * att + c) * (1 + 0.01 * rng.standard_normal(len(sizes)))
    fit = fit_time_model(lin, att, t, intercept=True)
    assert fit.a == pytest.approx(a, rel=0.05) and fit.b == pytest.approx(b, rel=0.1)
    assert fit.c == pytest.approx(c, rel=0.3) and fit.r2 > 0.99
    exact = fit_time_model(lin, att, a * lin + b * att)
    assert exact.a == pytest.approx(a, rel=1e-6) and exact.b == pytest.approx(b, rel=1e-6)
    assert exact.max_rel_err < 1e-6


def test_layer_scales_are_relative_to_the_reference_rate():
    layer = get_model("tiny-llama").layers[1]
    rate, s_lin, s_att = 50e9, 1.7, 4.0
    ms = []
    for b, s in [(1, 64), (2, 64), (1, 128), (4, 64), (2, 128), (1, 256)]:
        lin, att = b * s * layer.flops_per_token, b * s * layer.attn_flops_coeff * s
        fwd = (lin * s_lin + att * s_att) / rate  # the cost model's forward, backward = 2x
        ms.append(LayerMeasurement(batch=b, seq_len=s, forward_s=fwd, backward_s=2 * fwd,
                                   activation_bytes=123.0 * b * s, linear_flops=lin, attn_flops=att))
    kp = fit_layer_kind(layer.kind, layer.name, layer.params, layer.flops_per_token, layer.attn_flops_coeff, ms, rate)
    assert kp.linear_time_scale == pytest.approx(s_lin, rel=1e-6)
    assert kp.attn_time_scale == pytest.approx(s_att, rel=1e-6)
    assert kp.activation_bytes_per_token == pytest.approx(123.0) and kp.backward_over_forward == pytest.approx(2.0)


def test_inseparable_terms_fall_back_to_one_common_scale():
    # Every size has the same seq: the attention term cannot be told apart from the linear one.
    lin = [100.0, 200.0, 400.0]
    att = [10.0, 20.0, 40.0]
    ms = [LayerMeasurement(batch=b, seq_len=64, forward_s=1e-9 * (l + a), backward_s=2e-9 * (l + a),
                           activation_bytes=0.0, linear_flops=l, attn_flops=a)
          for b, l, a in zip((1, 2, 4), lin, att)]
    kp = fit_layer_kind(LayerKind.DECODER, "block0", 1, 1.0, 1.0, ms, reference_flops=1e9)
    assert kp.linear_time_scale == pytest.approx(kp.attn_time_scale) == pytest.approx(1.0)


def test_fit_activation_bytes_and_bad_input():
    k, err = fit_activation_bytes([100, 200, 400], [1000, 2000, 4000])
    assert k == pytest.approx(10.0) and err == pytest.approx(0.0)
    with pytest.raises(ValueError, match="positive"):
        fit_time_model([1.0], [0.0], [0.0])
    with pytest.raises(ValueError, match="as many"):
        fit_time_model([1.0, 2.0], [0.0], [1.0])


def _profile_for(model, linear=2.0, attn=3.0, act_per_token=None, tp_part=None, call=0.0, tp_over=None,
                 sp_over=None, zero3_over=None, tp_slow=None, sp_slow=None):
    kinds = []
    for kind in (LayerKind.EMBEDDING, LayerKind.DECODER, LayerKind.LM_HEAD):
        layer = next(l for l in model.layers if l.kind == kind)
        act = act_per_token if act_per_token is not None else 2 * (layer.act_bytes_tp + layer.act_bytes_replicated) + 8
        m = LayerMeasurement(batch=1, seq_len=64, forward_s=1.0, backward_s=2.0, activation_bytes=act * 64,
                             linear_flops=1.0, attn_flops=0.0)
        kinds.append(dict(kind=kind, layer=layer.name, params=layer.params, flops_per_token=layer.flops_per_token,
                          attn_flops_coeff=layer.attn_flops_coeff, measurements=(m,), linear_time_scale=linear,
                          attn_time_scale=attn, overhead_s=call, fit_r2=1.0, fit_max_rel_err=0.0,
                          activation_bytes_per_token=act, activation_fit_max_rel_err=0.0, backward_over_forward=2.0,
                          activation_bytes_tp_per_token=tp_part if kind == LayerKind.DECODER else None,
                          tp_overhead_s=tp_over if kind == LayerKind.DECODER else None,
                          sp_overhead_s=sp_over if kind == LayerKind.DECODER else None,
                          zero3_overhead_s=zero3_over if kind == LayerKind.DECODER else None,
                          tp_slowdown=tp_slow if kind == LayerKind.DECODER else None,
                          sp_slowdown=sp_slow if kind == LayerKind.DECODER else None))
    return ModelProfile(model=model.name, device="cpu", dtype="fp32", reference_flops=1e10, layers=tuple(kinds))


def test_apply_model_profile_updates_every_layer_of_a_kind(tmp_path):
    model = get_model("tiny-llama")
    path = tmp_path / "mp.json"
    write_atomic(path, _profile_for(model).model_dump_json())
    applied = apply_model_profile(model, path)
    for before, after in zip(model.layers, applied.layers):
        assert (after.linear_time_scale, after.attn_time_scale) == (2.0, 3.0)
        spec = before.act_bytes_tp + before.act_bytes_replicated
        got = after.act_bytes_tp + after.act_bytes_replicated
        assert got == pytest.approx(2 * spec + 8)
        if spec:  # the split (what TP divides) keeps the spec's proportions
            assert after.act_bytes_tp / got == pytest.approx(before.act_bytes_tp / spec)
            # full recompute keeps the block input: hidden fp32 elements per token
            assert after.act_bytes_input == (4.0 * before.hidden if before.act_bytes_input else 0.0)
    assert applied.layers[0].params == model.layers[0].params and applied.name == model.name


def test_a_measured_tp_split_replaces_the_spec_proportions():
    model = get_model("tiny-llama")
    applied = apply_model_profile(model, _profile_for(model, act_per_token=10000.0, tp_part=7000.0))
    block = applied.layers[1]
    assert (block.act_bytes_tp, block.act_bytes_replicated) == (7000.0, 3000.0)
    spec = model.layers[1]
    assert block.act_bytes_selective == pytest.approx(spec.act_bytes_selective * 7000.0 / spec.act_bytes_tp)


def test_tp_split_is_fitted_from_a_whole_block_and_its_tp2_shard():
    layer = get_model("tiny-llama").layers[1]
    ms = [LayerMeasurement(batch=b, seq_len=64, forward_s=1.0, backward_s=2.0, activation_bytes=(3000 + 7000) * b * 64,
                           linear_flops=1.0, attn_flops=0.0) for b in (1, 2, 4)]
    half = [(3000 + 3500) * b * 64 for b in (1, 2, 4)]
    kp = fit_layer_kind(layer.kind, layer.name, layer.params, layer.flops_per_token, layer.attn_flops_coeff, ms,
                        1e9, tp2_activation_bytes=half)
    assert kp.activation_bytes_tp_per_token == pytest.approx(7000.0)


def test_profile_of_another_model_is_refused(tmp_path):
    path = tmp_path / "mp.json"
    write_atomic(path, _profile_for(get_model("tiny-llama")).model_dump_json())
    with pytest.raises(TesseraError, match="measured on model 'tiny-llama', not 'tiny-gpt2'"):
        apply_model_profile(get_model("tiny-gpt2"), path)
    other = get_model("tiny-gpt2").model_copy(update={"name": "tiny-llama"})
    with pytest.raises(TesseraError, match="does not match"):
        apply_model_profile(other, path)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 99}))
    with pytest.raises(TesseraError, match="version 99"):
        load_model_profile(bad)


def test_cluster_profile_of_another_shape_is_refused(tmp_path):
    path = tmp_path / "cluster.json"
    write_atomic(path, local_cpu_cluster(2).model_dump_json())
    assert load_cluster_profile(path, expect_gpus=2).num_gpus == 2
    with pytest.raises(TesseraError, match="measured on 1 node\\(s\\) x 2 device\\(s\\) = 2 devices, not the 4"):
        load_cluster_profile(path, expect_gpus=4)
    with pytest.raises(TesseraError, match="8 devices per node|2 devices per node, not 8"):
        load_cluster_profile(path, expect_gpus_per_node=8)
    (tmp_path / "half.json").write_text('{"name": "x", "num_nodes": 1, ')
    with pytest.raises(TesseraError, match="not valid JSON"):
        load_cluster_profile(tmp_path / "half.json")


def test_write_atomic_keeps_the_old_file_when_interrupted(tmp_path, monkeypatch):
    path = tmp_path / "cluster.json"
    path.write_text("old")

    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr("os.replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, "new " * 1000)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["cluster.json"]


def test_call_and_parallel_overheads_are_fitted_and_applied():
    layer = get_model("tiny-llama").layers[1]
    rate, s_lin, s_att, c = 50e9, 1.7, 4.0, 3e-3
    extra = {"tp2": 8e-3, "sp2": 5e-3, "zero3": 2e-3}
    slow = {"tp2": 0.3, "sp2": 0.0, "zero3": 0.0}
    ms, variants = [], {v: ([], []) for v in extra}
    for b, s in [(1, 64), (2, 64), (1, 128), (4, 64), (2, 128), (1, 256)]:
        lin, att = b * s * layer.flops_per_token, b * s * layer.attn_flops_coeff * s
        total = 3 * (lin * s_lin + att * s_att) / rate + c
        ms.append(LayerMeasurement(batch=b, seq_len=s, forward_s=total / 3, backward_s=2 * total / 3,
                                   activation_bytes=100.0 * b * s, linear_flops=lin, attn_flops=att))
        x = 1e-4 * b * s / 64  # the variant's collectives, timed alone
        for v, (seconds, comm) in variants.items():
            comm.append(x)
            # tp2 / sp2 halve the compute with the collectives exposed; zero3 keeps it all plus the gathers.
            # tp2's share of the compute also runs `slow` slower than half.
            seconds.append((total + x if v == "zero3" else c + (1 + slow[v]) * (total - c) / 2 + x) + extra[v])
    kp = fit_layer_kind(layer.kind, layer.name, layer.params, layer.flops_per_token, layer.attn_flops_coeff, ms,
                        rate, variants=variants)
    assert kp.overhead_s == pytest.approx(c, rel=1e-4)
    assert kp.linear_time_scale == pytest.approx(s_lin, rel=1e-4) and kp.attn_time_scale == pytest.approx(s_att, rel=1e-4)
    assert kp.tp_overhead_s == pytest.approx(extra["tp2"], rel=1e-3)
    assert kp.sp_overhead_s == pytest.approx(extra["sp2"], rel=1e-3)
    assert (kp.tp_slowdown, kp.sp_slowdown) == pytest.approx((0.3, 0.0), abs=1e-6)
    assert kp.zero3_overhead_s == pytest.approx(extra["zero3"], rel=1e-3)
    assert kp.zero3_seconds == tuple(variants["zero3"][0])
    # Without variant timings (one rank) there are no overheads; faster than expected floors at 0.
    alone = fit_layer_kind(layer.kind, layer.name, layer.params, layer.flops_per_token, layer.attn_flops_coeff,
                           ms, rate)
    assert (alone.tp_overhead_s, alone.sp_overhead_s, alone.zero3_overhead_s) == (None, None, None)
    fast = fit_layer_kind(layer.kind, layer.name, layer.params, layer.flops_per_token, layer.attn_flops_coeff,
                          ms, rate, variants={"tp2": ([t / 4 for t in variants["tp2"][0]], variants["tp2"][1])})
    assert fast.tp_overhead_s == 0.0 and fast.sp_overhead_s is None
    # tp2 and sp2 timed in a chain are set against the chain's one-rank time, zero3 against the
    # single block's: a chain 20% slower per block than measured alone leaves their overheads as
    # they were once the variants' times carry the same slowdown.
    chain = [1.2 * (m.forward_s + m.backward_s) for m in ms]
    chained = {v: ([t + (0.0 if v == "zero3" else (1 + slow[v]) * (r - m.forward_s - m.backward_s) / 2)
                    for t, r, m in zip(seconds, chain, ms)], comm) for v, (seconds, comm) in variants.items()}
    kc = fit_layer_kind(layer.kind, layer.name, layer.params, layer.flops_per_token, layer.attn_flops_coeff, ms,
                        rate, variants=chained, chain_reference=chain)
    assert (kc.tp_overhead_s, kc.sp_overhead_s, kc.zero3_overhead_s, kc.tp_slowdown) == pytest.approx(
        (extra["tp2"], extra["sp2"], extra["zero3"], slow["tp2"]), rel=1e-3)
    assert kc.chain_reference_seconds == tuple(chain)
    with pytest.raises(ValueError, match="chained reference timings must be given for every measured size"):
        fit_layer_kind(layer.kind, layer.name, layer.params, layer.flops_per_token, layer.attn_flops_coeff,
                       ms, rate, variants=variants, chain_reference=chain[:2])
    # One timing 50 ms off moves the robust fit little; an excess that shrinks with size is all fixed.
    odd = list(variants["tp2"][0])
    odd[2] += 0.05
    ko = fit_layer_kind(layer.kind, layer.name, layer.params, layer.flops_per_token, layer.attn_flops_coeff, ms,
                        rate, variants={"tp2": (odd, variants["tp2"][1])})
    assert ko.tp_slowdown == pytest.approx(slow["tp2"], rel=0.05) and ko.tp_overhead_s == pytest.approx(extra["tp2"], abs=2e-3)
    shrinking = [c + (m.forward_s + m.backward_s - c) / 2 + x + 0.02 / (i + 1)
                 for i, (m, x) in enumerate(zip(ms, variants["sp2"][1]))]
    ks = fit_layer_kind(layer.kind, layer.name, layer.params, layer.flops_per_token, layer.attn_flops_coeff, ms,
                        rate, variants={"sp2": (shrinking, variants["sp2"][1])})
    assert ks.sp_slowdown == 0.0 and ks.sp_overhead_s == pytest.approx(float(np.median([0.02 / (i + 1) for i in range(len(ms))])))
    with pytest.raises(ValueError, match="sp2 timings must be given for every measured size"):
        fit_layer_kind(layer.kind, layer.name, layer.params, layer.flops_per_token, layer.attn_flops_coeff,
                       ms, rate, variants={"sp2": ([1.0], [0.1])})

    model = get_model("tiny-llama")
    applied = apply_model_profile(model, _profile_for(model, call=c, tp_over=extra["tp2"], sp_over=extra["sp2"],
                                                      zero3_over=extra["zero3"], tp_slow=0.3, sp_slow=0.1))
    inner = (c, extra["tp2"], extra["sp2"], extra["zero3"], 0.3, 0.1)
    assert [(l.call_overhead_s, l.tp_overhead_s, l.sp_overhead_s, l.zero3_overhead_s, l.tp_slowdown, l.sp_slowdown)
            for l in applied.layers] == ([(c, 0.0, 0.0, 0.0, 0.0, 0.0)] + [inner] * (len(model.layers) - 2)
                                         + [(c, 0.0, 0.0, 0.0, 0.0, 0.0)])


def test_wider_tensor_parallel_is_fitted_at_its_own_degree_and_applied():
    layer = get_model("tiny-llama").layers[1]
    rate, c = 50e9, 3e-3
    terms = {"tp2": (8e-3, 0.3), "tp4": (2e-2, 1.4)}  # overhead, slowdown: tp4's do not follow from tp2's
    ms, variants = [], {v: ([], []) for v in terms}
    for b, s in [(1, 64), (2, 64), (1, 128), (4, 64), (2, 128), (1, 256)]:
        lin, att = b * s * layer.flops_per_token, b * s * layer.attn_flops_coeff * s
        total = 3 * 1.5 * (lin + att) / rate + c
        ms.append(LayerMeasurement(batch=b, seq_len=s, forward_s=total / 3, backward_s=2 * total / 3,
                                   activation_bytes=100.0 * b * s, linear_flops=lin, attn_flops=att))
        for v, (seconds, comm) in variants.items():
            g, (extra, slow) = int(v[2:]), terms[v]
            comm.append(1e-4 * b * s / 64 * (1.5 if g == 4 else 1.0))
            seconds.append(c + (1 + slow) * (total - c) / g + comm[-1] + extra)
    kp = fit_layer_kind(layer.kind, layer.name, layer.params, layer.flops_per_token, layer.attn_flops_coeff, ms,
                        rate, variants=variants)
    assert (kp.tp_overhead_s, kp.tp_slowdown) == pytest.approx(terms["tp2"], rel=1e-3)
    [wide] = kp.tp_wider
    assert wide.degree == 4 and (wide.overhead_s, wide.slowdown) == pytest.approx(terms["tp4"], rel=1e-3)
    assert wide.seconds == tuple(variants["tp4"][0]) and wide.comm_seconds == tuple(variants["tp4"][1])
    model = get_model("tiny-llama")
    profile = _profile_for(model)
    profile = profile.model_copy(update={"layers": (profile.layers[0], kp, profile.layers[2])})
    again = ModelProfile.model_validate_json(profile.model_dump_json())
    applied = apply_model_profile(model, again)
    block, head = applied.layers[1], applied.layers[-1]
    assert block.tp_costs(2) == pytest.approx(terms["tp2"], rel=1e-3)
    assert block.tp_costs(4) == block.tp_costs(8) == pytest.approx(terms["tp4"], rel=1e-3)
    assert head.tp_wider == () and head.tp_costs(4) == (0.0, 0.0)  # not measured wider: tp2's (here none)


def test_head_tensor_parallel_costs_are_fitted_and_reach_only_the_lm_head():
    model = get_model("tiny-llama")
    head = model.layers[-1]
    rate, c, extra, slow = 50e9, 1e-3, 6e-3, 0.5
    ms, tp2, comm = [], [], []
    for b, s in [(1, 64), (2, 64), (1, 128), (4, 64), (2, 128), (1, 256)]:
        lin = b * s * head.flops_per_token
        total = 3 * lin * 1.3 / rate + c
        ms.append(LayerMeasurement(batch=b, seq_len=s, forward_s=total / 3, backward_s=2 * total / 3,
                                   activation_bytes=10.0 * b * s, linear_flops=lin, attn_flops=0.0))
        comm.append(2e-4 * b * s / 64)  # one all-reduce forward, one backward
        # The loss-parallel head: half the compute, `slow` slower, its collectives and a fixed cost.
        tp2.append(c + (1 + slow) * (total - c) / 2 + comm[-1] + extra)
    reference = [m.forward_s + m.backward_s for m in ms]
    kp = fit_layer_kind(head.kind, head.name, head.params, head.flops_per_token, head.attn_flops_coeff, ms, rate,
                        variants={"tp2": (tp2, comm)}, chain_reference=reference)
    assert (kp.tp_overhead_s, kp.tp_slowdown) == pytest.approx((extra, slow), rel=1e-3)
    assert (kp.sp_overhead_s, kp.sp_slowdown, kp.zero3_overhead_s) == (None, None, None)
    profile = _profile_for(model)
    profile = profile.model_copy(update={"layers": profile.layers[:-1] + (kp,)})
    applied = apply_model_profile(model, profile)
    assert [(l.tp_overhead_s, l.tp_slowdown) for l in applied.layers] == (
        [(0.0, 0.0)] * (len(model.layers) - 1) + [pytest.approx((extra, slow), rel=1e-3)])


def test_the_speed_gauge_is_the_first_block_at_its_largest_size_and_refuses_another_model():
    from tessera.profile.results import Gauge, Validation

    model = get_model("tiny-llama")
    profile = _profile_for(model)
    block = profile.layers[1]
    big = block.measurements[0].model_copy(update=dict(batch=2, seq_len=128, forward_s=0.5, backward_s=1.0))
    profile = profile.model_copy(update={"layers": (profile.layers[0], block.model_copy(
        update={"measurements": (block.measurements[0], big)}), profile.layers[2])})
    gauge = Gauge.of(profile, model)
    assert (gauge.kind, gauge.block, gauge.batch, gauge.seq_len, gauge.profiled_s) == ("decoder", 0, 2, 128, 1.5)
    assert gauge.window_s == 0.0 and Gauge.of(profile.model_copy(update={"window_s": 0.5}), model).window_s == 0.5
    with pytest.raises(TesseraError, match="measured on model 'tiny-llama', not 'llama2-7b'"):
        Gauge.of(profile, get_model("llama2-7b"))
    v = Validation(plan="p", world=2, predicted_step_s=1.0, measured_step_s=1.0, step_times=[1.0],
                   predicted_memory=[1.0], gauge_profiled_s=1.5, gauge_s=1.2)
    assert v.speed_ratio == pytest.approx(1.25)
    assert Validation(plan="p", world=2, predicted_step_s=1.0, measured_step_s=1.0, step_times=[1.0],
                      predicted_memory=[1.0]).speed_ratio is None
    # Step by step: a machine that ran at half speed for the first two steps, then at the profile's.
    v = Validation(plan="p", world=2, predicted_step_s=1.0, measured_step_s=1.0, step_times=[2.0, 2.2, 1.0],
                   predicted_memory=[1.0], gauge_profiled_s=1.5, gauge_s=1.5, step_gauge_s=[3.0, 3.0, 1.5])
    assert v.at_profiled_speed() == pytest.approx(1.0)  # median of 1.0, 1.1, 1.0
    assert v.at_profiled_speed(reference_s=3.0) == pytest.approx(2.0)
    assert Validation(plan="p", world=2, predicted_step_s=1.0, measured_step_s=1.0, step_times=[1.0],
                      predicted_memory=[1.0], gauge_profiled_s=1.5, gauge_s=1.2).at_profiled_speed() is None


def test_validate_refuses_a_model_profile_of_another_model_in_one_line(tmp_path, capsys):
    from tessera.cli import main
    from tessera.search import manual_plan
    from tessera.spec import Workload

    model = get_model("tiny-llama")
    plan = tmp_path / "plan.json"
    manual_plan(model, local_cpu_cluster(1), Workload(global_batch=1, seq_len=64, dtype="fp32")).save(plan)
    profile = tmp_path / "mp.json"
    write_atomic(profile, _profile_for(model).model_copy(update={"model": "other-llama"}).model_dump_json())
    assert main(["validate", "--plan", str(plan), "--model-profile", str(profile)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("tessera validate: error: model profile was measured on model 'other-llama', not 'tiny-llama'; "
                   "run `tessera profile model --model tiny-llama`")


def test_timing_statistics_and_an_unknown_one_refused_by_name():
    from tessera.profile.fit import summarize

    # Short timings on a machine whose load comes in bursts: mostly fast, some slow, one stall.
    xs = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 50.0]
    assert summarize(xs, "min") == 1.0 and summarize(xs, "median") == 1.0
    assert summarize(xs, "mean") == pytest.approx(11 / 8)  # the stall and one fast run trimmed
    with pytest.raises(ValueError, match="unknown statistic 'p90'; choose median or min or mean"):
        summarize(xs, "p90")
