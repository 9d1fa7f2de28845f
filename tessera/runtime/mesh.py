"""Ranks and meshes: where each rank sits for every layer of a plan.

Words: a mesh *axis* is a named dimension of a `DeviceMesh` ("pp", "dp", "cp", "sp", "tp"); a
tensor *dim* is a dimension of a tensor.

Rank layout (outermost to innermost): pp, dp, cp, sp, tp (plan.py says why). A rank's index
inside its pipeline stage (`stage_rank`, 0 <= stage_rank < world / pp) decomposes, for a layer
with degrees (dp, cp, sp, tp), as

    stage_rank = ((d * cp + c) * sp + s) * tp + t,   0 <= d < dp, 0 <= c < cp, 0 <= s < sp, 0 <= t < tp

so tensor parallelism stays innermost (inside a node). Layers of one stage may choose different
degrees; each decomposes the same stage ranks its own way. The arithmetic is pure
(`layer_coords`, `axis_groups`) and unit-tested without processes; `ParallelDims` validates the
degrees of a plan and builds the `DeviceMesh` objects the runtime needs, cached per layout.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from ..errors import TesseraError
from ..plan import LayerStrategy, Plan

if TYPE_CHECKING:  # torch only at run time
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)


class Axis(StrEnum):
    PP = "pp"
    DP = "dp"
    CP = "cp"
    SP = "sp"
    TP = "tp"
    # Axes of a layer's sharding mesh (FSDP2 HSDP wants (replicate, shard) as two axes).
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"


# --- pure rank arithmetic -------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerCoords:
    """Where one rank sits for one layer: pipeline stage, and (d, c, s, t) inside the stage."""

    pp: int
    dp: int
    sp: int
    tp: int
    cp: int = 0


def layer_coords(rank: int, stage_size: int, dp: int, sp: int, tp: int, cp: int = 1) -> LayerCoords:
    """Split a global rank into (pp, dp, cp, sp, tp) coordinates; dp * cp * sp * tp must equal stage_size."""
    if dp * cp * sp * tp != stage_size:
        raise ValueError(f"dp*cp*sp*tp = {dp * cp * sp * tp} does not equal the stage size {stage_size}")
    pp, r = divmod(rank, stage_size)
    return LayerCoords(pp=pp, dp=r // (cp * sp * tp), sp=(r // tp) % sp, tp=r % tp, cp=(r // (sp * tp)) % cp)


def axis_groups(shape: dict[str, int], axis: str | tuple[str, ...]) -> list[list[int]]:
    """Rank groups along `axis` (or several axes taken together) of a row-major mesh.

    `shape` maps axis names, outermost first, to sizes. Each group holds the ranks that differ
    only in the named axes (Megatron's RankGenerator). Example: shape {pp:1, dp:2, sp:1, tp:2},
    axis "tp" -> [[0, 1], [2, 3]]; axis "dp" -> [[0, 2], [1, 3]].
    """
    names = list(shape)
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    for a in axes:
        if a not in shape:
            raise ValueError(f"unknown mesh axis '{a}'; axes: {', '.join(names)}")
    strides, stride = {}, 1
    for name in reversed(names):
        strides[name] = stride
        stride *= shape[name]
    others = [n for n in names if n not in axes]

    def offsets(axis_names):
        out = [0]
        for n in axis_names:
            out = [o + i * strides[n] for o in out for i in range(shape[n])]
        return out

    return [sorted(base + off for off in offsets(axes)) for base in sorted(offsets(others))]


# --- degrees of a plan ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerLayout:
    """The degrees that decide which ranks share a layer's parameters.

    `shard` is the ZeRO shard group size (1 without ZeRO; otherwise dp, or the HSDP dp_shard,
    times cp: context-parallel ranks hold the same parameters and ZeRO shards over them too);
    the remaining `dp * cp * sp / shard` ranks that hold the same tensor-parallel slice replicate.
    """

    dp: int
    sp: int
    tp: int
    shard: int
    cp: int = 1

    @classmethod
    def of(cls, s: LayerStrategy) -> "LayerLayout":
        return cls(dp=s.dp, sp=s.sp_degree, tp=s.tp, shard=s.shard_degree, cp=s.cp)

    @property
    def replicate(self) -> int:
        return self.dp * self.cp * self.sp // self.shard

    @property
    def shard_cp(self) -> int:
        """The cp part of the shard group: cp under ZeRO (shard = dp part x cp), 1 without it."""
        return self.cp if self.shard % self.cp == 0 else 1

    @property
    def shard_dp(self) -> int:
        return self.shard // self.shard_cp


@dataclass
class ParallelDims:
    """Validated degrees of a plan and the meshes built from them (torchtitan's ParallelDims).

    `mesh` is the stage-wide mesh ("pp", "dp", "sp", "tp") of the plan's reference layout (the
    most common layer layout; ("pp", "dp", "cp", "sp", "tp") when that layout is context
    parallel); `layer_mesh(strategy)` returns the sharding mesh of one layer, ("pp",
    "dp_replicate", "dp_shard", "tp"), built once per distinct layout; `sp_group` and `cp_group`
    the Ulysses and ring-attention groups of a layout. Callers never build process groups themselves.
    """

    pp: int
    stage_size: int
    world_size: int
    reference: LayerLayout
    device_type: str = "cpu"
    _mesh: "DeviceMesh | None" = field(default=None, repr=False)
    _layer_meshes: dict = field(default_factory=dict, repr=False)
    _sp_meshes: dict = field(default_factory=dict, repr=False)
    _stage_group: object = field(default=None, repr=False)
    _built: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.pp * self.stage_size != self.world_size:
            raise TesseraError(f"pp={self.pp} x stage size {self.stage_size} != world size {self.world_size}")
        r = self.reference
        if r.dp * r.cp * r.sp * r.tp != self.stage_size:
            raise TesseraError(f"dp*cp*sp*tp={r.dp * r.cp * r.sp * r.tp} does not fill a stage of "
                               f"{self.stage_size} ranks")

    @classmethod
    def from_plan(cls, plan: Plan, world_size: int, device_type: str = "cpu") -> "ParallelDims":
        plan.check_matches(world_size=world_size)
        layouts = [LayerLayout.of(s) for s in plan.layers]
        reference = max(set(layouts), key=lambda lay: (layouts.count(lay), -layouts.index(lay)))
        return cls(pp=plan.pipeline.degree, stage_size=plan.stage_size, world_size=world_size,
                   reference=reference, device_type=device_type)

    # --- meshes (need an initialised process group) ----------------------------------------------
    def build_all(self, plan: Plan) -> None:
        """Create every mesh and group of the plan now, in plan order, on every rank.

        Creating a process group is collective over the whole world, so ranks must create the
        same groups in the same order; built lazily, ranks of different pipeline stages (which
        parallelise different layers) would deadlock. Idempotent."""
        if self._built:
            return
        self.mesh  # noqa: B018 (builds it)
        self.stage_group  # noqa: B018
        for s in plan.layers:
            layout = LayerLayout.of(s)
            self.layer_mesh(layout)
            if s.sp_degree > 1:
                self.sp_group(layout)
            if s.cp > 1:
                self.cp_group(layout)
        from .layout import ActLayout, reshard_sizes

        for size in reshard_sizes([ActLayout.of(s) for s in plan.layers]):
            self.reshard_group(size)
        from .expert_parallel import build_expert_meshes

        build_expert_meshes(plan, self)
        self._built = True

    @property
    def mesh(self) -> "DeviceMesh":
        """The world mesh ("pp", "dp", ["cp",] "sp", "tp") of the reference layout."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            r = self.reference
            if r.cp > 1:
                self._mesh = init_device_mesh(self.device_type, (self.pp, r.dp, r.cp, r.sp, r.tp),
                                              mesh_dim_names=(Axis.PP, Axis.DP, Axis.CP, Axis.SP, Axis.TP))
            else:
                self._mesh = init_device_mesh(self.device_type, (self.pp, r.dp, r.sp, r.tp),
                                              mesh_dim_names=(Axis.PP, Axis.DP, Axis.SP, Axis.TP))
        return self._mesh

    def layer_mesh(self, layout: LayerLayout) -> "DeviceMesh":
        """Mesh ("pp", "dp_replicate", "dp_shard", "tp") for one layer layout.

        Ranks (d, c, s, t) with d = d_rep * shard_dp + d_shard: the shard axis runs over (d_shard,
        c) under ZeRO (context-parallel ranks hold the same parameters: FSDP2 shards over dp x cp),
        the replicate axis over (d_rep, s), and over c too without ZeRO — Ulysses ranks hold the
        same parameters, like dp ranks.
        """
        if layout not in self._layer_meshes:
            import torch
            from torch.distributed.device_mesh import DeviceMesh

            rep_dp, shard_dp, cp = layout.dp // layout.shard_dp, layout.shard_dp, layout.cp
            ranks = torch.arange(self.world_size).view(self.pp, rep_dp, shard_dp, cp, layout.sp, layout.tp)
            if layout.shard_cp > 1:  # (pp, rep_dp, sp, shard_dp, cp, tp)
                ranks = ranks.permute(0, 1, 4, 2, 3, 5)
            else:  # (pp, rep_dp, cp, sp, shard_dp, tp)
                ranks = ranks.permute(0, 1, 3, 4, 2, 5)
            ranks = ranks.reshape(self.pp, layout.replicate, layout.shard, layout.tp)
            self._layer_meshes[layout] = DeviceMesh(
                self.device_type, ranks,
                mesh_dim_names=(Axis.PP, Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.TP))
        return self._layer_meshes[layout]

    def rank_mesh(self, shape: tuple[int, ...], names: tuple[str, ...]) -> "DeviceMesh":
        """A mesh over all ranks laid out row-major in `shape` (outermost first), built once per
        (shape, names): for layouts other than a layer's, e.g. the expert-parallel mesh
        (`runtime/expert_parallel.py`)."""
        key = (tuple(shape), tuple(names))
        if key not in self._layer_meshes:
            import torch
            from torch.distributed.device_mesh import DeviceMesh

            ranks = torch.arange(self.world_size).view(*shape)
            self._layer_meshes[key] = DeviceMesh(self.device_type, ranks, mesh_dim_names=tuple(names))
        return self._layer_meshes[key]

    def reshard_group(self, size: int):
        """Process group of the `size` consecutive ranks of this rank's stage that re-shard an
        activation between two layouts together (`runtime/layout.py`)."""
        mesh = self.rank_mesh((self.pp, self.stage_size // size, size), (Axis.PP, "reshard_blocks", "reshard"))
        return mesh.get_group("reshard")

    def _sequence_mesh(self, layout: LayerLayout) -> "DeviceMesh":
        """Mesh ("pp", "dp", "cp", "sp", "tp") of a layout's degrees (its "sp" and "cp" groups)."""
        key = (layout.dp, layout.cp, layout.sp, layout.tp)
        if key not in self._sp_meshes:
            import torch
            from torch.distributed.device_mesh import DeviceMesh

            r = self.reference
            if key == (r.dp, r.cp, r.sp, r.tp):
                self._sp_meshes[key] = self.mesh
            elif layout.cp == 1:
                ranks = torch.arange(self.world_size).view(self.pp, layout.dp, layout.sp, layout.tp)
                self._sp_meshes[key] = DeviceMesh(self.device_type, ranks,
                                                  mesh_dim_names=(Axis.PP, Axis.DP, Axis.SP, Axis.TP))
            else:
                ranks = torch.arange(self.world_size).view(self.pp, *key)
                self._sp_meshes[key] = DeviceMesh(self.device_type, ranks,
                                                  mesh_dim_names=(Axis.PP, Axis.DP, Axis.CP, Axis.SP, Axis.TP))
        return self._sp_meshes[key]

    def sp_group(self, layout: LayerLayout):
        """Process group of the Ulysses ranks of a layer (those that differ only in s)."""
        return self._sequence_mesh(layout).get_group(Axis.SP)

    def cp_group(self, layout: LayerLayout):
        """Process group of the context-parallel ranks of a layer (those that differ only in c),
        in ring order: group rank c holds the sequence chunks c and 2 cp - 1 - c."""
        if layout.cp < 2:
            raise TesseraError("cp_group needs a context-parallel layout (cp >= 2)")
        return self._sequence_mesh(layout).get_group(Axis.CP)

    @property
    def stage_group(self):
        """Process group of the ranks of this rank's pipeline stage (all of them when pp = 1)."""
        if self._stage_group is None:
            import torch
            import torch.distributed as dist
            from torch.distributed.device_mesh import DeviceMesh

            if self.pp == 1:
                self._stage_group = dist.group.WORLD
            else:
                ranks = torch.arange(self.world_size).view(self.pp, self.stage_size)
                self._stage_group = DeviceMesh(self.device_type, ranks,
                                               mesh_dim_names=(Axis.PP, "stage")).get_group("stage")
        return self._stage_group

    def stage_rank(self, rank: int) -> int:
        return rank % self.stage_size

    def pp_rank(self, rank: int) -> int:
        return rank // self.stage_size
