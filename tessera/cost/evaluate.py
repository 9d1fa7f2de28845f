"""Predict a plan's step time, throughput, MFU and per-stage memory: `evaluate(plan)`.

Step time:
    step = makespan(schedule simulator over chunk times F_c, B_c, W_c, p2p)
           + max over pipeline ranks r of sum_{layers on r} step_l
with F_c = sum of the chunk's layer forwards + re-sharding transitions between adjacent layers of
different layouts, B_c likewise (layer.py gives every per-layer term), W_c the weight-gradient
compute (zero-bubble), and step_l the once-per-step exposed gradient sync and optimizer update.
On time-shared cores (`ClusterSpec.oversubscription` r > 1, a CPU running more ranks than it
has cores; the profiled rates are those with every rank busy): step = max(step / r, the mean over
pipeline ranks of their busy time + tail), since an idle rank's cores speed up the busy ones.
Devices of unequal speed (`ClusterSpec.device_speeds`) and uneven data shares (`Plan.batch_shares`):
each data-parallel replica's pipeline is simulated with its own chunk times and the slowest one
sets the step (cost/hetero.py gives the formula).
Breakdown: bubble = step - busy time and tail of the busiest rank; compute = that rank's pure compute
(m micro-batches) plus its optimizer update; exposed communication = the rest.

MFU = 3 * model forward FLOPs of the step (attention included, recompute excluded)
      / (step * world * peak FLOP/s of the workload dtype)   (bf16 for the usual mixed precision;
      an fp32 run on CPUs is measured against the fp32 peak, not the much lower bf16 one)

Memory of pipeline rank r (chunks r, r + pp, ...):
    allocated = sum of layer model states + in_flight(schedule, r) * sum of layer activations
                + max layer buffer
    total     = allocated + fragmentation * allocated + device reserved bytes
(cost/memory.py gives each term; the LM head's activations are its saved tensors and the logits
the loop holds, its buffer the gradients at the start of backward; `stage_memory` says when the
gradients are counted early). `fits` = the largest
rank total <= device memory * (1 - memory_margin) (cost/memory.py: `memory_budget`) and its
offloaded states (`host`) <= the device's share of host memory.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import numpy as np

from ..plan import MemoryBreakdown, Plan, Prediction
from ..spec.model import LayerKind
from .layer import (LayerCosts, cost_key, StepContext, StrategyTable, layer_costs, pipeline_p2p_time, shape_key,
                    transition_time)
from .hetero import is_uniform, pipeline_rank_speeds, replica_groups
from .schedule import ScheduleResult, in_flight, simulate
from .memory import expert_shard, model_state_bytes
from .tied import TableShards, chunk_rows, sent_rows, tied_copies


def usable_memory(cluster) -> float:
    """Device bytes a plan may use: memory less the planner's margin."""
    return cluster.device.memory_bytes * (1.0 - cluster.memory_margin)


def plan_context(plan: Plan) -> StepContext:
    return StepContext(cluster=plan.cluster, workload=plan.workload, stage_size=plan.stage_size,
                       micro_batch_seqs=plan.micro_batch_size * plan.dp_of_batch)


_shared: dict | None = None  # the memo of `shared_layer_costs`, None outside it


@contextmanager
def shared_layer_costs():
    """Within the block, `evaluate` and its helpers reuse a (layer, strategy, step context)'s costs
    across plans instead of recomputing them (a search scores dozens of plans that differ in a few
    layers; planners that run many searches on one model share them too). The costs are a pure
    function of the key, so the results are identical; the memo holds the models, clusters and
    workloads it has seen (their identity is part of the key) and is dropped when the block ends."""
    global _shared
    if _shared is not None:  # nested: the outer block's memo
        yield
        return
    _shared = {"keep": [], "contexts": {}, "models": {}, "interned": {}}
    try:
        yield
    finally:
        _shared = None


def _layer_keys(model) -> list[tuple]:
    if _shared is None:
        return [cost_key(layer) for layer in model.layers]
    keys = _shared["models"].get(id(model))
    if keys is None:
        _shared["keep"].append(model)  # alive while the memo is: its id stays its own
        # Interned: a small int per distinct cost key (comparing the keys' specs is slow).
        interned = _shared["interned"]
        keys = _shared["models"][id(model)] = [interned.setdefault(cost_key(layer), len(interned))
                                               for layer in model.layers]
    return keys


def _context_memo(ctx: StepContext) -> dict:
    if _shared is None:
        return {}
    key = (id(ctx.cluster), id(ctx.workload), ctx.stage_size, ctx.micro_batch_seqs, ctx.host_layers)
    memo = _shared["contexts"].get(key)
    if memo is None:
        _shared["keep"] += [ctx.cluster, ctx.workload]
        memo = _shared["contexts"][key] = {}
    return memo


