"""Separate plans for a VLM's parts: the vision encoder and the LLM each get their own strategy.

Each part is planned by the existing search (`search.planner.search`) on the devices it runs on,
with its own workload: the encoder (+ projector, `VLMSpec.encoder_and_projector`) over
`images` sequences of `encoder_seq_len` tokens, the LLM over `samples` sequences of text + image
tokens. So the encoder may run dp=64 ZeRO-1 while the LLM runs tp=8 ZeRO-3, each with its own
recompute. A part's price (`PartCost`) splits its predicted step into
    busy  the forward + backward of the step (the schedule's makespan),
    tail  the once-per-step work (gradient synchronisation that is not overlapped, optimizer),
so that callers can run several parts' busy time one after another and pay a tail once.

Placements of one task (`plan_vlm_task`), the hand-off of the image embeddings costed:
    colocated  both parts on all N devices, one after the other:
               step = busy_E + busy_L + 2 a2a + tail_E + tail_L,
               a2a = all-to-all of the image embeddings (images x image_tokens x h x 2 bytes / N
               per rank) from the encoder's data-parallel layout to the LLM's (forward; the
               gradients go back the same way in the backward);
    separate   encoder on g_E devices, LLM on N - g_E: the step's samples go through in k chunks,
               a two-stage flow (encoder forward of chunk i, then the LLM's forward and backward
               of chunk i while the encoder runs chunk i+1, the encoder's backward of chunk i after
               the LLM's), simulated exactly (`_two_group_flow`), each hand-off one point-to-point
               transfer of the chunk's embeddings spread over the receiving group's ranks.
The search options are trimmed for speed (`FAST_OPTIONS`: no pipeline, 1F1B, ZeRO-1/3, no offload
or Ulysses): the sub-plans are data/tensor parallel; `plan_llm_pipeline` plans pipelines.
No torch import.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..cost.comm import collective_times, p2p_time
from ..cost.evaluate import chunk_times, shared_layer_costs
from ..errors import TesseraError
from ..plan import Plan
from ..spec.cluster import ClusterSpec
from ..spec.multimodal import VLMSpec
from ..spec.tasks import TaskSpec
from ..spec.workload import Workload
from .explain import structure
from .planner import NoFeasiblePlanError, search
from .space import SearchOptions

FAST_OPTIONS = SearchOptions(pp=1, schedules=("1f1b",), allow_offload=False, allow_ulysses=False,
                             zero_stages=(1, 3), runner_ups=0)
# A part's leanest plan: every layer fully recomputed and ZeRO-3 (for schedules that hold more
# than one micro-batch's activations or several parts' states on a device).
LEAN_OPTIONS = SearchOptions(pp=1, schedules=("1f1b",), allow_offload=False, allow_ulysses=False, zero_stages=(3,),
                             recompute=("full",), runner_ups=0)
HANDOFF_CHUNKS = 8
INF = math.inf


@dataclass(frozen=True)
class PartCost:
    """A part's best plan on `gpus` devices (busy/tail as in the module docstring; inf: no plan fits)."""

    part: str
    gpus: int
    samples: int
    seq_len: int
    busy_s: float
    tail_s: float
    fwd_s: float = 0.0  # forward share of busy_s (summed over micro-batches)
    plan: Plan | None = field(default=None, repr=False, compare=False)
    why: str = ""  # why no plan fits
    # Per device, bytes allocated (before fragmentation and the framework's reserve): the model
    # states (parameters + gradients + optimizer), the activations of ALL the step's micro-batches
    # (what a wave schedule holds from an operator's forward wave to its backward wave) and the
    # largest transient buffer.
    states_bytes: float = 0.0
    act_bytes: float = 0.0
    buf_bytes: float = 0.0

    @property
    def step_s(self) -> float:
        return self.busy_s + self.tail_s

    @property
    def bwd_s(self) -> float:
        return self.busy_s - self.fwd_s

    @property
    def feasible(self) -> bool:
        return math.isfinite(self.busy_s)

    def describe(self) -> str:
        return structure(self.plan) if self.plan is not None else f"infeasible ({self.why})"


def sub_cluster(cluster: ClusterSpec, gpus: int) -> ClusterSpec:
    return cluster.with_gpus(gpus)


