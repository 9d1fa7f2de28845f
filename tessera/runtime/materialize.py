"""Build big models without ever holding them whole: meta device, parallelise, then initialise shards.

`materialize(part, param_shapes(full_meta), config, seed, device)` allocates a parallelised part (`to_empty`) and writes
into each local shard the values `Transformer.init_weights(seed)` would give the full model: the
same generator is drawn in the same parameter order, one full parameter at a time (peak extra
memory: the largest single parameter), and each rank keeps its slice (`distribute_tensor` with no
source rank: every rank slices its own copy, no communication).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..models.transformer import Transformer, rope_frequencies
from ..spec.model import TransformerConfig

# Wrapper segments that parallelisation adds to parameter names (recompute, compile, DDP).
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def canonical_name(name: str) -> str:
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def _init_value(name: str, shape: torch.Size, gen: torch.Generator, num_layers: int, std: float) -> torch.Tensor:
    """The value of one parameter under `Transformer.init_weights` (same rule, same draw order)."""
    if len(shape) == 1:
        return torch.ones(shape) if name.endswith("norm.weight") else torch.zeros(shape)
    scale = std / math.sqrt(2 * num_layers) if name.endswith(("wo.weight", "w2.weight")) else std
    return torch.randn(shape, generator=gen) * scale


@torch.no_grad()
def _write(p: torch.Tensor, full: torch.Tensor) -> None:
    if hasattr(p, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        local = distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None).to_local()
        p.to_local().copy_(local)
    else:
        p.copy_(full)


def param_shapes(model: Transformer) -> list[tuple[str, torch.Size]]:
    """(name, shape) of every parameter in `init_weights` order; take it before parallelising."""
    return [(name, p.shape) for name, p in model.named_parameters()]


@torch.no_grad()
def materialize(part: nn.Module, shapes: list[tuple[str, torch.Size]], config: TransformerConfig, seed: int,
                device: torch.device, std: float = 0.02) -> None:
    """Allocate `part` on `device` and initialise it as the full model would be with `seed`."""
    part.to_empty(device=device)
    targets: dict[str, list[torch.Tensor]] = {}
    for name, p in part.named_parameters(remove_duplicate=False):
        targets.setdefault(canonical_name(name), []).append(p)
    if config.tie_embeddings:  # a pipeline's untied head copy starts equal to the embedding
        targets.setdefault("tok_embeddings.weight", []).extend(targets.pop("output.weight", []))
    gen = torch.Generator().manual_seed(seed)
    for name, shape in shapes:
        value = _init_value(name, shape, gen, config.num_layers, std)
        for p in {id(t): t for t in targets.get(name, [])}.values():
            _write(p, value)
    if config.position != "learned":
        freqs = rope_frequencies(config.head_dim, config.max_seq_len, config.rope_theta).to(device)
        for module in part.modules():
            if "freqs" in module._buffers:
                module.freqs = freqs
