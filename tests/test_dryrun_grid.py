"""Every plan the search emits runs (expert parallelism apart): searched plans of tiny and real
models on fake worlds of 8 to 1,024 ranks go through the dry run, first and last rank.

Tiny models run a full training step (fake tensors); real ones are built and have the plan
applied (the step of a 7B-175B model on fake tensors takes 5-60 s a rank here, and the
benchmark `benchmarks/plan_vs_runtime.py` runs those). llama3-405b on 16,384 ranks is left to
the benchmark: its searched zero-bubble schedule of 1,024 micro-batches takes torch about 45 s
to build.

`KNOWN_GAPS` are searched plans the runtime refuses today, each with its one-line reason; the
test fails when one of them starts to run (remove it then) or when any other plan fails.
"""
from __future__ import annotations

import pytest

from tessera.search import SearchOptions, search
from tessera.spec import Workload
from tessera.spec.presets import get_model, make_cluster

pytest.importorskip("torch")

from tessera.runtime.dryrun.run import dry_run  # noqa: E402

GRID = [  # (model, GPUs, global batch, sequence length, run a step)
    ("tiny-llama", 8, 16, 256, True),
    ("tiny-llama", 64, 64, 256, True),
    ("tiny-gpt2", 8, 16, 256, True),
    ("llama2-7b", 64, 64, 4096, False),
    ("qwen2.5-7b", 64, 64, 4096, False),
    ("mixtral-8x7b", 64, 64, 4096, False),  # expert parallelism off: max_ep=1
    ("llama3-70b", 256, 256, 8192, False),
    ("gpt3-175b", 1024, 1024, 2048, False),
]

KNOWN_GAPS: dict[tuple[str, int], str] = {}  # (model, GPUs) -> the runtime's refusal (none today)


@pytest.mark.parametrize("name,gpus,batch,seq,step", GRID, ids=[f"{g[0]}-{g[1]}" for g in GRID])
def test_searched_plan_runs(name, gpus, batch, seq, step):
    plan = search(get_model(name), make_cluster("h100-80gb", gpus), Workload(global_batch=batch, seq_len=seq),
                  SearchOptions(max_ep=1))
    gap = KNOWN_GAPS.get((name, gpus))
    if gap is not None:
        with pytest.raises(Exception, match=gap):
            dry_run(plan, materialize=False, step=step)
        return
    result = dry_run(plan, materialize=False, step=step)
    assert [r.comparison.rank for r in result.ranks] == [0, gpus - 1]
    for r in result.ranks:
        assert r.measurement.device.optimizer > 0  # the plan applied: sharded fp32 weights exist
        if step:
            assert r.measurement.device.grads > 0 and r.measurement.collectives