class PartPricer:
    """Prices (part, devices, samples, sequence length) with the search, cached."""

    def __init__(self, vlm: VLMSpec, cluster: ClusterSpec, options: SearchOptions = FAST_OPTIONS,
                 dtype: str = "bf16", encoder_options: SearchOptions | None = None):
        """`encoder_options`: the encoder's search space when it differs from the LLM's (`options`)."""
        self.vlm, self.cluster, self.options, self.dtype = vlm, cluster, options, dtype
        self.encoder_options = encoder_options
        self._cache: dict[tuple, PartCost] = {}
        self._derived: dict[tuple, tuple[PartCost, object]] = {}
        self._models = {"vision_encoder": vlm.encoder_and_projector(), "llm": vlm.llm}
        self.searches = 0

    def model(self, part: str):
        if part not in self._models:
            raise TesseraError(f"unknown model part '{part}' to plan; plannable parts: vision_encoder, llm")
        return self._models[part]

    def cost(self, part: str, gpus: int, samples: int, seq_len: int, options: SearchOptions | None = None) -> PartCost:
        opts = options or self.options
        key = (part, gpus, samples, seq_len, opts)
        if key not in self._cache:
            self._cache[key] = self._price(part, gpus, samples, seq_len, opts)
        return self._cache[key]

    def _price(self, part: str, gpus: int, samples: int, seq_len: int, opts: SearchOptions) -> PartCost:
        model = self.model(part)
        try:
            cluster = sub_cluster(self.cluster, gpus)
        except ValueError as e:
            return PartCost(part, gpus, samples, seq_len, INF, INF, why=str(e))
        self.searches += 1
        try:
            with shared_layer_costs():
                plan = search(model, cluster, Workload(global_batch=samples, seq_len=seq_len, dtype=self.dtype), opts)
        except NoFeasiblePlanError as e:
            return PartCost(part, gpus, samples, seq_len, INF, INF, why=str(e))
        return part_cost(part, plan)

    def derived(self, enc: PartCost, key: tuple, compute):
        """`compute()` once per (priced part, key) for the pricer's lifetime: what planners derive
        from a cached `PartCost` (Optimus's per-pass tables serve every LLM plan of a pipeline degree)."""
        full = (id(enc),) + key
        if full not in self._derived:
            self._derived[full] = (enc, compute())  # the PartCost kept alive: its id stays its own
        return self._derived[full][1]

    # --- the parts of one task -------------------------------------------------------------
    def encoder(self, task: TaskSpec, gpus: int, options: SearchOptions | None = None) -> PartCost:
        return self.cost("vision_encoder", gpus, task.images(), self.vlm.encoder_seq_len,
                         options or self.encoder_options)

    def llm(self, task: TaskSpec, gpus: int, options: SearchOptions | None = None) -> PartCost:
        return self.cost("llm", gpus, task.batch, task.llm_seq_len(self.vlm), options)


def part_cost(part: str, plan: Plan) -> PartCost:
    """A part's `PartCost` under a plan of it (pp = 1), as the cost model prices that plan."""
    fwd, bwd, _, tails, _ = chunk_times(plan)
    step = plan.prediction.step_time_s
    tail = max(tails)
    busy = step - tail
    # Forward share of the busy time: the chunks' forward over forward + backward.
    share = sum(fwd) / max(sum(fwd) + sum(bwd), 1e-30)
    mem = plan.prediction.stage_memory[0]  # pp = 1: one rank, one micro-batch in flight
    return PartCost(part, plan.world_size, plan.workload.global_batch, plan.workload.seq_len, busy, tail,
                    fwd_s=busy * share, plan=plan, states_bytes=mem.params + mem.grads + mem.optimizer,
                    act_bytes=mem.activations * plan.num_micro_batches,
                    buf_bytes=mem.buffers - plan.cluster.device.reserved_bytes)


def embedding_bytes(vlm: VLMSpec, images: int, dtype_bytes: int = 2) -> float:
    """Bytes of the image embeddings the projector hands to the LLM (the gradient coming back is
    as large)."""
    return float(images) * vlm.image_tokens * vlm.config.llm.hidden * dtype_bytes


def colocated_handoff_s(cluster: ClusterSpec, vlm: VLMSpec, images: int, gpus: int) -> float:
    """All-to-all of the embeddings from the encoder's layout to the LLM's, forward and backward."""
    per_rank = embedding_bytes(vlm, images) / gpus
    return 2.0 * float(collective_times(cluster.with_gpus(gpus), "all_to_all", per_rank, gpus, 1))


def group_handoff_s(cluster: ClusterSpec, vlm: VLMSpec, images: float, receivers: int) -> float:
    """One point-to-point hand-off of `images` images' embeddings into a group of `receivers`
    ranks (each receives its share over the inter-node links)."""
    if images <= 0:
        return 0.0
    return p2p_time(cluster, embedding_bytes(vlm, 1) * images / max(receivers, 1), inter=True)


def _two_group_flow(ef: float, eb: float, llm: float, k: int, hop: float) -> float:
    """Makespan of k chunks through encoder-forward -> LLM (fwd + bwd) -> encoder-backward, the
    encoder on one group (forwards first, each backward as soon as its gradient arrives and the
    group is free), the LLM on the other, `hop` seconds per hand-off."""
    enc_free, llm_free = 0.0, 0.0
    fwd_done = []
    for _ in range(k):
        enc_free += ef
        fwd_done.append(enc_free)
    grad_ready = []
    for i in range(k):
        start = max(llm_free, fwd_done[i] + hop)
        llm_free = start + llm
        grad_ready.append(llm_free + hop)
    for i in range(k):
        enc_free = max(enc_free, grad_ready[i]) + eb
    return max(enc_free, llm_free)


