"""The Plan: the contract between the planner and the runtime.

A `Plan` says, for one model on one cluster and workload, how every layer is parallelised, how
the layers are cut into pipeline stages, how the batch is split into micro-batches, how ranks are
laid out on the mesh, and what the cost model predicts. It is a frozen, versioned JSON document:
`tessera plan -o plan.json` writes one and `tessera train --plan plan.json` executes it, never
re-deciding anything. A plan made by hand (`--dp 4 --tp 2`) or a baseline is the same object.

Rank layout (outermost to innermost mesh axis): pp, dp, cp, sp, tp — tensor parallel innermost, so
that it stays inside a node. Inside a pipeline stage every layer uses all `world / pp` ranks of
the stage: `dp * cp * sp * tp == world / pp` for each layer, where `sp` is the Ulysses degree (1
when none; Megatron-style sequence parallelism reuses the TP group) and `cp` the context-parallel
(ring attention) degree. Layers of a stage may choose different degrees: a (dp=4, tp=1) layer
shards the batch over the stage's (dp, tp) axes both.

Why cp sits between dp and sp: the traffic of an axis decides how far inside it goes. TP (two
collectives per block on the critical path) and Ulysses (four all-to-alls per attention layer,
not overlapped) need NVLink; ring attention passes K/V blocks point to point and hides them
behind each step's block attention, so it tolerates the network, and its messages (K/V only,
small under grouped-query attention) are smaller than Ulysses'; data parallelism moves
gradients once per step or overlaps ZeRO traffic with whole layers, the most tolerant of all.
Megatron-LM orders tp, cp, dp, pp the same way (innermost first). Context parallel ranks hold
the same parameters, so ZeRO shards model states over dp x cp (FSDP2's mesh, as torchtitan's).

No torch import.
"""
from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, model_validator

from .spec.cluster import ClusterSpec
from .spec.jsonio import first_validation_error
from .spec.model import Frozen, ModelSpec
from .spec.workload import Workload

PLAN_VERSION = 1


class PlanError(ValueError):
    """A plan that cannot be read or is not valid for what it is asked to run on."""


class SPKind(StrEnum):
    NONE = "none"
    MEGATRON = "megatron"  # shard norm/dropout regions over the TP group (degree = tp)
    ULYSSES = "ulysses"  # all-to-all over heads, sequence sharded `sp` ways


class Recompute(StrEnum):
    NONE = "none"
    SELECTIVE = "selective"  # attention core and activation functions
    FULL = "full"  # keep only the block input, replay the forward


class Schedule(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    ZERO_BUBBLE = "zero_bubble"  # ZB-H1 style split of backward into input- and weight-grad


MESH_AXES: tuple[str, ...] = ("pp", "dp", "cp", "sp", "tp")  # outermost -> innermost


class LayerStrategy(Frozen):
    """How one layer runs on the ranks of its stage."""

    dp: int = Field(default=1, ge=1, description="data-parallel degree (batch sharding)")
    tp: int = Field(default=1, ge=1, description="tensor-parallel degree")
    sp: SPKind = SPKind.NONE
    sp_degree: int = Field(default=1, ge=1, description="Ulysses degree (1 unless sp=ulysses)")
    zero: int = Field(default=0, ge=0, le=3, description="ZeRO stage over the dp ranks")
    # Hybrid sharding (HSDP): shard over groups of `dp_shard` ranks, replicate across them.
    # 0 means shard over all dp ranks.
    dp_shard: int = Field(default=0, ge=0)
    recompute: Recompute = Recompute.NONE
    offload_optimizer: bool = False
    ep: int = Field(default=1, ge=1, description="expert-parallel degree (MoE layers)")
    # Context parallelism (ring attention, runtime/context_parallel.py): the sequence is cut into
    # 2 cp chunks and cp rank c holds chunks c and 2cp-1-c (the load-balanced causal split).
    cp: int = Field(default=1, ge=1, description="context-parallel degree (ring attention)")

    @model_validator(mode="after")
    def _check(self) -> "LayerStrategy":
        if self.sp == SPKind.ULYSSES and self.sp_degree < 2:
            raise ValueError("sp=ulysses needs sp_degree >= 2")
        if self.sp != SPKind.ULYSSES and self.sp_degree != 1:
            raise ValueError(f"sp_degree={self.sp_degree} needs sp=ulysses")
        if self.sp == SPKind.MEGATRON and self.tp < 2:
            raise ValueError("sp=megatron needs tp >= 2")
        if self.dp_shard and self.dp % self.dp_shard:
            raise ValueError(f"dp_shard={self.dp_shard} does not divide dp={self.dp}")
        if self.dp_shard and not self.zero:
            raise ValueError("dp_shard (hybrid sharding) needs zero >= 1")
        if (self.dp * self.sp_degree) % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp*sp_degree={self.dp * self.sp_degree}")
        if self.cp > 1 and self.ep > 1:
            raise ValueError("cp > 1 with expert parallelism is not supported (ep needs cp=1)")
        return self

    @property
    def devices(self) -> int:
        return self.dp * self.cp * self.sp_degree * self.tp

    @property
    def shard_degree(self) -> int:
        """Ranks over which ZeRO shards model states (1 without ZeRO): the dp ranks (or the HSDP
        group) times the context-parallel ranks, which hold the same parameters."""
        if not self.zero:
            return 1
        return (self.dp_shard or self.dp) * self.cp

    def describe(self) -> str:
        parts = [f"dp{self.dp}"]
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("+sp" if self.sp == SPKind.MEGATRON else ""))
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.sp == SPKind.ULYSSES:
            parts.append(f"ulysses{self.sp_degree}")
        if self.zero:
            parts.append(f"zero{self.zero}" + (f"/hsdp{self.dp_shard}" if self.dp_shard and self.dp_shard != self.dp else ""))
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.recompute != Recompute.NONE:
            parts.append(f"rc:{self.recompute.value}")
        if self.offload_optimizer:
            parts.append("offload")
        return " ".join(parts)


