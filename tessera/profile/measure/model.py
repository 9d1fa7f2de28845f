"""Measure a model's layers on one device and fit the cost model's coefficients to them.

For each layer kind (the embedding, the first block of each block kind — identical blocks share
one measurement — and the head: final norm, vocabulary projection and the loss), at a few
(batch, seq) sizes: forward and backward time (median, or min, of `reps` after a warm-up; the
sizes take turns, one run each per round, so that drift in the machine's speed bends no curve)
and the bytes of activations autograd saves for backward (`SavedActivationMeter`). Under
`torchrun` every rank measures at once, as ranks of a real job compute at once, and each run
counts the slowest rank's time (ranks that share cores are thus measured sharing them). With an
even number of ranks, blocks are also run tensor parallel, Ulysses and ZeRO-3 over pairs of ranks
(`measure_variants`), and tensor parallel over 4 (and 8) ranks where a node has them
(`wide_tp_degrees`), and the head tensor parallel with the loss-parallel cross-entropy
(`measure_head_tp2`).
`tessera.profile.fit` turns the measurements into `LayerSpec` time scales relative to the
achieved FLOP/s of large matmuls measured in the same processes (`reference_flops`), or the
cluster profile's rate when one is given.
"""
from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...spec.model import LayerKind, ModelSpec, TransformerConfig
from ..fit import LayerMeasurement, ModelProfile, fit_layer_kind, summarize, tp_degree
from .memory import SavedActivationMeter

log = logging.getLogger(__name__)

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_SIZES_CPU = ((1, 64), (2, 64), (1, 128), (4, 64), (2, 128), (1, 256))
DEFAULT_SIZES_CUDA = ((1, 512), (2, 512), (1, 1024), (4, 512), (2, 1024), (1, 2048))

Progress = Callable[[str, int], None]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _slowest_rank(times: list[float], device: torch.device) -> list[float]:
    """Per run, the largest of the ranks' times: a run lasts until every rank is done, so ranks
    sharing cores are measured sharing them."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return times
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int, reps: int, statistic: str = "median") -> float:
    """Achieved FLOP/s of an n x n x n matmul (median or min time of `reps`), on this rank."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)
    times = []
    for _ in range(reps):
        _barrier()
        _sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / summarize(_slowest_rank(times, device), statistic)


class _LayerRunner:
    """Forward and backward of one layer kind on random inputs of one size."""

    def __init__(self, model: torch.nn.Module, config: TransformerConfig, kind: LayerKind, index: int,
                 batch: int, seq: int, device: torch.device, dtype: torch.dtype):
        self.model, self.config, self.kind, self.index = model, config, kind, index
        gen = torch.Generator(device=device).manual_seed(batch * 7919 + seq)
        h, v = config.hidden, config.vocab_size
        self.tokens = torch.randint(0, v, (batch, seq), generator=gen, device=device)
        self.x = torch.randn(batch, seq, h, generator=gen, device=device).to(dtype)
        self.grad_h = torch.randn(batch, seq, h, generator=gen, device=device).to(dtype)
        self.freqs = model.freqs[:seq] if config.position != "learned" else None
        self.out: torch.Tensor | None = None

    def forward(self) -> None:
        m = self.model
        if self.kind == LayerKind.EMBEDDING:
            h = m.tok_embeddings(self.tokens)
            if self.config.position == "learned":
                h = h + m.pos_embeddings(torch.arange(self.tokens.shape[1], device=self.tokens.device))
            self.out = h
        elif self.kind == LayerKind.LM_HEAD:
            x = self.x.detach().requires_grad_()
            logits = m.output(m.norm(x))
            self.out = F.cross_entropy(logits.flatten(0, 1).float(), self.tokens.flatten())
        else:
            x = self.x.detach().requires_grad_()
            self.out = m.layers[str(self.index)](x, self.freqs)

    def backward(self) -> None:
        if self.out.dim() == 0:
            self.out.backward()
        else:
            self.out.backward(self.grad_h)
        self.out = None
        for p in self.model.parameters():
            p.grad = None


