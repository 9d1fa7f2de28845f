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
"""
from __future__ import annotations

import torch
from torch import nn

from ..cost.expert_offload import GPU, HOST, OffloadPlan
from ..errors import TesseraError
from ..models.moe import Experts, MoE


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
            else:
                outs.append(expert(part.to(self.host)).to(x.device, non_blocking=True))
        self.prefetched = {}
        return torch.cat(outs) if outs else x[:0]


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def apply_expert_offload(model: nn.Module, plan: OffloadPlan, device: torch.device | str) -> list[HostExperts]:
    """Move every MoE layer's experts to host memory and run them as `plan` decides (its layers in
    model order); the blocks prefetch their device experts when they start."""
    device = torch.device(device)
    blocks = [(block, block.moe) for block in model.modules() if isinstance(getattr(block, "moe", None), MoE)]
    if len(blocks) != len(plan.layers):
        raise TesseraError(f"the offload plan has {len(plan.layers)} MoE layers, the model {len(blocks)}")
    out = []
    for (block, moe), layer in zip(blocks, plan.layers):
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
