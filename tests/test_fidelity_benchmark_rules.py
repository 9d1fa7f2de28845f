"""`benchmarks/cost_model_fidelity.py` validates only plans its model profile did not see: no
profiled sequence length, and on the profiled world size no block run the way the profile ran it
(tensor parallel, Ulysses, ZeRO-3 over the pair). Its own plan list keeps to that."""
import importlib.util
import sys
from pathlib import Path

import pytest

from tessera.search.baselines import manual_plan
from tessera.spec.model import ModelSpec
from tessera.spec.presets.clusters import local_cpu_cluster
from tessera.spec.workload import Workload

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("cost_model_fidelity", ROOT / "benchmarks" / "cost_model_fidelity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("cost_model_fidelity", None)


def test_every_benchmark_plan_is_unseen_and_runnable(bench):
    from tessera.runtime.parallelize import check_plan_supported

    model = ModelSpec.from_config(bench.MODEL)
    for sizes in (bench.PROFILE_SIZES, bench.QUICK_PROFILE_SIZES):
        for world, plans in bench.PLANS.items():
            for name, kwargs in plans.items():
                plan = manual_plan(model, local_cpu_cluster(world), bench.WORKLOAD, name=name, **kwargs)
                bench.check_unseen(plan, 2, sizes)
                check_plan_supported(plan, world, pipeline_available=True)
    assert all(set(names) <= set(bench.PLANS[w]) for w, names in bench.QUICK_PLANS.items())


def test_seen_plans_are_refused(bench):
    model = ModelSpec.from_config(bench.MODEL)
    seen_degree = manual_plan(model, local_cpu_cluster(2), bench.WORKLOAD, name="tp2", tp=2, micro_batch_size=2)
    with pytest.raises(SystemExit, match="tp2: .* at 2 ranks is what the model profile measured"):
        bench.check_unseen(seen_degree, 2, bench.PROFILE_SIZES)
    seen_shape = manual_plan(model, local_cpu_cluster(2), Workload(global_batch=8, seq_len=256, dtype="fp32"),
                             name="dp2", micro_batch_size=2)
    with pytest.raises(SystemExit, match="sequence length 256 was profiled"):
        bench.check_unseen(seen_shape, 2, bench.PROFILE_SIZES)
