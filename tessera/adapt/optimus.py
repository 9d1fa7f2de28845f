"""Optimus-style scheduling: the vision encoder's forward and backward in the LLM pipeline's bubbles.

The LLM runs a 1F1B pipeline (its plan from the search, pp stages of n = N / pp devices). Every
pipeline rank also holds a replica of the encoder (its own plan on n devices,
`search.multimodal.PartPricer`), so encoder work can run on a rank while its LLM stage idles.
This prices the placement the runtime executes (`runtime/vlm_pipeline.py`), which is coarser
than filling every idle interval: a rank runs its encoder forward passes in its warm-up bubble
(before its first LLM forward) and its backward passes in its cool-down bubble (after its last
LLM backward); the idle time between a rank's LLM operations stays idle, because
torch.distributed.pipelining's 1F1B fuses a forward's send with the next backward's receive, so
work placed there would hold back the next stage. Which rank encodes how many whole images of
which micro-batch, S (the step starts S earlier) and E (it ends E later) come from
`adapt.bubbles.assign` (its docstring has the formulas; `compare` refines its chosen plan's
placement with `bubbles.refine`, also tries per-rank encoder recompute (below), then solves the
best placement found and the most promising per-rank choice exactly with `bubbles.exact`, a
MILP, side by side, and keeps the fastest), with
    D_j = start of stage 0's forward of j - hop,  R_j = end of stage 0's backward of j + hop,
hop = the point-to-point hand-off of a micro-batch's image tokens (or their gradient) into stage
0's group, and f(a), b(a) the encoder's forward / backward seconds for a pass of a images on a
rank group (`encoder_pass_times`: its plan, chosen for the even share of m ceil(I / (m pp))
images, priced as one micro-batch of ceil(a / d) images on each of its d data-parallel devices:
a pass re-gathers ZeRO-3 parameters however few images it holds).
    step = S + T + E + LLM tail + encoder tail + all-reduce of the encoder's gradient shards
           over the pp replicas (2 P_E / n bytes).
Memory: pipeline rank r adds its encoder replica's states and buffers and the activations of
every image it encodes, held from forward to backward, to its own LLM stage's peak (1F1B's later
stages hold fewer micro-batches), so the placement caps each rank's images at what its usable
memory holds; the encoder's fastest plan, its leanest (full recompute, ZeRO-3) and the leanest
that keeps its parameters gathered over the step (full recompute, ZeRO-2: `_encoder_plans`) are
all placed and the fastest step is taken (none fitting is refused in one line). Refined, each
rank's replica may also recompute fewer blocks where its memory holds more (`_rank_plans`: its
passes are then faster, and the runtime wraps only those blocks).

Baseline (`extra_stage_baseline`): the encoder as extra pipeline work, Megatron-style: the
encoder's layers (priced on n devices for one micro-batch of an LLM micro-batch's images, the
slowest device's ceil(images / d) of them, as a pass is) go in front of the
LLM's layers and the chain is re-split into pp stages minimising the slowest stage, simulated with
the same 1F1B simulator; the best over the same pipeline plans. Its memory is checked as the
search checks a pipeline rank's: rank r holds its layers' states, min(pp - r, m) micro-batches of
their activations (the encoder layers' per LLM micro-batch) and the largest buffer, within the
budget; the re-split is the min-max split among those that fit (none: that pipeline plan has no
baseline). No torch import.
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..cost.comm import collective_times
from ..cost.evaluate import chunk_times, evaluate, layer_memory, layer_times, shared_layer_costs, usable_memory
from ..cost.memory import memory_budget, required_memory
from ..cost.schedule import in_flight, simulate
from ..errors import TesseraError
from ..plan import Plan, Recompute
from ..spec.model import LayerKind
from ..search.multimodal import LEAN_OPTIONS, PartCost, PartPricer, group_handoff_s, part_cost, sub_cluster
from ..search.planner import NoFeasiblePlanError, search
from ..search.space import SearchOptions, divisors
from ..spec.tasks import TaskSpec
from ..spec.workload import Workload
from .bubbles import EXACT_MAX_PAIRS, PassTime, PipelineWindows, PlacementProblem, assign, least_extra, refine

GiB = 2**30
LEAN_ENCODER = LEAN_OPTIONS


@dataclass(frozen=True)
class Piece:
    rank: int
    kind: str  # "EF" / "EB" (encoder work) or the LLM's "F" / "B"
    micro_batch: int
    start: float
    end: float


@dataclass(frozen=True)
class OptimusResult:
    pp: int
    num_micro_batches: int
    llm_plan: Plan
    encoder: PartCost
    pipeline_s: float  # the LLM pipeline's makespan T
    shift_s: float  # S
    extension_s: float  # E
    tail_s: float
    pieces: tuple[Piece, ...]
    counts: tuple[tuple[int, ...], ...] = ()  # [pipeline rank][micro-batch] images it encodes (adapt/bubbles.py)
    least_extra_s: float = 0.0  # no placement in these bubbles has S + E below this (bubbles.least_extra, .exact)
    placement_optimal: bool = False  # `bubbles.exact` proved the placement optimal
    problem: PlacementProblem | None = None  # what the placement was chosen from
    # Each pipeline rank's encoder replica: `encoder`, or a variant of it that recomputes fewer
    # blocks on a rank whose memory holds more (`_rank_plans`); () = `encoder` on every rank.
    encoder_by_rank: tuple[PartCost, ...] = ()

    def rank_encoder(self, rank: int) -> PartCost:
        return self.encoder_by_rank[rank] if self.encoder_by_rank else self.encoder

    def describe_encoder(self) -> str:
        """The encoder's plan, and how many blocks each pipeline rank's replica recomputes where
        they differ from it."""
        out = self.encoder.describe()
        if any(e is not self.encoder for e in self.encoder_by_rank):
            counts = [len(recomputed_blocks(e.plan)) for e in self.encoder_by_rank]
            out += f"; blocks recomputed per pipeline rank {counts}"
        return out

    @property
    def step_s(self) -> float:
        return self.shift_s + self.pipeline_s + self.extension_s + self.tail_s

    def bubble_filled(self) -> float:
        """Fraction of the LLM pipeline's idle rank-time that encoder work fills."""
        idle = sum(_idle_total(self.pieces, r, self.pipeline_s) for r in range(self.pp))
        used = sum(min(p.end, self.pipeline_s) - max(p.start, 0.0) for p in self.pieces
                   if p.kind in ("EF", "EB") and p.end > 0 and p.start < self.pipeline_s)
        return used / idle if idle > 0 else 0.0