def _per_layer_costs(plan: Plan, ctx: StepContext) -> list[LayerCosts]:
    """Costs of each layer's own strategy, computed once per distinct (layer, strategy) (and once
    across plans inside `shared_layer_costs`)."""
    cache = _context_memo(ctx)
    out = []
    copy = plan.pipeline.degree == 1 and tied_copies(plan) is not None
    for i, (layer, lkey, s) in enumerate(zip(plan.model.layers, _layer_keys(plan.model), plan.layers)):
        if copy and i == len(plan.layers) - 1:
            # The LM head tied to an embedding of another layout holds its own copy (cost/tied.py):
            # its states and ZeRO traffic are those of the whole table, plus the exchange.
            costs = layer_costs(layer.model_copy(update={"tied_params": 0}), StrategyTable.build([s]), ctx)
            sync = tied_exchange_seconds(plan, ctx)
            out.append(replace(costs, step=costs.step + sync))
            continue
        key = (lkey, tuple(s.__dict__.values()))  # the strategy's fields: hashed far faster than the model
        costs = cache.get(key)
        if costs is None:
            costs = cache[key] = layer_costs(layer, StrategyTable.build([s]), ctx)
        out.append(costs)
    return out


def tied_exchange_seconds(plan: Plan, ctx: StepContext) -> float:
    """Time of the tied copies' gradient exchange (cost/tied.py): one all-to-all over the stage of
    the largest piece a rank sends (its first rank's, the fullest shard), exposed after backward."""
    from .comm import collective_time

    copies = tied_copies(plan)
    cfg = plan.model.config
    sent = sent_rows(copies, cfg.vocab_size, copies[0].base) * cfg.hidden * plan.workload.grad_bytes
    return float(collective_time(ctx.cluster, "all_to_all", sent, plan.stage_size, 1))


def _scalar(costs: LayerCosts, field: str) -> float:
    return costs.first(field)


def simulate_plan(plan: Plan) -> tuple[ScheduleResult, list[float]]:
    """The schedule simulation of the plan and each pipeline rank's once-per-step tail."""
    return _simulate(plan, plan_context(plan), _per_layer_costs(plan, plan_context(plan)))


def chunk_times(plan: Plan) -> tuple[list[float], list[float], list[float], list[float], float]:
    """Per pipeline chunk: forward, backward and weight-gradient seconds of one micro-batch; per
    pipeline rank its once-per-step tail; and the stage-to-stage hop (what `simulate` is given)."""
    ctx = plan_context(plan)
    return _chunk_times(plan, ctx, _per_layer_costs(plan, ctx))


def layer_times(plan: Plan) -> list[tuple[float, float, float]]:
    """Per layer under its own strategy: (forward, backward, weight-gradient) seconds of one
    micro-batch (what `chunk_times` sums per chunk, without the re-sharding between layers)."""
    ctx = plan_context(plan)
    return [(_scalar(c, "fwd"), _scalar(c, "bwd"), _scalar(c, "wgrad")) for c in _per_layer_costs(plan, ctx)]


def layer_memory(plan: Plan) -> list[tuple[float, float, float]]:
    """Per layer under its own strategy, bytes on one device: (model states, activations of one
    micro-batch, transient buffer) (what `stage_memory` adds up per rank)."""
    ctx = plan_context(plan)
    return [(_scalar(c, "params") + _scalar(c, "grads") + _scalar(c, "optimizer"), _scalar(c, "act"),
             _scalar(c, "buf")) for c in _per_layer_costs(plan, ctx)]


def _chunk_times(plan: Plan, ctx: StepContext, costs: list[LayerCosts], detail: bool = False):
    """`chunk_times`; with `detail`, also per chunk the compute parts of forward and backward and
    per pipeline rank the optimizer update time (what a slower device stretches: cost/hetero.py)."""
    pipe = plan.pipeline
    fwd, bwd, wgrad, cf, cb = [], [], [], [], []
    for start, end in pipe.stages:
        f = sum(_scalar(costs[i], "fwd") for i in range(start, end))
        b = sum(_scalar(costs[i], "bwd") for i in range(start, end))
        w = sum(_scalar(costs[i], "wgrad") for i in range(start, end))
        cf.append(sum(_scalar(costs[i], "compute_fwd") for i in range(start, end)))
        cb.append(sum(_scalar(costs[i], "compute_bwd") for i in range(start, end)))
        for i in range(max(start, 1), end):  # a chunk re-shards its input to its first layer too
            trans = transition_time(plan.model.layers[i].hidden, shape_key(plan.layers[i - 1]),
                                    shape_key(plan.layers[i]), ctx)
            f += trans / 2
            b += trans / 2
        fwd.append(f)
        bwd.append(b)
        wgrad.append(w)
    hidden = max(layer.hidden for layer in plan.model.layers)
    p2p = pipeline_p2p_time(hidden, ctx) if pipe.degree > 1 else 0.0
    tails = [0.0] * pipe.degree
    updates = [0.0] * pipe.degree
    for chunk, (start, end) in enumerate(pipe.stages):
        tails[pipe.rank_of_chunk(chunk)] += sum(_scalar(costs[i], "step") for i in range(start, end))
        updates[pipe.rank_of_chunk(chunk)] += sum(_scalar(costs[i], "optimizer_time") for i in range(start, end))
    if detail:
        return fwd, bwd, wgrad, tails, p2p, cf, cb, updates
    return fwd, bwd, wgrad, tails, p2p