class _VariantRunner:
    """Forward and backward of `block` applied `repeat` times in a row, on `base`'s inputs or, with
    `seq_part=(i, n)`, on slice i of n of their sequence (a sequence-parallel rank's share)."""

    def __init__(self, block: torch.nn.Module, base: _LayerRunner, seq_part: tuple[int, int] = (0, 1),
                 repeat: int = 1):
        i, n = seq_part
        s = base.x.shape[1] // n
        part = slice(i * s, (i + 1) * s)
        self.block, self.repeat, self.out = block, repeat, None
        self.x, self.grad_h = base.x[:, part], base.grad_h[:, part]
        self.freqs = base.freqs[part] if base.freqs is not None else None

    def forward(self) -> None:
        x = self.x.detach().requires_grad_()
        for _ in range(self.repeat):
            x = self.block(x, self.freqs)
        self.out = x

    def backward(self) -> None:
        self.out.backward(self.grad_h)
        self.out = None
        for p in self.block.parameters():
            p.grad = None


def _time_interleaved(runners: Sequence, device: torch.device, reps: int,
                      each_round: Callable[[int], None] | None = None,
                      window_s: float = 0.0) -> list[tuple[list[float], list[float]]]:
    """Per runner, forward and backward seconds of `reps` samples (each the slowest rank's), after one
    warm-up run each. The runners take turns, one sample each per round: a change in the machine's
    speed while they are timed (other jobs on a shared machine) then falls on all of them alike
    instead of bending the curve their fit sees. `each_round(i)` is called after round i.

    `window_s`: a sample is the mean of as many runs in a row as fill this many seconds (at least
    one; 0: one run). On a machine whose load comes in bursts shorter than a training step, one
    short run sees a quieter machine than a step ever does; a sample as long as a step averages
    the same bursts the step does."""
    for runner in runners:
        runner.forward()
        runner.backward()
    runs = runs_filling(runners, device, window_s)
    times = [([], []) for _ in runners]
    for i in range(reps):
        for runner, n, (fwd, bwd) in zip(runners, runs, times):
            f, b = time_sample(runner, device, n)
            fwd.append(f)
            bwd.append(b)
        if each_round:
            each_round(i)
    return [(_slowest_rank(fwd, device), _slowest_rank(bwd, device)) for fwd, bwd in times]


def require_window(window_s: float) -> None:
    if not window_s >= 0:  # also refuses nan
        raise ValueError(f"a timing window cannot be negative, got {window_s} s")


def runs_filling(runners: Sequence, device: torch.device, window_s: float) -> list[int]:
    """Per (warmed-up) runner, how many runs in a row fill `window_s` seconds, at least one, from
    one timed run, the same on every rank (the slowest rank's run decides)."""
    require_window(window_s)
    if window_s == 0:
        return [1] * len(runners)
    once = _slowest_rank([sum(time_once(runner, device)) for runner in runners], device)
    return [max(1, round(window_s / max(t, 1e-9))) for t in once]


def time_sample(runner, device: torch.device, runs: int = 1) -> tuple[float, float]:
    """(forward, backward) seconds per run, averaged over `runs` runs of `runner` in a row."""
    f = b = 0.0
    for _ in range(runs):
        df, db = time_once(runner, device)
        f, b = f + df, b + db
    return f / runs, b / runs


def time_once(runner, device: torch.device) -> tuple[float, float]:
    """(forward, backward) seconds of one run of `runner` on this rank, started with every rank."""
    _barrier()
    _sync(device)
    t0 = time.perf_counter()
    runner.forward()
    _sync(device)
    t1 = time.perf_counter()
    runner.backward()
    _sync(device)
    return t1 - t0, time.perf_counter() - t1


def _saved_and_peak(runner: _LayerRunner, device: torch.device,
                    meter: SavedActivationMeter) -> tuple[float, float | None]:
    """(bytes autograd saves in one forward, CUDA peak bytes of forward + backward or None)."""
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    with meter.track():
        runner.forward()
    saved = meter.peak_bytes
    runner.backward()
    if device.type == "cuda":
        peak = float(torch.cuda.max_memory_allocated(device) - base)
    return float(saved), peak