def _block_layers(enc_plan: Plan) -> list[int]:
    """The indices, among `enc_plan`'s layers, of the encoder's blocks (its ENCODER layers), in order."""
    return [i for i, layer in enumerate(enc_plan.model.layers) if layer.kind == LayerKind.ENCODER]


def recomputed_blocks(enc_plan: Plan) -> tuple[int, ...]:
    """The encoder blocks (numbered 0.. in order, as the runtime's encoder runs them) that
    `enc_plan` recomputes."""
    return tuple(b for b, i in enumerate(_block_layers(enc_plan)) if enc_plan.layers[i].recompute != Recompute.NONE)


@dataclass(frozen=True)
class ExtraStageResult:
    pp: int
    num_micro_batches: int
    stages: tuple[tuple[int, int], ...]  # layer ranges of the encoder + LLM chain
    encoder_layers: int
    step_s: float
    pipeline_s: float
    tail_s: float
    pieces: tuple[Piece, ...]
    peak_bytes: float = 0.0  # the fullest pipeline rank's device memory (fragmentation and reserve included)


def _idle_total(pieces, rank: int, horizon: float) -> float:
    busy = sum(p.end - p.start for p in pieces if p.rank == rank and p.kind in ("F", "B"))
    return horizon - busy


def llm_pipeline_plans(pricer: PartPricer, task: TaskSpec, gpus: int, degrees=(4, 8)) -> list[Plan]:
    """At each pipeline degree, the LLM's fastest 1F1B plan and its fastest with the widest
    tensor parallelism of a node (those that fit). The fastest plan alone is not enough: the
    encoder changes which LLM plan is best, and the widest TP leaves the most memory (and
    micro-batches) beside the LLM's stage, for Optimus's encoder replicas and for the extra-stage
    baseline's encoder layers alike: at 12 tiles of benchmarks/multimodal.py the baseline's best
    is pp8 with tp8 where the LLM alone prefers tp4. (Narrower TP than the fastest plan's only
    leaves less memory; tp2 of a 70B LLM fits neither.)"""
    vlm = pricer.vlm
    wl = Workload(global_batch=task.batch, seq_len=task.llm_seq_len(vlm), dtype=pricer.dtype)
    cluster = sub_cluster(pricer.cluster, gpus)
    plans = []
    for pp in degrees:
        if gpus % pp or vlm.config.llm.num_layers < pp:
            continue
        widest = max(divisors(min(cluster.gpus_per_node, gpus // pp)))
        for tp in (None, widest):
            opts = SearchOptions(pp=pp, tp=tp, schedules=("1f1b",), allow_offload=False, allow_ulysses=False,
                                 zero_stages=(1,), runner_ups=0, max_splits=1)
            try:
                with shared_layer_costs():
                    plan = search(vlm.llm, cluster, wl, opts)
            except NoFeasiblePlanError:
                continue
            if all(p.layers != plan.layers or p.num_micro_batches != plan.num_micro_batches for p in plans):
                plans.append(plan)
    return plans


def _llm_events(plan: Plan):
    fwd, bwd, wgrad, tails, p2p = chunk_times(plan)
    pipe = plan.pipeline
    sim = simulate("1f1b", fwd, bwd, plan.num_micro_batches, pipe.degree, 1, p2p)
    return sim, tails


def optimus_schedule(pricer: PartPricer, task: TaskSpec, plan: Plan, lean: bool = True,
                     beat: float = math.inf, refined: bool = False, meanwhile=None) -> OptimusResult | None:
    """Encoder work in the bubbles of `plan` (an LLM pipeline plan); see the module docstring.
    `lean=False`: only the encoder's plan from the pricer's options (not the leanest). None when
    no placement can make a step shorter than `beat` (`bubbles.least_extra` shows it unplaced).
    `refined`: each placement also improved by moving images between ranks (`bubbles.refine`),
    the encoder's recompute also chosen per pipeline rank (`_rank_plans`), and the fastest
    placement solved exactly (`bubbles.exact`, up to `bubbles.EXACT_MAX_PAIRS` rank and
    micro-batch pairs): slower, so `compare` refines only its best plan's. `meanwhile`: called
    once, while the MILPs run (they leave the interpreter free), or at the end."""
    vlm, cluster = pricer.vlm, pricer.cluster
    pp, m, n = plan.pipeline.degree, plan.num_micro_batches, plan.stage_size
    images = task.images()
    per_mb = [images // m + (j < images % m) for j in range(m)]
    per_group = m * math.ceil(images / (m * pp))  # the even share of whole images, as priced
    sim, tails = _llm_events(plan)
    hop = group_handoff_s(cluster, vlm, images / m, n)
    windows = PipelineWindows.from_events(sim.events, pp, m, sim.step_time, hop)
    # The encoder's fastest plan, its leanest (full recompute, ZeRO-3) and the lean one that keeps
    # its parameters gathered (ZeRO-2): a rank keeps its images' activations from its forward
    # passes to its backward passes, so the fastest may hold too few images per rank for a good
    # placement, or none; ZeRO-3 re-gathers in every pass, ZeRO-2 holds a full copy.
    best, why, beaten = None, "", False

    def problem_of(by_rank, prune: bool = True):
        """Rank r's replica under by_rank[r]'s plan: (its placement problem, the encoder's tail, a
        lower bound on S + E), None when it cannot beat `beat` or the best so far (`prune`), or
        why it does not fit."""
        passes = [pricer.derived(e, ("passes", max(per_mb)), lambda e=e: encoder_pass_times(e.plan, max(per_mb)))
                  for e in by_rank]
        pass_f, pass_b = tuple(x[0] for x in passes), tuple(x[1] for x in passes)
        to_beat = min(beat, sim.step_time + best[0] + max(tails)) if best else beat
        least = least_extra(windows, per_mb, pass_f, pass_b)
        if prune and sim.step_time + least + max(tails) >= to_beat:
            return None
        limits = tuple(_max_images(plan, e, per_group, r) for r, e in enumerate(by_rank))
        if min(limits) < 0:  # every rank holds a replica
            return _memory_refusal(plan, by_rank, [0] * pp)
        return PlacementProblem(windows, tuple(per_mb), pass_f, pass_b, limits), max(e.tail_s for e in by_rank), least

    def place(by_rank):
        """`problem_of`'s, placed: (S + E + the encoder's tail, placement, lower bound, problem)."""
        got = problem_of(by_rank)
        if got is None or isinstance(got, str):
            return got
        problem, tail, least = got
        placed = assign(windows, per_mb, problem.f, problem.b, problem.limit)
        if placed is not None and refined:
            placed = refine(windows, placed, problem.f, problem.b, problem.limit)
        if placed is None:
            return _memory_refusal(plan, by_rank, [math.ceil(images / pp)] * pp)
        try:
            _check_memory(plan, by_rank, placed.images_per_rank)
        except TesseraError as e:
            return str(e)
        return placed.shift_s + placed.extension_s + tail, placed, least, problem

    def consider(enc, by_rank, relaxed=math.inf):
        """Place it; keep the best (and, refined, the per-rank choice of the lowest `relaxed`)."""
        nonlocal best, why, beaten, promising
        got = place(by_rank)
        if got is None:
            beaten = beaten or best is None
        elif isinstance(got, str):
            why = got
        else:
            found = (got[0], enc, by_rank, *got[1:])
            if best is None or got[0] < best[0]:
                best = found
            if relaxed < math.inf and (promising is None or relaxed < promising[0]):
                promising = (relaxed, found)

    # Refined, the chosen placements are solved exactly (a MILP: too slow for every plan, and for
    # the largest pipelines): the best placement found and the per-rank recompute choice whose
    # relaxation promises the most (the heuristic placement can miss it by far), side by side
    # (HiGHS runs without the GIL), the latter from as soon as it is known.
    exact = refined and pp * m <= EXACT_MAX_PAIRS
    pool = ThreadPoolExecutor(2) if exact else None
    solving: dict[int, object] = {}  # id(by_rank) -> its MILP's future
    try:
        promising, encoders = None, []
        for enc in _encoder_plans(pricer, n, per_group, lean):
            if not enc.feasible:
                why = f"encoder placement on every pipeline rank ({n} GPUs each) does not fit: {enc.why}"
                continue
            encoders.append(enc)
            consider(enc, (enc,) * pp)
        if refined and best is not None:
            # Each encoder plan's replicas may also recompute fewer blocks on the ranks whose memory
            # holds more (`_rank_plans`: priced per rank, slower, like `refine`).
            per_rank = [(enc, by_rank, relaxed) for enc in encoders
                        for by_rank, relaxed in _rank_plans(pricer, plan, enc, per_group, per_mb, windows)]
            if pool is not None and per_rank:
                _, first, _ = min(per_rank, key=lambda c: c[2])
                got = problem_of(first, prune=False)
                if isinstance(got, tuple):
                    solving[id(first)] = pool.submit(got[0].solve)
            for enc, by_rank, relaxed in per_rank:
                consider(enc, by_rank, relaxed)
        if best is None:
            if meanwhile is not None:
                meanwhile()
            if beaten:
                return None
            raise TesseraError(why)
        optimal = False
        if exact:
            chosen = [best] + ([promising[1]] if promising and promising[1] is not best else [])
            for c in chosen:
                if id(c[2]) not in solving:
                    solving[id(c[2])] = pool.submit(c[5].solve)
            if meanwhile is not None:
                meanwhile()
                meanwhile = None
            done = None
            for value, enc, by_rank, placed, least, problem in chosen:
                solved, proven = solving[id(by_rank)].result(), False
                if solved is not None:  # then refined by moves (the MILP stops at a fixed node count)
                    least = max(least, solved.bound_s)
                    better = refine(windows, solved.placed, problem.f, problem.b, problem.limit)
                    if better.shift_s + better.extension_s < placed.shift_s + placed.extension_s:
                        _check_memory(plan, by_rank, better.images_per_rank)  # within the limits: holds
                        value += better.shift_s + better.extension_s - placed.shift_s - placed.extension_s
                        placed, proven = better, solved.optimal
                if done is None or value < done[0]:
                    done = (value, enc, by_rank, placed, least, problem, proven)
            _, enc, by_rank, placed, least, problem, optimal = done
        else:
            _, enc, by_rank, placed, least, problem = best
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    if meanwhile is not None:
        meanwhile()
    pieces = [Piece(p.rank, p.kind, p.micro_batch, p.start, p.end) for p in placed.passes]
    pieces += [Piece(e.stage, e.kind, e.micro_batch, e.start, e.end) for e in sim.events]
    combine = float(collective_times(cluster, "all_reduce", 2.0 * pricer.model("vision_encoder").num_params / n,
                                     pp, n)) if pp > 1 else 0.0
    return OptimusResult(pp, m, plan, enc, sim.step_time, placed.shift_s, placed.extension_s,
                         max(tails) + max(e.tail_s for e in by_rank) + combine, tuple(pieces), placed.counts,
                         least_extra_s=least, placement_optimal=optimal, problem=problem,
                         encoder_by_rank=tuple(by_rank))


def encoder_pass_times(enc_plan: Plan, most_images: int) -> tuple[PassTime, PassTime]:
    """Forward and backward `PassTime`s of the encoder's plan (pp = 1) on its rank group: its
    strategies priced by the cost model for one micro-batch of k = 1 .. ceil(most_images / d)
    images per device (d: the devices holding different images), so that a pass pays what its
    size costs: a ZeRO-3 encoder gathers every layer's parameters again in each pass's forward
    and backward and reduce-scatters its gradients after each, hidden behind a large pass's
    compute but not behind a one-image pass's."""
    d = enc_plan.dp_of_batch
    fwd, bwd = [], []
    for k in range(1, max(1, math.ceil(most_images / d)) + 1):
        f, b, _, _, _ = chunk_times(_one_micro_batch(enc_plan, k))
        fwd.append(f[0])
        bwd.append(b[0])
    return PassTime.from_table(fwd, d), PassTime.from_table(bwd, d)


def _encoder_plans(pricer: PartPricer, n: int, images: int, lean: bool = True) -> list[PartCost]:
    """The encoder plans placed on a rank group of n devices (for `images` images a step): its
    fastest (the pricer's options), its leanest (full recompute, ZeRO-3) and the lean one with its
    parameters kept gathered over the step (ZeRO-2: one gather, a full copy per device, gradients
    reduce-scattered after each pass). Whole-step pricing cannot tell the last two apart (one
    gather either way), but a step of small passes re-gathers under ZeRO-3 only."""
    seq = pricer.vlm.encoder_seq_len
    plans = [pricer.cost("vision_encoder", n, images, seq, pricer.encoder_options)]
    if lean:
        lean_plan = pricer.cost("vision_encoder", n, images, seq, LEAN_ENCODER)
        plans.append(lean_plan)
        if lean_plan.feasible:
            kept = pricer.derived(lean_plan, ("gathered",), lambda: _kept_gathered(lean_plan))
            if kept is not None:
                plans.append(kept)
    return plans


def _rank_plans(pricer: PartPricer, plan: Plan, enc: PartCost, per_group: int, per_mb: list[int],
                windows: PipelineWindows) -> list[tuple[tuple[PartCost, ...], float]]:
    """Choices of each pipeline rank's encoder plan beside `enc` on every rank, each with the S + E
    of its relaxation: when `enc` recomputes its blocks, one whose rank r recomputes only as many
    of them as its memory needs (`_recompute_shares`: 1F1B's later stages hold fewer LLM
    micro-batches and have the longest bubbles, so they have the room and take the most images);
    [] when there is none."""
    layers = _block_layers(enc.plan)
    blocks = [layers[b] for b in recomputed_blocks(enc.plan)]  # their layer indices
    if not blocks:
        return []
    bare = pricer.derived(enc, ("recompute", 0), lambda: _variant(enc, {"recompute": Recompute.NONE}, "no recompute",
                                                                  only=set(blocks)))
    shares = _recompute_shares(plan, enc, bare, per_group, sum(per_mb), windows, len(blocks))
    if shares is None or all(k == len(blocks) for k in shares[0]):
        return []
    counts, relaxed = shares

    def partial(k: int) -> PartCost:
        if k == len(blocks):
            return enc
        return pricer.derived(enc, ("recompute", k), lambda: _variant(
            enc, {"recompute": Recompute.NONE}, f"recompute {k} of {len(blocks)} blocks", only=set(blocks[k:])))
    return [(tuple(partial(k) for k in counts), relaxed)]


def _recompute_shares(plan: Plan, enc: PartCost, bare: PartCost, per_group: int, images: int,
                      windows: PipelineWindows, blocks: int) -> tuple[tuple[int, ...], float] | None:
    """How many of the encoder's `blocks` blocks each pipeline rank's replica recomputes: a linear
    programme (HiGHS) places n_r images on rank r, q_r of them as if without recompute, minimising
    S + E with the forward work in rank r's warm-up bubble plus S, the backward work in its
    cool-down bubble plus E and the activations in the memory its LLM stage leaves (per image:
    the seconds of a pass of the even share, images divisible, deadlines and releases left out);
    rank r then recomputes ceil((1 - q_r / n_r) blocks) blocks, so that its n_r images fit. With
    the programme's S + E; None when it has no solution."""
    from scipy.optimize import linprog

    pp, w = plan.pipeline.degree, windows
    usable = usable_memory(plan.cluster)
    fe, be, bb = enc.fwd_s / per_group, enc.bwd_s / per_group, bare.bwd_s / per_group
    ae, ab = _activations_per_image(enc, per_group), _activations_per_image(bare, per_group)
    room = [usable - max(_encoder_bytes(plan, e, r, 0)[0] for e in (enc, bare)) for r in range(pp)]
    nv = 2 * pp + 2  # n_0..n_{pp-1}, q_0..q_{pp-1}, S, E
    rows, rhs = [], []
    for r in range(pp):
        for terms, bound in (({r: fe, 2 * pp: -1.0}, w.warm[r]),
                             ({r: be, pp + r: -(be - bb), 2 * pp + 1: -1.0}, w.horizon - w.cool[r]),
                             ({r: ae, pp + r: ab - ae}, max(room[r], 0.0)),
                             ({pp + r: 1.0, r: -1.0}, 0.0)):
            row = np.zeros(nv)
            for i, v in terms.items():
                row[i] = v
            rows.append(row)
            rhs.append(bound)
    cost = np.zeros(nv)
    cost[2 * pp:] = 1.0
    equal = np.zeros((1, nv))
    equal[0, :pp] = 1.0
    res = linprog(cost, A_ub=np.array(rows), b_ub=rhs, A_eq=equal, b_eq=[images], bounds=[(0, None)] * nv,
                  method="highs")
    if res.x is None:
        return None
    n, q = res.x[:pp], res.x[pp:2 * pp]
    return tuple(0 if n[r] <= 1e-9 else min(blocks, math.ceil((1.0 - q[r] / n[r]) * blocks - 1e-6))
                 for r in range(pp)), float(res.fun)


def _variant(enc: PartCost, update: dict, suffix: str, only=None) -> PartCost | None:
    """`enc`'s plan with `update` on its layers (those whose indices are in `only`, when given),
    re-priced (None: nothing changes)."""
    layers = tuple(s.model_copy(update=update) if only is None or i in only else s
                   for i, s in enumerate(enc.plan.layers))
    if layers == tuple(enc.plan.layers):
        return None
    plan = enc.plan.model_copy(update={"layers": layers})
    plan = plan.model_copy(update={"prediction": evaluate(plan), "name": f"{enc.plan.name} {suffix}"})
    return part_cost(enc.part, plan)


def _kept_gathered(enc: PartCost) -> PartCost | None:
    """`enc`'s plan with its ZeRO-3 layers at ZeRO-2 (None: none is ZeRO-3, or it does not fit)."""
    kept = _variant(enc, {"zero": 2}, "zero2", only={i for i, s in enumerate(enc.plan.layers) if s.zero == 3})
    return kept if kept is not None and kept.plan.prediction.fits else None


def _one_micro_batch(plan: Plan, k: int) -> Plan:
    """`plan`'s strategies for one micro-batch of k sequences on each data-parallel device."""
    wl = plan.workload.model_copy(update={"global_batch": k * plan.dp_of_batch})
    return plan.model_copy(update={"workload": wl, "micro_batch_size": k, "num_micro_batches": 1, "batch_shares": ()})


def _activations_per_image(enc: PartCost, images: int) -> float:
    """Bytes of activations (fragmentation included) a device of the encoder's plan holds per image of
    the `images` its rank group was priced for, from the image's forward to its backward."""
    p = enc.plan
    mem = p.prediction.stage_memory[0]
    held = in_flight(p.pipeline.schedule.value, 1, 0, p.num_micro_batches)  # micro-batches `mem` holds
    return mem.activations / held * p.num_micro_batches / images * (1.0 + p.cluster.fragmentation)


def _encoder_bytes(plan: Plan, enc: PartCost, rank: int, images: int) -> tuple[float, float]:
    """(pipeline rank `rank`'s peak bytes, the encoder's part of it) when it encodes `images` images
    in a step: its LLM stage's peak (`plan`'s prediction for that stage: 1F1B holds fewer
    micro-batches on later stages) + the encoder replica's states and buffers + the activations
    of those images, held from their forward to their backward."""
    p = enc.plan
    mem = p.prediction.stage_memory[0]
    fixed = mem.total - p.cluster.device.reserved_bytes - mem.activations * (1.0 + p.cluster.fragmentation)
    extra = fixed + _activations_per_image(enc, p.workload.global_batch) * images
    return plan.prediction.stage_memory[rank].total + extra, extra


def _max_images(plan: Plan, enc: PartCost, per_group: int, rank: int) -> int:
    """The most images pipeline rank `rank` may encode in a step (`_encoder_bytes` within the usable
    memory); at most -1 when not even the encoder's states fit."""
    per_image = _activations_per_image(enc, per_group)
    peak, _ = _encoder_bytes(plan, enc, rank, 0)
    room = usable_memory(plan.cluster) - peak
    if room < 0:
        return -1
    return int(math.floor(room / per_image)) if per_image > 0 else 1 << 40


def _memory_refusal(plan: Plan, by_rank, images) -> str:
    rank = max(range(len(by_rank)), key=lambda r: _encoder_bytes(plan, by_rank[r], r, images[r])[0])
    peak, extra = _encoder_bytes(plan, by_rank[rank], rank, images[rank])
    return (f"encoder placement in the pipeline bubbles does not fit: pipeline rank {rank} needs {peak / GiB:.1f} GiB "
            f"(LLM stage {plan.prediction.stage_memory[rank].total / GiB:.1f} + encoder {extra / GiB:.1f} for "
            f"{images[rank]} images) of {usable_memory(plan.cluster) / GiB:.1f} GiB usable")


def _check_memory(plan: Plan, by_rank, images) -> None:
    """Each pipeline rank holds its LLM stage and its encoder replica (`by_rank[r]`) with the
    activations of the images[r] images it encodes."""
    if any(_encoder_bytes(plan, e, r, k)[0] > usable_memory(plan.cluster) for r, (e, k) in
           enumerate(zip(by_rank, images))):
        raise TesseraError(_memory_refusal(plan, by_rank, images))


def _min_max_split(weights: list[float], parts: int, fits=None) -> list[tuple[int, int]] | None:
    """Contiguous split of `weights` into `parts` ranges minimising the largest sum (binary search
    on the bound, greedy check). `fits(r, start, end)`: whether range [start, end) fits as the
    r-th range (memory; monotone: a sub-range of a range that fits fits, at the same or a later
    index), so the greedy's furthest reach stays optimal; None when no split fits."""
    ok = fits or (lambda r, s, e: True)

    def cuts(bound):
        out, start, acc = [], 0, 0.0
        for i, w in enumerate(weights):
            if i > start and (acc + w > bound or not ok(len(out), start, i + 1)):
                out.append((start, i))
                start, acc = i, 0.0
            acc += w
        out.append((start, len(weights)))
        return out if all(ok(r, s, e) for r, (s, e) in enumerate(out)) else None

    def feasible(split):
        return split is not None and len(split) <= parts
    lo, hi = max(weights), sum(weights)
    if not feasible(cuts(hi)):
        return None
    while hi - lo > 1e-7 * hi:  # a split's bound to 1e-7: ties below that are not worth telling apart
        mid = (lo + hi) / 2
        if feasible(cuts(mid)):
            hi = mid
        else:
            lo = mid
    split = cuts(hi)
    while len(split) < parts:  # split the widest range further so every rank gets layers
        k = max(range(len(split)), key=lambda i: split[i][1] - split[i][0])
        s, e = split[k]
        split[k:k + 1] = [(s, (s + e) // 2), ((s + e) // 2, e)]
    return split


def extra_stage_baseline(pricer: PartPricer, task: TaskSpec, plan: Plan) -> ExtraStageResult:
    """The encoder as extra pipeline work on `plan`'s pipeline (see the module docstring)."""
    vlm = pricer.vlm
    n = plan.stage_size
    best, why = None, ""
    # The same encoder plans as Optimus places: the stages that hold encoder layers keep up to pp
    # micro-batches of their activations, so a lean one may be the only one that fits, or fit a
    # better split.
    images = task.images()
    for enc in _encoder_plans(pricer, n, images):
        if not enc.feasible:
            why = f"encoder as a pipeline stage on {n} GPUs does not fit: {enc.why}"
            continue
        try:
            result = _extra_stage(enc, plan, images, pricer)
        except TesseraError as e:
            why = str(e)
            continue
        if best is None or result.step_s < best.step_s:
            best = result
    if best is None:
        raise TesseraError(why)
    return best


def _extra_stage(enc: PartCost, plan: Plan, images: int, pricer: PartPricer) -> ExtraStageResult:
    pp, m = plan.pipeline.degree, plan.num_micro_batches
    # The encoder layers run each LLM micro-batch's images as one micro-batch of their own (the
    # slowest device holding ceil(images / d)): timed and sized at that micro-batch, as
    # `encoder_pass_times` prices a pass.
    k = math.ceil(math.ceil(images / m) / enc.plan.dp_of_batch)

    def encoder_layers():
        variant = _one_micro_batch(enc.plan, k)
        return [(f, b) for f, b, _ in layer_times(variant)], layer_memory(variant)
    enc_layers, enc_memory = pricer.derived(enc, ("layers", k), encoder_layers)
    llm_layers = [(f, b) for f, b, _ in layer_times(plan)]
    chain = enc_layers + llm_layers
    memory = enc_memory + layer_memory(plan)
    fits = _stage_memory_check(memory, pp, m, memory_budget(plan.cluster))
    split = _min_max_split([f + b for f, b in chain], pp, fits)
    if split is None:
        raise TesseraError(f"the encoder as extra pipeline stages does not fit in memory at pp={pp} (m={m})")
    peak = max(fits.allocated(r, s, e) for r, (s, e) in enumerate(split))
    fwd = [sum(chain[i][0] for i in range(s, e)) for s, e in split]
    bwd = [sum(chain[i][1] for i in range(s, e)) for s, e in split]
    _, _, _, tails, p2p = chunk_times(plan)
    sim = simulate("1f1b", fwd, bwd, m, pp, 1, p2p)
    tail = max(tails) + enc.tail_s
    pieces = tuple(Piece(e.stage, e.kind, e.micro_batch, e.start, e.end) for e in sim.events)
    return ExtraStageResult(pp, m, tuple(split), len(enc_layers), sim.step_time + tail, sim.step_time, tail, pieces,
                            peak_bytes=required_memory(peak, plan.cluster))


class _stage_memory_check:
    """fits(r, start, end): the chain's layers [start, end) as 1F1B pipeline rank r fit, i.e.
    states + min(pp - r, m) x activations (per LLM micro-batch) + the largest buffer <= budget
    (bytes allocated, as cost/memory.py's budget); prefix sums make each check O(range)."""

    def __init__(self, memory: list[tuple[float, float, float]], pp: int, m: int, budget: float):
        self.states = np.concatenate([[0.0], np.cumsum([x[0] for x in memory])])
        self.act = np.concatenate([[0.0], np.cumsum([x[1] for x in memory])])
        self.buf = [x[2] for x in memory]
        self.pp, self.m, self.budget = pp, m, budget
        self.k = [in_flight("1f1b", pp, r, m) for r in range(pp)]
        self._run = (-1, -1, 0.0)  # (start, end, largest buffer of [start, end)): the greedy grows ranges by one

    def allocated(self, r: int, start: int, end: int) -> float:
        s, e, buf = self._run
        if s == start and e == end - 1:
            buf = max(buf, self.buf[end - 1])
        elif not (s == start and e == end):
            buf = max(self.buf[start:end])
        self._run = (start, end, buf)
        return (float(self.states[end] - self.states[start])
                + self.k[min(r, self.pp - 1)] * float(self.act[end] - self.act[start]) + buf)

    def __call__(self, r: int, start: int, end: int) -> bool:
        return self.allocated(r, start, end) <= self.budget


def compare(pricer: PartPricer, task: TaskSpec, gpus: int, degrees=(4, 8)):
    """(best Optimus result, best extra-stage baseline) over the LLM's pipeline plans."""
    with shared_layer_costs():  # the plans' layer costs, computed once for all the pricing below
        return _compare(pricer, task, gpus, degrees)


def _compare(pricer: PartPricer, task: TaskSpec, gpus: int, degrees):
    plans = llm_pipeline_plans(pricer, task, gpus, degrees)
    if not plans:
        raise TesseraError(f"task '{task.name}': the LLM has no pipeline plan on {gpus} GPUs")
    best_o, why = None, ""
    # An Optimus step is at least its LLM plan's (S, E, the encoder's tail and combine are >= 0):
    # pipeline plans no faster than the best Optimus step found are not scheduled (fastest first).
    for plan in sorted(plans, key=lambda p: p.prediction.step_time_s):
        if best_o is not None and plan.prediction.step_time_s >= best_o.step_s:
            continue
        try:
            o = optimus_schedule(pricer, task, plan, beat=best_o.step_s if best_o else math.inf)
        except TesseraError as e:
            why = str(e)
            continue
        if o is not None and (best_o is None or o.step_s < best_o.step_s):
            best_o = o
    if best_o is None:
        raise TesseraError(why)
    best_b, why_b = None, ""

    def baselines():
        nonlocal best_b, why_b
        for plan in plans:
            try:
                b = extra_stage_baseline(pricer, task, plan)
            except TesseraError as e:
                why_b = str(e)
                continue
            if best_b is None or b.step_s < best_b.step_s:
                best_b = b
    # The chosen pipeline plan's placement refined (moves of images between ranks, exactly
    # priced, the MILP); the other plans' are not, so a plan that refining would have made the
    # best can be missed: refining every placement would multiply the planning time. The baselines
    # are priced while its MILPs run.
    refined = optimus_schedule(pricer, task, best_o.llm_plan, refined=True, meanwhile=baselines)
    if best_b is None:
        raise TesseraError(why_b)
    return refined, best_b
