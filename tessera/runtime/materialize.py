"""Build big models without ever holding them whole: meta device, parallelise, then initialise shards.

    model = build_model(config, device="meta")
    par = parallelize(model, plan, dims, rank)          # no memory, no collectives
    materialize(par.chunk, config, seed, device)        # this rank's shards, as one process would
    par.wrap_ddp()                                      # DDP plans only

`materialize` allocates the part's local storage (`to_empty`) and writes into each local shard the
values `Transformer.init_weights(seed)` gives the whole model there: the init rule draws every
parameter in row blocks with their own seeds (`tessera.models.init`), so a rank draws only the
rows of its own shards. Peak extra memory: one row block (~4 MiB) plus one shard.

A shard is located by DTensor's own layout arithmetic (`compute_local_shape_and_global_offset`,
which covers the `_StridedShard` placements FSDP2 gives tensor-parallel weights); a local shard
that is not one rectangle of the parameter (no plan makes one today) falls back to drawing the
whole parameter and slicing it with `distribute_tensor`.
"""
from __future__ import annotations

import torch
from torch import nn

from ..models.init import init_piece
from ..models.transformer import rope_frequencies
from ..spec.model import TransformerConfig

# Wrapper segments that parallelisation adds to parameter names (recompute, compile, DDP).
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")
EMBEDDING_WEIGHT, HEAD_WEIGHT = "tok_embeddings.weight", "output.weight"


def canonical_name(name: str) -> str:
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def local_rectangle(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(offset, shape) of this rank's shard of `p` inside the full parameter, or None when the
    shard is not one rectangle. A plain tensor is its own full parameter.

    Shards are cut as FSDP2 and DTensor cut them (`torch.chunk`: pieces of ceil(n / k) rows, the
    last ones shorter or empty): first the plain `Shard` placements in mesh order (tensor
    parallelism), then the `_StridedShard` ones (FSDP2 sharding a tensor-parallel shard further
    chunks the local shard). DTensor's own arithmetic for `_StridedShard` differs from FSDP2's
    cut when the rows do not divide evenly (a vocabulary of 50,257 rows over tp2 x dp4)."""
    if not hasattr(p, "device_mesh"):
        return (0,) * p.dim(), tuple(p.shape)
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    mesh, placements = p.device_mesh, p.placements
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    offset, shape = [0] * p.dim(), list(p.shape)
    plain = [i for i, pl in enumerate(placements) if isinstance(pl, Shard) and not isinstance(pl, _StridedShard)]
    strided = [i for i, pl in enumerate(placements) if isinstance(pl, _StridedShard)]
    for i in plain + strided:
        dim, pieces = placements[i].dim, mesh.size(i)
        chunk = -(-shape[dim] // pieces)
        start = min(coordinate[i] * chunk, shape[dim])
        offset[dim] += start
        shape[dim] = max(0, min(chunk, shape[dim] - start))
    if tuple(shape) != tuple(p.to_local().shape):
        return None
    return tuple(offset), tuple(shape)


def full_value_slice(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a full value laid out like parameter (or gradient) `p`."""
    if not hasattr(p, "device_mesh"):
        return full
    rect = local_rectangle(p)
    if rect is not None:
        return full[tuple(slice(o, o + n) for o, n in zip(*rect))]
    from torch.distributed.tensor import distribute_tensor

    device = torch.device(p.device_mesh.device_type, torch.cuda.current_device()) \
        if p.device_mesh.device_type == "cuda" else torch.device(p.device_mesh.device_type)
    return distribute_tensor(full.to(device), p.device_mesh, p.placements, src_data_rank=None).to_local()


@torch.no_grad()
def _initialise(name: str, p: torch.Tensor, config: TransformerConfig, seed: int, std: float) -> None:
    local = p.to_local() if hasattr(p, "to_local") else p
    rect = local_rectangle(p)
    if rect is not None:
        value = init_piece(name, p.shape, seed, config.num_layers, std, *rect)
    else:
        value = full_value_slice(init_piece(name, p.shape, seed, config.num_layers, std), p)
    local.copy_(value)


@torch.no_grad()
def materialize(part: nn.Module, config: TransformerConfig, seed: int, device: torch.device,
                std: float = 0.02) -> None:
    """Allocate `part` (a parallelised model or chunk on the meta device) on `device` and
    initialise every local shard as `build_model(config, seed)` initialises the whole model."""
    part.to_empty(device=device)
    seen: set[int] = set()
    for name, p in part.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        name = canonical_name(name)
        if config.tie_embeddings and name == HEAD_WEIGHT:  # a pipeline's untied head copy
            name = EMBEDDING_WEIGHT
        _initialise(name, p, config, seed, std)
    if config.position != "learned":
        freqs = rope_frequencies(config.head_dim, config.max_seq_len, config.rope_theta).to(device)
        for module in part.modules():
            if "freqs" in module._buffers:
                module.freqs = freqs
