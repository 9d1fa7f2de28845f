"""APTMoE expert offload in the runtime: experts live in host memory and each computes where the
plan decided (tessera/cost/expert_offload.py).

- "gpu" experts: their weights are copied to the device ahead of use — prefetched on a side stream
  when the block starts, so the copy runs under the block's attention — and the expert runs there
  on its token rows (`torch.func.functional_call` with the device copies). The copy is a
  differentiable `.to()` of the host parameter, so the weight gradient lands on the host
  parameter, where the optimizer keeps the expert's state.
- "host" experts: their token rows go to the host, the expert runs there, the rows come back.
Both paths compute the same function as the model without offload; on a machine without an
accelerator the host is the device and only the mechanism is exercised (the speed is the cost
model's prediction).

In the trainer (`TrainConfig.expert_offload`: a `HostSpec`, whose decision the cost model makes
for the plan's micro-batch, or an `OffloadPlan`): every MoE layer's experts are kept on the host of
the one rank that holds the layer, so a MoE layer must run on one rank of its pipeline stage
(dp = sp = tp = ep = 1, no ZeRO: APTMoE's memory-poor GPU, or a pipeline of them); the optimizer
steps the host experts on the host (AdamW's foreach path groups parameters by device).
"""
from __future__ import annotations

import torch
from torch import nn

from ..cost.expert_offload import GPU, HOST, HostSpec, OffloadPlan, plan_expert_offload
from ..errors import TesseraError
from ..models.moe import Experts, MoE
from ..plan import Plan
from ..spec.model import LayerKind


class HostExperts(Experts):
    """Experts kept in host memory, each run on the device or the host (module docstring);
    `ran[e]` counts the rows expert e ran on, by place, for reports and tests."""

    def __init__(self, experts: dict[int, nn.Module], where: dict[int, str], device: torch.device):
        super().__init__(experts)
        self.where, self.device = where, torch.device(device)
        self.host = torch.device("cpu")
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.prefetched: dict[int, dict[str, torch.Tensor]] = {}
        self.ran: dict[int, dict[str, int]] = {e: {GPU: 0, HOST: 0} for e in where}
        self.prefetches = 0

    def _copy(self, expert: nn.Module) -> dict[str, torch.Tensor]:
        return {name: p.to(self.device, non_blocking=True) for name, p in expert.named_parameters()}

    def prefetch(self) -> None:
        """Start copying the "gpu" experts' weights to the device (on the side stream on CUDA)."""
        self.prefetches += 1
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else _nullcontext()
        with ctx:
            self.prefetched = {e: self._copy(self[e]) for e in self.indices if self.where[e] == GPU}

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        outs = []
        for e, part in zip(self.indices, x.split(counts)):
            expert = self[e]
            self.ran[e][self.where[e]] += len(part)
            if self.where[e] == GPU:
                weights = self.prefetched.pop(e, None) or self._copy(expert)
                outs.append(torch.func.functional_call(expert, weights, (part,)))
            else:  # in the experts' own dtype on the host (no autocast there)
                dtype = next(expert.parameters()).dtype
                outs.append(expert(part.to(self.host, dtype)).to(x.device, x.dtype, non_blocking=True))
        self.prefetched = {}
        return torch.cat(outs) if outs else x[:0]


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def apply_expert_offload(model: nn.Module, plan: OffloadPlan, device: torch.device | str) -> list[HostExperts]:
    """Move the MoE layers' experts of `model` (a whole model, or a chunk holding some of its blocks)
    to host memory and run them as `plan` decides (its layers: the model's MoE layers in order); the
    blocks prefetch their device experts when they start."""
    device = torch.device(device)
    blocks = [(name, block) for name, block in model.named_modules() if isinstance(block._modules.get("moe"), MoE)]
    if not blocks:  # a pipeline chunk without MoE layers
        return []
    config = blocks[0][1].moe.config
    moe_index = {b: j for j, b in enumerate(i for i in range(config.num_layers) if config.is_moe_layer(i))}
    if len(moe_index) != len(plan.layers):
        raise TesseraError(f"the offload plan has {len(plan.layers)} MoE layers, the model {len(moe_index)}")
    out = []
    for name, block in blocks:
        moe = block.moe
        layer = plan.layers[moe_index[_block_index(name)]]
        if len(layer.where) != moe.num_experts:
            raise TesseraError(f"the offload plan places {len(layer.where)} experts, the layer has {moe.num_experts}")
        experts = {e: moe.experts[e].to("cpu") for e in moe.experts.indices}
        if device.type == "cuda":
            for expert in experts.values():
                for p in expert.parameters():
                    p.data = p.data.pin_memory()
        host = HostExperts(experts, {e: layer.where[e] for e in experts}, device)
        moe.experts = host
        block.register_forward_pre_hook(lambda module, args, host=host: host.prefetch())
        out.append(host)
    return out


def _block_index(name: str) -> int:
    """The model block of a module name (`layers.<i>`, through wrappers' prefixes)."""
    path = name.split(".")
    return int(path[path.index("layers") + 1])


def offload_plan_for(plan: Plan, spec: HostSpec | OffloadPlan) -> OffloadPlan:
    """The decision to execute: given, or the cost model's for the plan's micro-batch on a host."""
    if isinstance(spec, OffloadPlan):
        return spec
    return plan_expert_offload(plan.model, plan.cluster, plan.workload, spec,
                               plan.micro_batch_size * plan.workload.seq_len, micro_batches=plan.num_micro_batches)


def check_expert_offload(plan: Plan) -> None:
    """Refuse, naming the field, a plan whose MoE layers do not run on one rank each."""
    for i, (layer, s) in enumerate(zip(plan.model.layers, plan.layers)):
        if layer.kind != LayerKind.MOE_DECODER:
            continue
        if s.dp * s.sp_degree * s.tp * s.ep > 1 or s.zero or s.offload_optimizer:
            raise TesseraError(f"plan.layers[{i}] ({layer.name}): expert offload keeps a layer's experts in one "
                               f"host's memory, so MoE layers need dp=sp=tp=ep=1 without ZeRO (one GPU, or a "
                               f"pipeline of them), not {s.describe()}")
