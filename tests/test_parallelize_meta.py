"""The build path without processes: PyTorch's fake process group plays one rank of 8.

`parallelize` (and `build_pipeline`) applied to a meta-device model issue no collective and
allocate nothing; `materialize` then gives this rank's shards exactly the values of a one-process
`build_model(config, seed)` (bit for bit), for plans that mix ZeRO stages, HSDP, tensor and
sequence parallelism, pipelines and tied embeddings sharded two ways.
"""
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "dist"))

from runtime_common import GPT2, LLAMA, S, make_plan  # noqa: E402
from tessera.models.transformer import build_model  # noqa: E402
from tessera.runtime.comm_count import count_collectives  # noqa: E402
from tessera.runtime.materialize import EMBEDDING_WEIGHT, HEAD_WEIGHT, canonical_name, full_value_slice, materialize  # noqa: E402
from tessera.runtime.mesh import ParallelDims  # noqa: E402
from tessera.runtime.parallelize import parallelize  # noqa: E402

WORLD, RANK = 8, 5


@pytest.fixture(scope="module")
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=WORLD)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _parts(plan, model, dims):
    """Parallelise `model` for this rank as the trainer does; returns the parallelised parts."""
    if plan.pipeline.degree == 1:
        return [parallelize(model, plan, dims, RANK)]
    from tessera.runtime.pipeline import build_pipeline
    from tessera.runtime.parallelize import ParallelLoss, StageContext

    parts = []

    def chunk_fn(chunk, layers):
        parts.append(parallelize(chunk, plan, dims, RANK, layers))
        return parts[-1]

    build_pipeline(model, plan, dims.mesh, ParallelLoss(StageContext.build(plan, dims, RANK)), chunk_fn)
    return parts


PLANS = {
    "layerwise_zero_tp_sp": (LLAMA, make_plan(LLAMA, 8, [S(dp=4, tp=2), S(dp=4, tp=2, sp="megatron", zero=3),
                                                         S(dp=8, zero=1), S(dp=8, zero=2, dp_shard=4),
                                                         S(dp=4, sp="ulysses", sp_degree=2, zero=3),
                                                         S(dp=8, zero=3, offload=True)])),
    "pp2_zero_bubble_mixed": (LLAMA, make_plan(LLAMA, 8, [S(dp=4, zero=3), S(dp=2, tp=2, sp="megatron", zero=1),
                                                          S(dp=4, zero=2), S(dp=4), S(dp=4, zero=3, dp_shard=2),
                                                          S(dp=2, tp=2, zero=2)],
                                               num_micro_batches=2, schedule="zero_bubble", stages=((0, 3), (3, 6)))),
    "gpt2_tied_two_ways": (GPT2, make_plan(GPT2, 8, [S(dp=4, tp=2)] + [S(dp=8, zero=3)] * 4 + [S(dp=8, zero=1)])),
    "gpt2_pp2_tied_two_ways": (GPT2, make_plan(GPT2, 8, [S(dp=2, tp=2)] + [S(dp=4, zero=3)] * 5,
                                               num_micro_batches=2, stages=((0, 3), (3, 6)))),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_meta_build_issues_no_collective_and_materialises_one_process_values(fake_world, name):
    config, plan = PLANS[name]
    dims = ParallelDims.from_plan(plan, WORLD)
    model = build_model(config, device="meta")
    with count_collectives(keep_trivial=True) as records:
        parts = _parts(plan, model, dims)
    assert records == [], records
    assert all(p.is_meta for part in parts for p in part.chunk.parameters())
    reference = dict(build_model(config, seed=3).named_parameters())
    checked = 0
    for part in parts:
        with count_collectives(keep_trivial=True) as records:
            materialize(part.chunk, config, seed=3, device=torch.device("cpu"))
        assert records == [], records
        for n, p in part.chunk.named_parameters():
            n = canonical_name(n)
            n = EMBEDDING_WEIGHT if config.tie_embeddings and n == HEAD_WEIGHT else n
            local = p.to_local() if hasattr(p, "to_local") else p
            assert torch.equal(local, full_value_slice(reference[n].detach(), p)), n
            checked += 1
    assert checked > 0
