"""Report tables and pictures of a plan: grouping, numbers, files, and the timeline vs the simulator."""
import re

import pytest
from rich.console import Console

from tessera.plan import LayerStrategy, MemoryBreakdown, PipelineSpec, Plan, Prediction, SearchInfo
from tessera.report.tables import (comparison_table, describe_group, fmt_bytes, layer_groups,
                                   memory_table, plan_fits, render_plan)
from tessera.spec import Workload
from tessera.spec.presets import get_model, make_cluster

GiB = 2**30


def hand_plan(activations_gib=(30.0, 20.0), step_time=3.2, name="tessera") -> Plan:
    """LLaMA-2 7B on 64 H100s, two pipeline stages; embedding and head run pure dp32."""
    model = get_model("llama2-7b")
    n = len(model.layers)
    edge = LayerStrategy(dp=32, zero=1)
    block = LayerStrategy(dp=8, tp=4, sp="megatron", zero=1, recompute="selective")
    mems = tuple(MemoryBreakdown(params=5 * GiB, grads=5 * GiB, optimizer=3 * GiB,
                                 activations=a * GiB, buffers=4 * GiB) for a in activations_gib)
    workload = Workload(global_batch=512, seq_len=4096)
    return Plan(
        name=name, model=model, cluster=make_cluster("h100-80gb", 64, 8), workload=workload,
        micro_batch_size=1, num_micro_batches=16,
        pipeline=PipelineSpec(degree=2, stages=((0, 17), (17, n))),
        layers=(edge,) + (block,) * (n - 2) + (edge,),
        prediction=Prediction(step_time_s=step_time, tokens_per_s=workload.tokens_per_step / step_time,
                              mfu=0.45, stage_memory=mems, compute_s=2.5, exposed_comm_s=0.3, bubble_s=0.4,
                              fits=max(m.total for m in mems) <= 80 * GiB),
        search=SearchInfo(search_time_s=0.8, candidates=1234, explanation=("pp2 beats pp1 by 12%",)),
    )


def render(renderable) -> str:
    console = Console(width=160, record=True, file=open("/dev/null", "w"))
    console.print(renderable)
    return console.export_text()


def test_layer_groups_join_identical_neighbours_within_a_stage():
    plan = hand_plan()
    groups = layer_groups(plan)
    assert [(g.chunk, g.first, g.last) for g in groups] == [(0, 0, 0), (0, 1, 16), (1, 17, 32), (1, 33, 33)]
    assert describe_group(plan, groups[1]) == "layers 1-16 (16 decoder): dp8 tp4+sp zero1 rc:selective"
    assert describe_group(plan, groups[3]) == "layer 33 (lm_head): dp32 zero1"
    assert sum(g.count for g in groups) == len(plan.model.layers)


def test_plan_report_shows_header_prediction_memory_and_explanation():
    plan = hand_plan()
    console = Console(width=160, record=True, file=open("/dev/null", "w"))
    render_plan(plan, console)
    text = console.export_text()
    assert "llama2-7b: 6.74B parameters, 32 blocks" in text
    assert "8 nodes x 8 h100-80gb = 64 GPUs" in text
    assert "global batch 512 x 4096 tokens" in text
    assert "3.20 s" in text and "45.0%" in text and "655k tokens/s" in text
    assert "pp2 beats pp1 by 12%" in text and "1,234 candidates" in text
    # Stage 0's row: 5 + 5 + 3 + 30 + 4 = 47 GiB of 80 GiB.
    row0 = next(line for line in text.splitlines() if "47.0 GiB" in line)
    assert "30.0 GiB" in row0 and "59%" in row0
    assert "does not fit" not in text


def test_memory_over_the_device_is_flagged():
    plan = hand_plan(activations_gib=(70.0, 20.0))
    assert plan_fits(plan) is False
    console = Console(width=160, record=True, file=open("/dev/null", "w"))
    render_plan(plan, console)
    assert f"does not fit: needs {fmt_bytes(87 * GiB)} per GPU" in console.export_text()
    assert "109%" in render(memory_table(plan))


def test_comparison_speedup_is_baseline_time_over_plan_time():
    plan = hand_plan(step_time=2.0)
    slow = hand_plan(step_time=3.0, name="megatron")
    oom = hand_plan(step_time=1.0, activations_gib=(90.0, 20.0), name="fsdp")
    text = render(comparison_table(plan, [slow, oom]))
    rows = {line.split()[1]: line for line in text.splitlines() if re.match(r"^. (tessera|megatron|fsdp) ", line)}
    assert "1.00x" in rows["tessera"] and "1.50x" in rows["megatron"] and "0.50x" in rows["fsdp"]
    assert " no " in rows["fsdp"] and " yes " in rows["megatron"]


def test_memory_plot_writes_png_and_svg(tmp_path):
    from tessera.report.plots import plot_memory

    paths = plot_memory(hand_plan(), tmp_path / "p.memory")
    assert [p.suffix for p in paths] == [".png", ".svg"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[0].stat().st_size > 10_000
    svg = paths[1].read_text()
    assert "device 80 GiB" in svg and "activations" in svg


@pytest.mark.parametrize("schedule, virtual", [("interleaved_1f1b", 2), ("zero_bubble", 1)])
def test_timeline_draws_every_simulated_event_and_the_bubble(tmp_path, schedule, virtual):
    from tessera.cost.evaluate import simulate_plan
    from tessera.report.plots import idle_intervals, plot_timeline
    from tessera.search import manual_plan

    plan = manual_plan(get_model("llama2-7b"), make_cluster("h100-80gb", 16, 8),
                       Workload(global_batch=8, seq_len=2048), tp=4, pp=4, schedule=schedule,
                       virtual_stages=virtual)
    result, tails = simulate_plan(plan)
    drawing = plot_timeline(result.events, 4, tmp_path / "t", p2p=1e-4, tails=tails)
    assert drawing.event_boxes == len(result.events)
    svg = (tmp_path / "t.svg").read_text()
    assert svg.count('id="event-') == len(result.events)
    assert svg.count('id="bubble-') == drawing.bubble_boxes > 0
    assert svg.count('id="tail-') == sum(t > 0 for t in tails)
    kinds = {e.kind for e in result.events}
    assert kinds == ({"F", "B", "W"} if schedule == "zero_bubble" else {"F", "B"})
    # The grey boxes are exactly the idle time: on the busiest rank, the simulator's bubble.
    busiest = max(range(4), key=lambda r: result.busy[r])
    idle = sum(stop - start for stage, start, stop in idle_intervals(result.events, 4, result.step_time)
               if stage == busiest)
    assert idle / result.step_time == pytest.approx(result.bubble_fraction, rel=1e-6, abs=1e-9)
    assert (tmp_path / "t.png").stat().st_size > 20_000