def _simulate(plan: Plan, ctx: StepContext, costs: list[LayerCosts]) -> tuple[ScheduleResult, list[float]]:
    """The schedule simulation of the slowest data-parallel replica and each pipeline rank's tail
    (every replica alike, unless devices differ in speed or replicas in rows: cost/hetero.py)."""
    pipe = plan.pipeline
    fwd, bwd, wgrad, tails, p2p, cf, cb, updates = _chunk_times(plan, ctx, costs, detail=True)
    run = lambda f, b, w: simulate(pipe.schedule.value, f, b, plan.num_micro_batches,  # noqa: E731
                                   pipe.degree, pipe.virtual_stages, p2p, w)
    if is_uniform(plan):
        return run(fwd, bwd, wgrad), tails
    sim = None
    for group in replica_groups(plan):
        slow = [1.0 / group.speeds[pipe.rank_of_chunk(c)] - 1.0 for c in range(len(fwd))]
        rho = group.rows_ratio
        this = run([rho * (f + s * c) for f, s, c in zip(fwd, slow, cf)],
                   [rho * (b + s * c) for b, s, c in zip(bwd, slow, cb)],
                   [rho * w * (1.0 + s) for w, s in zip(wgrad, slow)])
        if sim is None or this.step_time > sim.step_time:
            sim = this
    speeds = pipeline_rank_speeds(plan)
    tails = [t + u * (1.0 / v - 1.0) for t, u, v in zip(tails, updates, speeds)]
    return sim, tails


def stage_memory(plan: Plan, costs: list[LayerCosts] | None = None) -> tuple[MemoryBreakdown, ...]:
    """Peak memory breakdown of each pipeline rank (see the module docstring): states + in-flight
    activations + the largest layer buffer, the same sum the search charges.

    The gradients are counted as alive when the backward starts. They are, when an earlier
    micro-batch of the step made them (m > 1) or DDP keeps them in its buckets (the runtime's DDP
    path over more than one rank). With one micro-batch and no DDP they appear layer by layer
    during the backward instead, as the activations are freed, and the runtime's peak is lower
    by up to the gradient bytes (an upper bound, on the safe side)."""
    ctx = plan_context(plan)
    costs = costs if costs is not None else _per_layer_costs(plan, ctx)
    pipe = plan.pipeline
    # A replica with more rows than the nominal share holds that many more activations.
    rows_scale = max(plan.replica_rows()) * plan.dp_of_batch / plan.workload.global_batch
    out = []
    for r in range(pipe.degree):
        layers = [i for c, (s, e) in enumerate(pipe.stages) if pipe.rank_of_chunk(c) == r for i in range(s, e)]
        k = in_flight(pipe.schedule.value, pipe.degree, r, plan.num_micro_batches, pipe.virtual_stages)
        acts = rows_scale * sum(k * _scalar(costs[i], "act") for i in layers)
        params = sum(_scalar(costs[i], "params") for i in layers)
        grads = sum(_scalar(costs[i], "grads") for i in layers)
        optimizer = sum(_scalar(costs[i], "optimizer") for i in layers)
        buffers = max((_scalar(costs[i], "buf") for i in layers), default=0.0)
        allocated = params + grads + optimizer + acts + buffers
        out.append(MemoryBreakdown(
            params=params, grads=grads, optimizer=optimizer, activations=acts,
            buffers=buffers + plan.cluster.device.reserved_bytes,
            fragmentation=plan.cluster.fragmentation * allocated,
            host=sum(_scalar(costs[i], "host") for i in layers),
        ))
    return tuple(out)


