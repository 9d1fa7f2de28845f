"""Spindle wave packing against brute force, the wave and Optimus simulators' sanity, bad input."""
import itertools
import math

import numpy as np
import pytest

from tessera.adapt.optimus import _capacity_before, _fill, _idle_intervals, optimus_schedule
from tessera.adapt.spindle import Operator, pack_waves, plan_spindle, sequential_baseline
from tessera.errors import TesseraError
from tessera.search.multimodal import PartPricer, plan_vlm_task
from tessera.spec.multimodal import resolve_vlm
from tessera.spec.presets.clusters import make_cluster
from tessera.spec.tasks import TaskSpec, load_tasks, parse_tasks


def _brute_force(ops, sizes, fwd, bwd, total):
    """Every ordered sequence of waves (sets of ready operators) and every allocation of each."""
    n = len(ops)
    best = math.inf

    def rec(done, acc):
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
                    if math.isfinite(f + b):
                        rec(done | sum(1 << o for o in members), acc + f + b)

    rec(0, 0.0)
    return best


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


def test_optimus_fill_is_exact_and_respects_dependencies():
    from tessera.cost.schedule import simulate
    sim = simulate("1f1b", [1.0] * 4, [2.0] * 4, 4, 4)
    gaps = _idle_intervals(sim.events, 4, sim.step_time)
    idle = sum(e - s for rank in gaps for s, e in rank)
    assert idle == pytest.approx(4 * sim.step_time - sum(sim.busy))
    deadline = sim.step_time / 2
    cap = _capacity_before(gaps, deadline)
    pieces = _fill([list(r) for r in gaps], [(cap / 2, deadline), (cap / 2, deadline)], "EF", forward=True)
    assert sum(p.end - p.start for p in pieces) == pytest.approx(cap)
    assert max(p.end for p in pieces) <= deadline + 1e-12
    for r in range(4):  # no encoder piece overlaps an LLM operation on its rank
        busy = [(e.start, e.end) for e in sim.events if e.stage == r]
        for p in pieces:
            if p.rank == r:
                assert all(p.end <= s + 1e-12 or p.start >= e - 1e-12 for s, e in busy)


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
    assert work == pytest.approx(plan.pipeline.degree * (res.encoder.fwd_s + res.encoder.bwd_s), rel=1e-6)
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
    assert main(["show", str(out)]) == 0
    assert (tmp_path / "plan-waves.svg").is_file()
    tasks.write_text("tasks:\n  - {name: s, modalities: [audio], batch: 4, text_tokens: 8}\n")
    assert main(["plan", "--model", "tiny-vlm", "--gpus", "16", "--tasks", str(tasks)]) != 0
    assert "unknown modality 'audio'" in capsys.readouterr().err