@dataclass(frozen=True)
class TaskPlan:
    """One task's placement and the two parts' plans."""

    task: str
    placement: str  # "colocated", "separate" or "llm_only"
    gpus: int
    encoder: PartCost | None
    llm: PartCost
    encoder_gpus: int
    handoff_s: float
    busy_s: float  # the step without the tails
    tail_s: float

    @property
    def step_s(self) -> float:
        return self.busy_s + self.tail_s

    def describe(self) -> str:
        if self.encoder is None:
            return f"{self.task}: LLM ({self.llm.describe()}) on {self.gpus} GPUs"
        where = (f"both on {self.gpus} GPUs" if self.placement == "colocated"
                 else f"encoder on {self.encoder_gpus}, LLM on {self.gpus - self.encoder_gpus} GPUs")
        return (f"{self.task}: {self.placement} ({where}); encoder ({self.encoder.describe()}), "
                f"LLM ({self.llm.describe()}), hand-off {self.handoff_s * 1e3:.1f} ms")


def node_sizes(total: int, gpus_per_node: int, smallest_share: int = 16) -> list[int]:
    """Device-group sizes the planners consider: powers of two from max(one node, total /
    `smallest_share`) up to `total` (inside one node, the powers of two from 1)."""
    sizes, g = [], 1
    floor = max(1, min(gpus_per_node, total), total // smallest_share)
    while g <= total:
        if total % g == 0 and g >= floor and (g <= gpus_per_node or g % gpus_per_node == 0):
            sizes.append(g)
        g *= 2
    if total not in sizes:
        sizes.append(total)
    return sizes


def plan_vlm_task(pricer: PartPricer, task: TaskSpec, gpus: int, encoder_gpus: int | None = None) -> TaskPlan:
    """The best placement of one task on `gpus` devices (see the module docstring).

    `encoder_gpus`: force the encoder onto that many devices (= gpus: colocated); a forced
    placement that cannot fit raises TesseraError in one sentence."""
    cluster, vlm = pricer.cluster, pricer.vlm
    if not task.has_images:
        llm = pricer.llm(task, gpus)
        if not llm.feasible:
            raise TesseraError(f"task '{task.name}': the LLM does not fit on {gpus} GPUs: {llm.why}")
        return TaskPlan(task.name, "llm_only", gpus, None, llm, 0, 0.0, llm.busy_s, llm.tail_s)
    if encoder_gpus is not None:
        if not 0 < encoder_gpus <= gpus:
            raise TesseraError(f"encoder placement on {encoder_gpus} GPUs is outside the {gpus} GPUs of the run")
        options = [encoder_gpus]
    else:
        options = [g for g in node_sizes(gpus, cluster.gpus_per_node) if g * 2 <= gpus] + [gpus]
    best: TaskPlan | None = None
    for g in options:
        plan = _placement(pricer, task, gpus, g)
        if encoder_gpus is not None and not plan.llm.feasible:
            raise TesseraError(f"encoder placement on {g} of {gpus} GPUs does not fit: the LLM on the other "
                               f"{gpus - g} GPUs has no plan ({plan.llm.why})")
        if encoder_gpus is not None and not plan.encoder.feasible:
            raise TesseraError(f"encoder placement on {g} GPUs does not fit: {plan.encoder.why}")
        if math.isfinite(plan.step_s) and (best is None or plan.step_s < best.step_s):
            best = plan
    if best is None:
        raise TesseraError(f"task '{task.name}': no placement of {vlm.name} fits on {gpus} GPUs")
    return best


def _placement(pricer: PartPricer, task: TaskSpec, gpus: int, encoder_gpus: int) -> TaskPlan:
    cluster, vlm = pricer.cluster, pricer.vlm
    enc = pricer.encoder(task, encoder_gpus)
    if encoder_gpus == gpus:
        llm = pricer.llm(task, gpus)
        hand = colocated_handoff_s(cluster, vlm, task.images(), gpus)
        return TaskPlan(task.name, "colocated", gpus, enc, llm, gpus, hand,
                        enc.busy_s + llm.busy_s + hand, enc.tail_s + llm.tail_s)
    llm = pricer.llm(task, gpus - encoder_gpus)
    k = max(1, min(HANDOFF_CHUNKS, task.batch))
    hop = group_handoff_s(cluster, vlm, task.images() / k, min(encoder_gpus, gpus - encoder_gpus))
    busy = (_two_group_flow(enc.fwd_s / k, enc.bwd_s / k, llm.busy_s / k, k, hop)
            if enc.feasible and llm.feasible else INF)
    return TaskPlan(task.name, "separate", gpus, enc, llm, encoder_gpus, 2 * k * hop, busy,
                    max(enc.tail_s, llm.tail_s))