def rank_states(plan: Plan, rank: int, memory: tuple[MemoryBreakdown, ...] | None = None) -> MemoryBreakdown:
    """`stage_memory` of `rank`'s pipeline stage with the rank's own pieces of the vocabulary
    tables. Tensor parallelism cuts a table's V rows into tp blocks of ceil(V / tp), FSDP2 a block
    into S pieces of ceil(rows / S), the last ones shorter or empty (`cost/tied.py` locates a
    rank's); the stage's prediction counts the fullest piece, its first rank's: the memory that
    must fit. A rank's gradients and AdamW moments follow its own piece; its sharded parameter
    storage (the fp32 master in mixed precision) is the fullest piece's size on every rank, as
    FSDP2 pads it. The other categories are the stage's."""
    memory = memory if memory is not None else stage_memory(plan)
    pipe = plan.pipeline
    pp_rank = rank // plan.stage_size
    out = memory[pp_rank]
    copy = pipe.degree == 1 and tied_copies(plan) is not None
    delta = np.zeros(3)
    for c, (start, end) in enumerate(pipe.stages):
        if pipe.rank_of_chunk(c) != pp_rank:
            continue
        for i in range(start, end):
            layer, s = plan.model.layers[i], plan.layers[i]
            if layer.kind not in (LayerKind.EMBEDDING, LayerKind.LM_HEAD) or not layer.vocab_size:
                continue
            shared = layer.tied_params if pipe.degree == 1 and not copy else 0
            where = TableShards.of(s, pp_rank * plan.stage_size, plan.stage_size)
            t = int(where.coordinates[rank - where.base][0])
            tp_start, tp_stop = chunk_rows(layer.vocab_size, s.tp, t)
            piece = where.rows(rank, layer.vocab_size)
            es = expert_shard(s.shard_degree, s.dp * s.cp, s.sp_degree, s.ep)
            args = (layer, plan.workload, s.tp, s.ep, s.zero, s.shard_degree, es, s.offload_optimizer,
                    layer.dense_params - shared)
            first = np.array([float(np.asarray(x)) for x in model_state_bytes(*args)])
            own = np.array([float(np.asarray(x)) for x in model_state_bytes(
                *args, rows=(tp_stop - tp_start, piece[1] - piece[0]))])
            d = own - first
            if s.shard_degree > 1:  # FSDP2 stores every rank's sharded parameter padded to the fullest piece
                wl = plan.workload
                master = 0 if wl.dtype == "fp32" else 4  # that storage is the fp32 master in mixed precision
                d[0] = 0.0 if s.zero >= 3 else d[0]
                d[2] *= (wl.optimizer_bytes - master) / wl.optimizer_bytes if wl.optimizer_bytes else 0.0
            delta += d
    return out.model_copy(update={"params": float(out.params + delta[0]), "grads": float(out.grads + delta[1]),
                                  "optimizer": float(out.optimizer + delta[2])})


def model_flops_per_step(plan: Plan) -> float:
    """3 x forward FLOPs of a step (attention included, recompute excluded)."""
    wl = plan.workload
    return 3.0 * plan.model.flops_per_token(wl.seq_len) * wl.tokens_per_step


def evaluate(plan: Plan) -> Prediction:
    """The cost model's prediction for `plan` (pure: the plan is not modified)."""
    ctx = plan_context(plan)
    costs = _per_layer_costs(plan, ctx)
    sim, tails = _simulate(plan, ctx, costs)
    step = sim.step_time + max(tails)
    r = plan.cluster.oversubscription
    if r > 1:  # time-shared cores: no faster than the critical path alone, nor than all the work
        step = max(step / r, float(np.mean([b + t for b, t in zip(sim.busy, tails)])))
    pipe, m = plan.pipeline, plan.num_micro_batches
    crit = int(np.argmax(sim.busy))
    crit_layers = [i for c, (s, e) in enumerate(pipe.stages) if pipe.rank_of_chunk(c) == crit for i in range(s, e)]
    compute = sum(m * (_scalar(costs[i], "compute_fwd") + _scalar(costs[i], "compute_bwd"))
                  + _scalar(costs[i], "optimizer_time") for i in crit_layers)
    bubble = max(0.0, step - tails[crit] - sim.busy[crit])
    memory = stage_memory(plan, costs)
    flops = plan.cluster.device.peak_flops
    peak = plan.workload.dtype if plan.workload.dtype in flops else "bf16"
    mfu = model_flops_per_step(plan) / (step * plan.world_size * plan.cluster.peak(peak))
    return Prediction(
        step_time_s=step, tokens_per_s=plan.workload.tokens_per_step / step, mfu=mfu,
        stage_memory=memory, compute_s=compute, exposed_comm_s=max(0.0, step - compute - bubble),
        bubble_s=bubble, fits=(max(mb.total for mb in memory) <= usable_memory(plan.cluster)
                               and max(mb.host for mb in memory) <= plan.cluster.host_memory_bytes))