class PipelineSpec(Frozen):
    degree: int = Field(default=1, ge=1)
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual_stages: int = Field(default=1, ge=1, description="model chunks per rank (interleaved)")
    # Layer range [start, end) of each model chunk, in model order; degree * virtual_stages
    # chunks, chunk i placed on pipeline rank i % degree.
    stages: tuple[tuple[int, int], ...]

    @model_validator(mode="after")
    def _check(self) -> "PipelineSpec":
        if len(self.stages) != self.degree * self.virtual_stages:
            raise ValueError(
                f"pipeline of degree {self.degree} with {self.virtual_stages} virtual stages needs "
                f"{self.degree * self.virtual_stages} layer ranges, got {len(self.stages)}"
            )
        expected = 0
        for start, end in self.stages:
            if start != expected or end <= start:
                raise ValueError(f"pipeline stages must cover the layers in order without gaps: {self.stages}")
            expected = end
        if self.virtual_stages > 1 and self.schedule != Schedule.INTERLEAVED_1F1B:
            raise ValueError("virtual_stages > 1 needs schedule interleaved_1f1b")
        return self

    def rank_of_chunk(self, chunk: int) -> int:
        return chunk % self.degree


class MemoryBreakdown(Frozen):
    """Peak bytes on one device of a stage."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    buffers: float = 0.0  # communication buffers, gathered ZeRO-3 weights, framework reserve
    fragmentation: float = 0.0  # the caching allocator's waste (ClusterSpec.fragmentation)
    host: float = 0.0  # offloaded states in host memory (not device memory: not in `total`)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers + self.fragmentation


class Prediction(Frozen):
    step_time_s: float
    tokens_per_s: float
    mfu: float
    stage_memory: tuple[MemoryBreakdown, ...]
    # Breakdown of the step for explanations and plots (seconds): compute, exposed comm, bubble.
    compute_s: float = 0.0
    exposed_comm_s: float = 0.0
    bubble_s: float = 0.0
    # Whether the largest stage fits: peak_memory <= device memory less the planner's margin.
    fits: bool = True

    @property
    def peak_memory(self) -> float:
        return max(m.total for m in self.stage_memory)


class SearchInfo(Frozen):
    """How the plan was found; empty for hand-made plans."""

    search_time_s: float = 0.0
    candidates: int = 0
    explanation: tuple[str, ...] = ()
    # Proved by the search's bounds: no plan of its space has a shorter predicted step (0: none).
    step_lower_bound_s: float = 0.0


class Plan(Frozen):
    version: int = PLAN_VERSION
    name: str = "tessera"
    model: ModelSpec
    cluster: ClusterSpec
    workload: Workload
    micro_batch_size: int = Field(ge=1, description="sequences per micro-batch per data-parallel replica")
    num_micro_batches: int = Field(ge=1)
    pipeline: PipelineSpec
    layers: tuple[LayerStrategy, ...]
    mesh_axes: tuple[str, ...] = MESH_AXES
    prediction: Prediction | None = None
    search: SearchInfo = SearchInfo()

    @model_validator(mode="after")
    def _check(self) -> "Plan":
        if self.version != PLAN_VERSION:
            raise ValueError(f"plan version {self.version} is not supported (this Tessera reads version {PLAN_VERSION})")
        n = len(self.model.layers)
        if len(self.layers) != n:
            raise ValueError(f"plan has {len(self.layers)} layer strategies for a model of {n} layers")
        if self.pipeline.stages[-1][1] != n:
            raise ValueError(f"pipeline stages end at layer {self.pipeline.stages[-1][1]}, model has {n}")
        world = self.cluster.num_gpus
        if world % self.pipeline.degree:
            raise ValueError(f"pipeline degree {self.pipeline.degree} does not divide {world} devices")
        per_stage = world // self.pipeline.degree
        for i, s in enumerate(self.layers):
            if s.devices != per_stage:
                raise ValueError(
                    f"layer {i} ({self.model.layers[i].name}) uses dp*cp*sp*tp={s.devices} devices, "
                    f"its stage has {per_stage}"
                )
            experts = self.model.layers[i].num_experts
            if s.ep > 1 and experts % s.ep:
                raise ValueError(f"layer {i} ({self.model.layers[i].name}) has {experts} experts, "
                                 f"not divisible by its expert-parallel degree ep={s.ep}")
        widest = self.dp_of_batch  # once: the property scans every layer
        if any(widest % s.dp for s in self.layers):
            raise ValueError(f"every layer's dp must divide the widest dp {self.dp_of_batch}")
        per_replica = self.micro_batch_size * self.num_micro_batches
        if per_replica * self.dp_of_batch != self.workload.global_batch:
            raise ValueError(
                f"micro_batch_size {self.micro_batch_size} x {self.num_micro_batches} micro-batches x "
                f"dp {self.dp_of_batch} != global batch {self.workload.global_batch}"
            )
        return self

    @property
    def world_size(self) -> int:
        return self.cluster.num_gpus

    @property
    def stage_size(self) -> int:
        return self.world_size // self.pipeline.degree

    @property
    def dp_of_batch(self) -> int:
        """Replicas the global batch is split over: the widest dp of any layer.

        `micro_batch_size` counts sequences per replica at that dp; a layer with a smaller dp
        (e.g. tp=2 where another layer has tp=1) runs `dp_of_batch // dp` times as many."""
        return max(s.dp for s in self.layers)

    def stage_of_layer(self, layer: int) -> int:
        for chunk, (start, end) in enumerate(self.pipeline.stages):
            if start <= layer < end:
                return chunk
        raise IndexError(layer)

    # --- JSON -------------------------------------------------------------------------------
    def to_json(self, indent: int | None = 1) -> str:
        return self.model_dump_json(indent=indent)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise PlanError("plan JSON must be an object")
        version = data.get("version")
        if version != PLAN_VERSION:
            raise PlanError(
                f"plan version {version} is not supported (this Tessera reads version {PLAN_VERSION}); "
                "make the plan again with `tessera plan`"
            )
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise PlanError(f"invalid plan: {first_validation_error(e)}") from None

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        path = Path(path)
        if not path.is_file():
            raise PlanError(f"plan file {path} does not exist")
        return cls.from_json(path.read_text())

    def check_matches(self, model: ModelSpec | None = None, world_size: int | None = None) -> None:
        """Refuse a plan made for another model or another number of ranks."""
        if model is not None and model.name != self.model.name:
            raise PlanError(f"plan was made for model '{self.model.name}', not '{model.name}'")
        if model is not None and model.layers != self.model.layers:
            raise PlanError(f"plan was made for a different '{model.name}' (layer specs differ)")
        if world_size is not None and world_size != self.world_size:
            raise PlanError(f"plan was made for {self.world_size} ranks, but {world_size} are running")


# --- per-step plans (adaptive parallelism) -----------------------------------------------------


class SPGroupAssignment(Frozen):
    """A sequence-parallel group of ranks and the sequences (indices into the step's batch) it
    runs, with its activation recompute (local to its ranks; None: the run's own)."""

    ranks: tuple[int, ...]
    sequences: tuple[int, ...]
    recompute: Recompute | None = None
    predicted_time_s: float = 0.0

    @property
    def degree(self) -> int:
        return len(self.ranks)


class MicroBatchPlan(Frozen):
    groups: tuple[SPGroupAssignment, ...]
    predicted_time_s: float = 0.0


class PhasePlan(Frozen):
    """Micro-batches of one length group of a step, run under one ZeRO working mode (HotSPa):
    3, parameters gathered every micro-batch; 2, gathered once for the phase, gradients
    reduce-scattered every micro-batch; 1, gradients also accumulated unsharded until the phase
    ends. None: the run's own (the static plan's)."""

    micro_batches: tuple[MicroBatchPlan, ...]
    zero: int | None = Field(default=None, ge=1, le=3)


class StepPlan(Frozen):
    """How one step's batch of variable-length sequences is split (see `tessera.adapt`): phases
    run one after the other, each a list of micro-batches of sequence-parallel groups. Group ranks
    come in units of `tp` consecutive ranks (tensor parallel inside a group). A plan given with
    `micro_batches` only is one phase under the run's own strategy."""

    step: int
    seq_lens: tuple[int, ...]
    phases: tuple[PhasePlan, ...]
    tp: int = Field(default=1, ge=1)
    predicted_time_s: float = 0.0
    strategy: Literal["adaptive", "static", "switching"] = "adaptive"

    @model_validator(mode="before")
    @classmethod
    def _one_phase(cls, data):
        if isinstance(data, dict) and "micro_batches" in data and "phases" not in data:
            data = dict(data)
            data["phases"] = ({"micro_batches": data.pop("micro_batches")},)
        return data

    @property
    def micro_batches(self) -> tuple[MicroBatchPlan, ...]:
        return tuple(m for p in self.phases for m in p.micro_batches)

    def unit_times(self) -> list[float]:
        """Predicted busy seconds of every unit of `tp` ranks over the step (its groups' times)."""
        units = max((r for m in self.micro_batches for g in m.groups for r in g.ranks), default=-1) // self.tp + 1
        busy = [0.0] * units
        for m in self.micro_batches:
            for g in m.groups:
                for u in {r // self.tp for r in g.ranks}:
                    busy[u] += g.predicted_time_s
        return busy
