"""Initial parameter values that any rank can compute for any piece of any parameter.

The rule (GPT-2 style): vectors are 1 for norm weights and 0 otherwise (biases); matrices are
normal(0, std), the residual output projections (`wo`, `w2`) scaled by 1/sqrt(2 * num_layers).

The random numbers depend only on (seed, parameter name, shape): a matrix of R rows and C columns
is drawn in blocks of `rows_per_block(C)` rows, block b from its own generator seeded by
(seed, name, b). So a rank that holds rows [r0, r1) of a parameter draws only the blocks that
cover them (no generator has to be run through the parameters of other ranks), the value does not
depend on the plan, the world size or the device, and drawing costs one block of memory beyond
the piece itself.
"""
from __future__ import annotations

import hashlib
import math

import torch

BLOCK_ELEMENTS = 1 << 20  # ~4 MiB of fp32 per draw


def rows_per_block(cols: int) -> int:
    return max(1, BLOCK_ELEMENTS // max(1, cols))


def block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def scale_of(name: str, num_layers: int, std: float) -> float:
    return std / math.sqrt(2 * num_layers) if name.endswith(("wo.weight", "w2.weight")) else std


def init_piece(name: str, shape: torch.Size | tuple[int, ...], seed: int, num_layers: int, std: float = 0.02,
               offset: tuple[int, ...] | None = None, piece_shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The initial value of parameter `name` (full `shape`), or of its rectangle starting at
    `offset` with `piece_shape` (fp32, on the CPU)."""
    shape = tuple(shape)
    offset = tuple(offset) if offset is not None else (0,) * len(shape)
    piece_shape = tuple(piece_shape) if piece_shape is not None else shape
    if len(shape) == 1:
        fill = 1.0 if name.endswith("norm.weight") else 0.0
        return torch.full(piece_shape, fill)
    if len(shape) != 2:
        raise ValueError(f"parameter {name} has {len(shape)} dimensions; the init rule covers vectors and matrices")
    rows, cols = shape
    (r0, c0), (nr, nc) = offset, piece_shape
    out = torch.empty(nr, nc)
    if nr == 0 or nc == 0:
        return out
    per = rows_per_block(cols)
    gen = torch.Generator()
    for b in range(r0 // per, (r0 + nr - 1) // per + 1):
        b0, b1 = b * per, min(rows, (b + 1) * per)
        gen.manual_seed(block_seed(seed, name, b))
        block = torch.randn(b1 - b0, cols, generator=gen)
        lo, hi = max(b0, r0), min(b1, r0 + nr)
        out[lo - r0:hi - r0] = block[lo - b0:hi - b0, c0:c0 + nc]
    return out.mul_(scale_of(name, num_layers, std))
