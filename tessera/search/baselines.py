"""Hand-made plans and the standard baselines, all costed by the same model as the search.

- `manual_plan(...)`: one strategy for every block (the embedding and LM head share its layout,
  without recompute; EP only on MoE layers), stages balanced by `balanced_stages`.
- `baseline_plans(...)`: "megatron-default" (tp = GPUs per node, Megatron SP, the smallest pp
  that fits, 1F1B, micro-batch 1, full recompute if needed), "fsdp" (ZeRO-3 over all GPUs),
  "zero1" and "ddp" (pure data parallel), each with the largest micro-batch that fits, recompute
  only if nothing fits without. Infeasible ones are returned too, with fits=False.
"""
from __future__ import annotations

from ..cost.evaluate import evaluate
from ..cost.layer import StepContext, StrategyTable, layer_costs
from ..plan import LayerStrategy, PipelineSpec, Plan, Recompute, Schedule, SPKind
from ..spec.cluster import ClusterSpec
from ..spec.model import LayerSpec, ModelSpec
from ..spec.workload import Workload
from .partition import balanced_stages
from .space import SearchOptions, cp_refusal, has_attention, layout_refusal, virtual_stage_options


def manual_plan(model: ModelSpec, cluster: ClusterSpec, workload: Workload, *, dp: int | None = None,
                tp: int = 1, pp: int = 1, sp: str = "none", sp_degree: int = 1, zero: int = 0,
                dp_shard: int = 0, recompute: str = "none", offload: bool = False, ep: int = 1,
                schedule: str = "1f1b", virtual_stages: int = 1, micro_batch_size: int = 1,
                name: str = "manual", cp: int = 1) -> Plan:
    """A plan with the same strategy on every block (cp: every layer), costed by `evaluate`."""
    world = cluster.num_gpus
    sp_kind = SPKind(sp) if sp in {k.value for k in SPKind} else None
    if sp_kind is None:
        raise ValueError(f"unknown sequence parallelism '{sp}'; choose none, megatron or ulysses")
    if sp_kind != SPKind.ULYSSES:
        sp_degree = 1
    if min(tp, pp, sp_degree, ep, micro_batch_size, virtual_stages, cp) < 1:
        raise ValueError("parallel degrees and the micro-batch size must be >= 1")
    if world % (pp * tp * sp_degree * cp):
        raise ValueError(f"pp={pp} x tp={tp} x sp={sp_degree} x cp={cp} does not divide {world} GPUs")
    dp = dp if dp is not None else world // (pp * tp * sp_degree * cp)
    if dp * pp * tp * sp_degree * cp != world:
        raise ValueError(f"dp={dp} x pp={pp} x tp={tp} x sp={sp_degree} x cp={cp} = "
                         f"{dp * pp * tp * sp_degree * cp}, but the cluster has {world} GPUs")
    if sp_kind == SPKind.MEGATRON and tp < 2:
        raise ValueError("sp=megatron shards over the tensor-parallel group: it needs tp >= 2")
    if sp_kind == SPKind.ULYSSES and sp_degree < 2:
        raise ValueError("sp=ulysses needs sp_degree >= 2")
    # The search space's rules (space.layout_refusal), once per kind of layer; Ulysses applies to
    # attention layers (the embedding and head of a hand plan share the blocks' layout).
    seen = set()
    for layer in sorted(model.layers, key=lambda x: not has_attention(x)):  # the blocks' rules first
        attention = has_attention(layer)
        if (layer.kind, attention) in seen:
            continue
        seen.add((layer.kind, attention))
        why = (layout_refusal(layer, tp, sp_degree if attention else 1, cluster.gpus_per_node)
               or cp_refusal(layer, cp, workload.seq_len))
        if why is not None:
            raise ValueError(f"{why} ({model.name}, layer {layer.name})")
    experts = max((layer.num_experts for layer in model.layers), default=0)
    if ep > 1 and (not experts or experts % ep or (dp * sp_degree) % ep):
        raise ValueError(f"ep={ep} must divide the number of experts ({experts}) and dp x sp ({dp * sp_degree})")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero stage must be 0, 1, 2 or 3, not {zero}")
    if dp_shard and (not zero or dp % dp_shard):
        raise ValueError(f"dp_shard={dp_shard} needs zero >= 1 and must divide dp={dp}")
    if offload and not zero:
        raise ValueError("optimizer offload needs zero >= 1")
    if workload.global_batch % (micro_batch_size * dp):
        raise ValueError(f"global batch {workload.global_batch} is not divisible by micro-batch size "
                         f"{micro_batch_size} x dp {dp}")
    m = workload.global_batch // (micro_batch_size * dp)
    sched = Schedule(schedule)
    if virtual_stages > 1 and sched != Schedule.INTERLEAVED_1F1B:
        raise ValueError("virtual_stages > 1 needs schedule interleaved_1f1b")
    if sched == Schedule.INTERLEAVED_1F1B and virtual_stages > 1 and m % pp:
        raise ValueError(f"interleaved 1F1B needs the micro-batch count ({m}) to be a multiple of pp ({pp})")
    if pp * virtual_stages > len(model.layers):
        raise ValueError(f"{pp * virtual_stages} pipeline chunks for {len(model.layers)} layers")
    if virtual_stages > 1 and virtual_stages not in virtual_stage_options(pp, len(model.layers), model.num_blocks,
                                                                          SearchOptions()):
        raise ValueError(f"virtual_stages={virtual_stages}: {pp} x {virtual_stages} chunks split neither the "
                         f"{model.num_blocks} blocks nor the {len(model.layers)} layers evenly")

    def strategy(layer: LayerSpec) -> LayerStrategy:
        block = has_attention(layer)
        return LayerStrategy(dp=dp, tp=tp, sp=sp_kind, sp_degree=sp_degree, zero=zero, dp_shard=dp_shard,
                             recompute=Recompute(recompute) if block else Recompute.NONE,
                             offload_optimizer=offload, ep=ep if layer.num_experts else 1, cp=cp)

    layers = tuple(strategy(layer) for layer in model.layers)
    stages = default_stages(model, cluster, workload, layers, pp * virtual_stages, micro_batch_size * dp)
    plan = Plan(name=name, model=model, cluster=cluster, workload=workload, micro_batch_size=micro_batch_size,
                num_micro_batches=m,
                pipeline=PipelineSpec(degree=pp, schedule=sched, virtual_stages=virtual_stages, stages=stages),
                layers=layers)
    return plan.model_copy(update={"prediction": evaluate(plan)})


