"""The searched plan of mixtral-8x7b on 64 H100 builds at its world size under PyTorch's fake process
group (meta device): each rank keeps E / ep experts of every MoE layer, at the expert shard of
cost/memory.py. Run by tests/test_moe_cost.py in a subprocess; prints `CHECK <name> ok`."""
from __future__ import annotations

import sys

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from tessera.cost.memory import expert_shard
from tessera.models.moe import MoE
from tessera.models.transformer import build_model
from tessera.runtime.expert_parallel import ExpertLayout
from tessera.runtime.mesh import ParallelDims
from tessera.runtime.parallelize import check_plan_supported, parallelize
from tessera.search import search
from tessera.spec.presets import get_model, make_cluster
from tessera.spec.workload import Workload

GPUS = 64
plan = search(get_model("mixtral-8x7b"), make_cluster("h100-80gb", GPUS), Workload(global_batch=512, seq_len=4096))
assert plan.pipeline.degree == 1 and any(s.ep > 1 for s in plan.layers), [s.describe() for s in plan.layers]
for rank in (0, 13):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=GPUS)
    check_plan_supported(plan, GPUS)
    dims = ParallelDims.from_plan(plan, GPUS)
    chunk = parallelize(build_model(plan.model.config, device="meta"), plan, dims, rank).chunk
    for name, module in chunk.named_modules():
        if not isinstance(module, MoE):
            continue
        s = plan.layers[int(name.split(".")[1]) + 1]
        layout = ExpertLayout.of(s)
        want = list(layout.local_experts(module.num_experts, layout.ep_rank(rank % plan.stage_size)))
        assert module.experts.indices == want, (name, module.experts.indices, want)
        es = int(expert_shard(s.shard_degree, s.dp, s.sp_degree, s.ep))
        for p in module.experts.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            full = p.numel()
            assert local.numel() * es * s.tp >= full > local.numel() * (es * s.tp - 1), (name, full, local.shape, es)
    dist.destroy_process_group()
print("CHECK mixtral_64_searched_plan_builds ok", flush=True)