def tp2_shard(block: torch.nn.Module) -> torch.nn.Module | None:
    """A copy of a dense block as one rank of tp=2 holds it (half the heads, half the MLP), or None.

    Only its saved activations are measured, to split them into what TP divides and what not.
    """
    import copy

    from torch import nn

    attn, mlp = getattr(block, "attention", None), getattr(block, "feed_forward", None)
    if attn is None or mlp is None or attn.wk.out_features % (2 * attn.head_dim):
        return None
    shard = copy.deepcopy(block)

    def half(lin: nn.Linear, out: bool) -> nn.Linear:
        i, o = (lin.in_features, lin.out_features // 2) if out else (lin.in_features // 2, lin.out_features)
        return nn.Linear(i, o, bias=lin.bias is not None, device=lin.weight.device, dtype=lin.weight.dtype)

    a, f = shard.attention, shard.feed_forward
    a.wq, a.wk, a.wv, a.wo = half(a.wq, True), half(a.wk, True), half(a.wv, True), half(a.wo, False)
    f.w1, f.w2 = half(f.w1, True), half(f.w2, False)
    if hasattr(f, "w3"):
        f.w3 = half(f.w3, True)
    return shard


def group_mesh(device: torch.device, size: int = 2):
    """The sub-mesh of this rank's `size` consecutive ranks (ranks size*i ...), as the runtime's
    innermost (TP) groups; None unless the ranks divide into such groups."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world < size or world % size:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world // size, size), mesh_dim_names=("rest", "group"))["group"]


# Variants of a block run over a pair of ranks, as the runtime runs them (see `measure_variants`).
VARIANTS = ("tp2", "sp2", "zero3")
# Tensor-parallel degrees above 2 measured too, where a node has the ranks (`wide_tp_degrees`).
WIDE_TP = (4, 8)


def wide_tp_degrees(config: TransformerConfig, world: int, local_world: int) -> list[int]:
    """The `WIDE_TP` degrees `profile_model` runs blocks at: groups of consecutive ranks within a
    node (`local_world` ranks) that divide the world, and the block's heads and MLP."""
    return [g for g in WIDE_TP if local_world % g == 0 and world % g == 0 and config.num_heads % g == 0
            and config.num_kv_heads % g == 0 and config.ffn_hidden % g == 0]


def _variant_block(block: torch.nn.Module, variant: str, mesh) -> torch.nn.Module:
    import copy

    from ...plan import LayerStrategy
    from ...runtime.attention import UlyssesAttention
    from ...runtime.parallelize import _tp_block

    out = copy.deepcopy(block)
    if tp_degree(variant):
        _tp_block(out, LayerStrategy(tp=tp_degree(variant)), mesh)
    elif variant == "sp2":
        out.attention.core = UlyssesAttention(mesh.get_group())
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(out, mesh=mesh, reshard_after_forward=True)
    return out


def _variant_messages(variant: str, block: torch.nn.Module, batch: int, seq: int, config: TransformerConfig,
                      device: torch.device, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """The collectives a variant's forward + backward issue, as (name, buffer) to time alone:
    tp2 (and wider tp) the 4 all-reduces of the b x s x h activation; sp2 the 8 all-to-alls of q,
    k, v and the output (a rank's half sequence); zero3 the parameters' all-gather forward, all-gather and
    reduce-scatter backward."""
    h = config.hidden
    if tp_degree(variant):
        return [("all_reduce", torch.empty(batch, seq, h, device=device, dtype=dtype))] * 4
    if variant == "sp2":
        kv = config.num_kv_heads * config.head_dim
        q = torch.empty(batch * seq // 2 * h, device=device, dtype=dtype)
        k = torch.empty(batch * seq // 2 * kv, device=device, dtype=dtype)
        return [("all_to_all", q), ("all_to_all", k), ("all_to_all", k), ("all_to_all", q)] * 2
    n = sum(p.numel() for p in block.parameters())
    full = torch.empty(n + n % 2, device=device, dtype=dtype)
    return [("all_gather", full), ("all_gather", full), ("reduce_scatter", full)]


def _time_collectives(messages: list[tuple[str, torch.Tensor]], group, device: torch.device, reps: int,
                      statistic: str) -> float:
    """Seconds of `messages` issued back to back on `group`, alone (the slowest rank's). Output
    buffers are allocated once, outside the timed runs."""
    calls = []
    for name, buf in messages:
        if name == "all_reduce":
            calls.append(lambda b=buf: dist.all_reduce(b, group=group))
        elif name == "all_to_all":
            calls.append(lambda b=buf, o=torch.empty_like(buf): dist.all_to_all_single(o, b, group=group))
        elif name == "all_gather":
            calls.append(lambda b=buf, i=buf[: buf.numel() // 2].clone():
                         dist.all_gather_into_tensor(b, i, group=group))
        else:
            calls.append(lambda b=buf, o=buf.new_empty(buf.numel() // 2):
                         dist.reduce_scatter_tensor(o, b, group=group))

    def issue() -> None:
        for call in calls:
            call()

    issue()
    times = []
    for _ in range(reps):
        _barrier()
        _sync(device)
        t0 = time.perf_counter()
        issue()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return summarize(_slowest_rank(times, device), statistic)


# Blocks in a row per timed run of the tp2 and sp2 variants and of their one-rank reference. Their
# collectives wait for the slower rank; one block timed alone after a barrier starts the ranks in
# step and misses much of that wait, which a model's chain of blocks pays (measured on 2 CPU ranks:
# tp2 per block 6-9% slower in a chain of 4 than alone, as in a training step).
CHAIN = 4


def chain_rounds(reps: int) -> int:
    """Timed rounds of the chained runs for `reps` repetitions asked: a chained run does CHAIN
    blocks' work, so fewer suffice."""
    return max(3, (reps + 1) // 2)


@dataclass
class VariantTimings:
    """What `measure_variants` returns, per measured size: `variants` maps each of `VARIANTS`, and
    "tp4"/"tp8" where measured, to (fwd+bwd seconds per block, seconds of its collectives alone);
    `chain_reference` is the unparallelised block's fwd+bwd seconds per block, chained as tp and
    sp2 are."""

    variants: dict[str, tuple[list[float], list[float]]]
    chain_reference: list[float]


def measure_variants(model: torch.nn.Module, config: TransformerConfig, kind: LayerKind, block: int,
                     sizes: Sequence[tuple[int, int]], device: torch.device, dtype: torch.dtype, reps: int,
                     statistic: str, mesh, progress: Progress | None = None,
                     window_s: float = 0.0, wide_meshes: dict[int, object] | None = None) -> VariantTimings:
    """Per size: fwd+bwd seconds of the block run over the pair of ranks of `mesh` as the runtime
    runs it — Megatron TP with DTensor (tp2), Ulysses attention over a half sequence per rank (sp2),
    FSDP2 `fully_shard` resharding after forward (zero3) — and the seconds of that variant's
    collectives timed alone on the same group; all the slowest rank's. tp2 and sp2 run `CHAIN`
    blocks in a row, next to the same chain unparallelised on every rank (the reference their
    overheads are taken against); zero3 runs one block (a chain would hide its gathers behind the
    neighbours' compute, which the cost model charges separately). All sizes and variants take
    turns (`_time_interleaved`), so that a change in the machine's load falls on them alike.
    `wide_meshes`: {degree: sub-mesh of that many consecutive ranks}, for blocks run at wider
    tensor parallel as "tp{degree}", chained as tp2."""
    pair_rank = dist.get_rank(mesh.get_group())
    meshes = {v: mesh for v in VARIANTS} | {f"tp{g}": m for g, m in (wide_meshes or {}).items()}
    blocks = {v: _variant_block(model.layers[str(block)], v, m) for v, m in meshes.items()}
    runners, comm = [], {v: [] for v in meshes}
    for batch, seq in sizes:
        base = _LayerRunner(model, config, kind, block, batch, seq, device, dtype)
        runners.append(_VariantRunner(model.layers[str(block)], base, repeat=CHAIN))
        for variant, vblock in blocks.items():
            runners.append(_VariantRunner(vblock, base, (pair_rank, 2) if variant == "sp2" else (0, 1),
                                          1 if variant == "zero3" else CHAIN))
            messages = _variant_messages(variant, model.layers[str(block)], batch, seq, config, device, dtype)
            comm[variant].append(_time_collectives(messages, meshes[variant].get_group(), device, reps, statistic))
    rounds = chain_rounds(reps)
    over = " and ".join(str(g) for g in (2, *(wide_meshes or {})))
    tick = (lambda i: progress(f"block{block} over {over} ranks, round {i + 1}/{rounds}", 1)) if progress else None
    per_block = [(summarize(f, statistic) + summarize(b, statistic)) / r.repeat
                 for r, (f, b) in zip(runners, _time_interleaved(runners, device, rounds, tick, window_s))]
    k = 1 + len(blocks)  # runners per size: the reference, then each variant
    return VariantTimings(
        variants={v: (_median_over_ranks(per_block[1 + j::k]), _median_over_ranks(comm[v]))
                  for j, v in enumerate(blocks)},
        chain_reference=_median_over_ranks(per_block[0::k]))


class _HeadTP2Runner:
    """The LM head as one rank of tp=2 runs it (`runtime.parallelize.tp_head`): the final norm, the
    vocabulary projection column-parallel with its logits sharded over the vocabulary, and the
    cross-entropy on them under `loss_parallel`, forward and backward, on `base`'s inputs."""

    def __init__(self, head: torch.nn.ModuleDict, base: _LayerRunner):
        self.head, self.base, self.out = head, base, None

    def forward(self) -> None:
        from torch.distributed.tensor.parallel import loss_parallel

        x = self.base.x.detach().requires_grad_()
        with loss_parallel():
            logits = self.head["output"](self.head["norm"](x))
            self.out = F.cross_entropy(logits.flatten(0, 1), self.base.tokens.flatten())

    def backward(self) -> None:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            self.out.backward()
        self.out = None
        for p in self.head.parameters():
            p.grad = None


def measure_head_tp2(model: torch.nn.Module, config: TransformerConfig, sizes: Sequence[tuple[int, int]],
                     device: torch.device, dtype: torch.dtype, reps: int, statistic: str, mesh,
                     progress: Progress | None = None, window_s: float = 0.0) -> VariantTimings:
    """Per size: fwd+bwd seconds of the LM head run tensor parallel over the pair of ranks of
    `mesh` (`_HeadTP2Runner`), of the plain head timed alongside on every rank (the reference),
    and of the collectives the cost model charges a TP head (one all-reduce of the b x s x h
    activation forward, one backward) timed alone; all the slowest rank's."""
    import copy

    from ...runtime.parallelize import tp_head

    head = torch.nn.ModuleDict({"norm": copy.deepcopy(model.norm), "output": copy.deepcopy(model.output)})
    tp_head(head["norm"], head["output"], mesh, sequence_parallel=False)
    group = mesh.get_group()
    runners, comm = [], []
    for batch, seq in sizes:
        base = _LayerRunner(model, config, LayerKind.LM_HEAD, -1, batch, seq, device, dtype)
        runners += [base, _HeadTP2Runner(head, base)]
        act = torch.empty(batch, seq, config.hidden, device=device, dtype=dtype)
        comm.append(_time_collectives([("all_reduce", act)] * 2, group, device, reps, statistic))
    tick = (lambda i: progress(f"lm_head over 2 ranks, round {i + 1}/{reps}", 1)) if progress else None
    totals = [summarize(f, statistic) + summarize(b, statistic)
              for f, b in _time_interleaved(runners, device, reps, tick, window_s)]
    return VariantTimings(variants={"tp2": (_median_over_ranks(totals[1::2]), _median_over_ranks(comm))},
                          chain_reference=_median_over_ranks(totals[0::2]))


def build_in_dtype(config: TransformerConfig, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The model of `config` with its weights in `dtype` (rope rotations stay complex float)."""
    from ...models import build_model
    from ...models.transformer import rope_frequencies

    model = build_model(config, device=device)
    if dtype != torch.float32:
        model.to(dtype)
        if config.position != "learned":  # Module.to(dtype) casts the complex rope rotations too
            model.freqs = rope_frequencies(config.head_dim, config.max_seq_len, config.rope_theta).to(device)
    return model


def _layers_to_measure(spec: ModelSpec) -> list[tuple[LayerKind, int, int]]:
    """(kind, index into spec.layers, block index) of the first layer of every kind."""
    seen, out = set(), []
    block = -1
    for i, layer in enumerate(spec.layers):
        if layer.kind not in (LayerKind.EMBEDDING, LayerKind.LM_HEAD):
            block += 1
        if layer.kind not in seen:
            seen.add(layer.kind)
            out.append((layer.kind, i, block))
    return out


def _median_over_ranks(values: list[float]) -> list[float]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    gathered: list[list[float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, values)
    return [statistics.median(col) for col in zip(*gathered)]


def profile_model(spec: ModelSpec, sizes: Sequence[tuple[int, int]] | None = None, reps: int = 3,
                  dtype: str | None = None, device: torch.device | None = None,
                  reference_flops: float | None = None, matmul_size: int | None = None,
                  progress: Progress | None = None, statistic: str = "median",
                  window_s: float = 0.0) -> ModelProfile:
    """Measure every layer kind of `spec` at `sizes` and fit its scales (see module docstring).

    `statistic`: how the `reps` timings of a point are summarised (see `fit.STATISTICS`);
    `window_s`: the seconds each of them spans (`_time_interleaved`).

    `reference_flops`: the achieved FLOP/s the scales are relative to (a cluster profile's
    peak x efficiency); measured here on `matmul_size` square matmuls when not given.
    """
    if spec.config is None:
        raise ValueError(f"model '{spec.name}' has no architecture config to build, so it cannot be profiled")
    require_window(window_s)
    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                        else torch.device("cpu"))
    dtype = dtype or ("bf16" if device.type == "cuda" else "fp32")
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"unknown dtype '{dtype}'; known: {', '.join(_TORCH_DTYPES)}")
    tdtype = _TORCH_DTYPES[dtype]
    sizes = list(sizes or (DEFAULT_SIZES_CUDA if device.type == "cuda" else DEFAULT_SIZES_CPU))
    too_long = [s for _, s in sizes if s > spec.config.max_seq_len]
    if too_long:
        raise ValueError(f"sequence length {too_long[0]} exceeds the model's max_seq_len {spec.config.max_seq_len}")
    model = build_in_dtype(spec.config, device, tdtype)
    meter = SavedActivationMeter(model)
    if reference_flops is None:
        n = matmul_size or (8192 if device.type == "cuda" else 1024)
        reference_flops = statistics.median(_median_over_ranks([matmul_flops(device, tdtype, n, reps, statistic)]))

    mesh = group_mesh(device, 2)  # pairs of ranks (2i, 2i+1)
    world = dist.get_world_size() if dist.is_initialized() else 1
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    wide = {g: group_mesh(device, g) for g in wide_tp_degrees(spec.config, world, local_world)}
    kinds = []
    for kind, index, block in _layers_to_measure(spec):
        layer = spec.layers[index]
        runners = [_LayerRunner(model, spec.config, kind, block, batch, seq, device, tdtype) for batch, seq in sizes]
        tick = (lambda i, name=layer.name: progress(f"{name} round {i + 1}/{reps}", 1)) if progress else None
        rows = [[summarize(fwd, statistic), summarize(bwd, statistic), *_saved_and_peak(runner, device, meter)]
                for runner, (fwd, bwd) in zip(runners, _time_interleaved(runners, device, reps, tick, window_s))]
        tp2 = None
        shard = tp2_shard(model.layers[str(block)]) if kind not in (LayerKind.EMBEDDING, LayerKind.LM_HEAD) else None
        if shard is not None:
            tp2, shard_meter = [], SavedActivationMeter(shard)
            for batch, seq in sizes:
                runner = _LayerRunner(model, spec.config, kind, block, batch, seq, device, tdtype)
                with shard_meter.track():
                    out = shard(runner.x.detach().requires_grad_(), runner.freqs)
                tp2.append(float(shard_meter.peak_bytes))
                del out
        pairs = None
        if shard is not None and mesh is not None:
            pairs = measure_variants(model, spec.config, kind, block, sizes, device, tdtype, reps,
                                     statistic, mesh, progress, window_s, wide)
        elif kind == LayerKind.LM_HEAD and mesh is not None and _measures_head_tp2(spec.config):
            pairs = measure_head_tp2(model, spec.config, sizes, device, tdtype, reps, statistic, mesh, progress,
                                     window_s)
        flat = _median_over_ranks([v if v is not None else -1.0 for r in rows for v in r])
        measurements = []
        for j, (batch, seq) in enumerate(sizes):
            fwd, bwd, saved, peak = flat[4 * j: 4 * j + 4]
            tokens = batch * seq
            lin, att = tokens * layer.flops_per_token, tokens * layer.attn_flops_coeff * seq
            measurements.append(LayerMeasurement(
                batch=batch, seq_len=seq, forward_s=max(fwd, 1e-9), backward_s=max(bwd, 1e-9),
                activation_bytes=saved, peak_allocated_bytes=peak if peak >= 0 else None,
                linear_flops=lin, attn_flops=att))
        kinds.append(fit_layer_kind(kind, layer.name, layer.params, layer.flops_per_token,
                                    layer.attn_flops_coeff, measurements, reference_flops, tp2,
                                    pairs.variants if pairs else None, pairs.chain_reference if pairs else None))
        k = kinds[-1]
        log.info("%s: linear scale %.3f, attention scale %.3f, call overhead %.2e s, overheads tp %s s, "
                 "ulysses %s s, zero-3 %s s, %.0f activation bytes/token", layer.name, k.linear_time_scale,
                 k.attn_time_scale, k.overhead_s, k.tp_overhead_s, k.sp_overhead_s, k.zero3_overhead_s,
                 k.activation_bytes_per_token)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return ModelProfile(model=spec.name, device=name, dtype=dtype, reference_flops=reference_flops,
                        ranks_measuring=world, statistic=statistic, window_s=window_s,
                        layers=tuple(kinds))


def _measures_variants(layer) -> bool:
    """Whether `profile_model` also runs this layer's `VARIANTS` (a dense block, as `tp2_shard` takes)."""
    return (layer.kind not in (LayerKind.EMBEDDING, LayerKind.LM_HEAD) and not layer.num_experts
            and layer.num_kv_heads > 0 and layer.num_kv_heads % 2 == 0)


def _measures_head_tp2(config: TransformerConfig) -> bool:
    """Whether `profile_model` also runs the LM head tensor parallel over pairs of ranks (an odd
    vocabulary too: the runtime shards it unevenly, and a plan may run it so)."""
    return config.vocab_size >= 2


def planned_units(spec: ModelSpec, world: int = 1, reps: int = 3) -> int:
    """Progress units `profile_model` reports at `world` ranks with `reps` repetitions: one per
    timing round (all sizes) of each layer kind, plus one per round of each block kind and of the
    LM head run over pairs of ranks (even `world` only)."""
    kinds = _layers_to_measure(spec)
    if world < 2 or world % 2:
        return reps * len(kinds)
    pairs = sum(_measures_variants(spec.layers[i]) for _, i, _ in kinds)
    head = (spec.config is not None and _measures_head_tp2(spec.config)
            and any(kind == LayerKind.LM_HEAD for kind, _, _ in kinds))
    return reps * (len(kinds) + head) + chain_rounds(reps) * pairs