def default_stages(model: ModelSpec, cluster: ClusterSpec, workload: Workload, layers, chunks: int,
                   micro_batch_seqs: int) -> tuple[tuple[int, int], ...]:
    """Stage ranges balancing each layer's forward + backward time under its strategy."""
    if chunks == 1:
        return ((0, len(model.layers)),)
    ctx = StepContext(cluster=cluster, workload=workload, stage_size=layers[0].devices,
                      micro_batch_seqs=micro_batch_seqs)
    weights = []
    for layer, s in zip(model.layers, layers):
        c = layer_costs(layer, StrategyTable.build([s]), ctx)
        weights.append(float(c.fwd[0] + c.bwd[0]))
    return balanced_stages(weights, chunks)


def _fits(plan: Plan) -> bool:
    return plan.prediction is not None and plan.prediction.fits


def baseline_plans(model: ModelSpec, cluster: ClusterSpec, workload: Workload) -> list[Plan]:
    """The standard recipes, each costed by `evaluate` (infeasible ones kept, with fits=False)."""
    world = cluster.num_gpus
    out: list[Plan] = []
    heads = next((layer for layer in model.layers if has_attention(layer)), None)
    tp = cluster.gpus_per_node
    while tp > 1 and heads is not None and (heads.num_heads % tp or heads.num_kv_heads % tp or world % tp):
        tp //= 2
    meg = None
    for pp in [p for p in range(1, min(world // tp, len(model.layers)) + 1) if (world // tp) % p == 0]:
        for rc in ("none", "full"):
            try:
                cand = manual_plan(model, cluster, workload, tp=tp, pp=pp, sp="megatron" if tp > 1 else "none",
                                   recompute=rc, schedule="1f1b", name="megatron-default")
            except ValueError:
                continue
            if meg is None or _fits(cand):
                meg = cand
            if _fits(cand):
                break
        if meg is not None and _fits(meg):
            break
    if meg is not None:
        out.append(meg)
    per_replica = workload.global_batch // world if workload.global_batch % world == 0 else 0
    sizes = [b for b in range(per_replica, 0, -1) if per_replica % b == 0]
    for name, kwargs in (("fsdp", dict(zero=3)), ("zero1", dict(zero=1)), ("ddp", dict(zero=0))):
        # The largest micro-batch that fits (fewer ZeRO-3 gathers), without recompute if possible.
        best = None
        for rc in ("none", "full"):
            for mbs in sizes:
                cand = manual_plan(model, cluster, workload, recompute=rc, micro_batch_size=mbs, name=name, **kwargs)
                if (best is None or (_fits(cand) and not _fits(best))
                        or (not _fits(best) and cand.prediction.peak_memory < best.prediction.peak_memory)):
                    best = cand  # a fitting one, else the closest to fitting
                if _fits(cand):
                    break
            if best is not None and _fits(best):
                break
        if best is not None:
            out.append(best)
    return out


__all__ = ["manual_plan", "baseline_plans", "default_stages"]
