"""Measure a model's layers on one device and fit the cost model's coefficients to them.

For each layer kind (the embedding, the first block of each block kind — identical blocks share
one measurement — and the head: final norm, vocabulary projection and the loss), at a few
(batch, seq) sizes: forward and backward time (median, or min, of `reps` after a warm-up) and the
bytes of activations autograd saves for backward (`SavedActivationMeter`). Under `torchrun` every
rank measures at once, as ranks of a real job compute at once, and each run counts the slowest
rank's time (ranks that share cores are thus measured sharing them). `tessera.profile.fit` turns the measurements into `LayerSpec` time scales relative
to the achieved FLOP/s of large matmuls measured in the same processes (`reference_flops`), or
the cluster profile's rate when one is given.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..spec.model import LayerKind, ModelSpec, TransformerConfig
from .fit import LayerMeasurement, ModelProfile, fit_layer_kind, summarize
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


class _Tp2Runner:
    """Forward and backward of a tensor-parallel (DTensor) copy of a block, on `base`'s inputs."""

    def __init__(self, block: torch.nn.Module, base: _LayerRunner):
        self.block, self.base, self.out = block, base, None

    def forward(self) -> None:
        self.out = self.block(self.base.x.detach().requires_grad_(), self.base.freqs)

    def backward(self) -> None:
        self.out.backward(self.base.grad_h)
        self.out = None
        for p in self.block.parameters():
            p.grad = None


def _time_runs(runner, device: torch.device, reps: int) -> tuple[list[float], list[float]]:
    """Forward and backward seconds of `reps` runs after a warm-up, each the slowest rank's."""
    runner.forward()
    runner.backward()
    fwd, bwd = [], []
    for _ in range(reps):
        _barrier()
        _sync(device)
        t0 = time.perf_counter()
        runner.forward()
        _sync(device)
        t1 = time.perf_counter()
        runner.backward()
        _sync(device)
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
    return _slowest_rank(fwd, device), _slowest_rank(bwd, device)


def _measure(runner: _LayerRunner, device: torch.device, reps: int, meter: SavedActivationMeter,
             statistic: str = "median") -> tuple[float, float, float, float | None]:
    """(median forward s, median backward s, saved activation bytes, CUDA peak bytes or None)."""
    fwd, bwd = _time_runs(runner, device, reps)
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
    return summarize(fwd, statistic), summarize(bwd, statistic), float(saved), peak


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


def tp2_mesh(device: torch.device):
    """The tp=2 sub-mesh of this rank (ranks 2i, 2i+1), or None without an even number of ranks."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world < 2 or world % 2:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("rest", "tp"))["tp"]


def measure_tp2(model: torch.nn.Module, config: TransformerConfig, kind: LayerKind, block: int,
                sizes: Sequence[tuple[int, int]], device: torch.device, dtype: torch.dtype, reps: int,
                statistic: str, mesh) -> tuple[list[float], list[float]]:
    """Per size: fwd+bwd seconds of the block run at tp=2 (Megatron TP with DTensor, as the runtime
    runs it) and the seconds of its 4 TP all-reduces (2 forward, 2 backward) of the b x s x h
    activation timed alone on the same group; both the slowest rank's."""
    import copy

    from ..plan import LayerStrategy
    from ..runtime.parallelize import _tp_block

    tp_block = copy.deepcopy(model.layers[str(block)])
    _tp_block(tp_block, LayerStrategy(tp=2), mesh)
    group = mesh.get_group()
    seconds, comm = [], []
    for batch, seq in sizes:
        base = _LayerRunner(model, config, kind, block, batch, seq, device, dtype)
        fwd, bwd = _time_runs(_Tp2Runner(tp_block, base), device, reps)
        seconds.append(summarize(fwd, statistic) + summarize(bwd, statistic))
        msg = torch.empty(batch, seq, config.hidden, device=device, dtype=dtype)
        dist.all_reduce(msg, group=group)
        times = []
        for _ in range(reps):
            _barrier()
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(4):
                dist.all_reduce(msg, group=group)
            _sync(device)
            times.append(time.perf_counter() - t0)
        comm.append(summarize(_slowest_rank(times, device), statistic))
    return seconds, comm


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
                  progress: Progress | None = None, statistic: str = "median") -> ModelProfile:
    """Measure every layer kind of `spec` at `sizes` and fit its scales (see module docstring).

    `statistic`: how the `reps` timings of a point are summarised ("median" or "min").

    `reference_flops`: the achieved FLOP/s the scales are relative to (a cluster profile's
    peak x efficiency); measured here on `matmul_size` square matmuls when not given.
    """
    from ..models import build_model
    from ..models.transformer import rope_frequencies

    if spec.config is None:
        raise ValueError(f"model '{spec.name}' has no architecture config to build, so it cannot be profiled")
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
    model = build_model(spec.config, device=device)
    if tdtype != torch.float32:
        model.to(tdtype)
        if spec.config.position != "learned":  # Module.to(dtype) casts the complex rope rotations too
            c = spec.config
            model.freqs = rope_frequencies(c.head_dim, c.max_seq_len, c.rope_theta).to(device)
    meter = SavedActivationMeter(model)
    if reference_flops is None:
        n = matmul_size or (8192 if device.type == "cuda" else 1024)
        reference_flops = statistics.median(_median_over_ranks([matmul_flops(device, tdtype, n, reps, statistic)]))

    tp_mesh = tp2_mesh(device)
    kinds = []
    for kind, index, block in _layers_to_measure(spec):
        layer = spec.layers[index]
        rows = []
        for batch, seq in sizes:
            runner = _LayerRunner(model, spec.config, kind, block, batch, seq, device, tdtype)
            rows.append(list(_measure(runner, device, reps, meter, statistic)))
            if progress:
                progress(f"{layer.name} b={batch} s={seq}", 1)
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
        tp2_s = tp2_comm = None
        if shard is not None and tp_mesh is not None:
            tp2_s, tp2_comm = measure_tp2(model, spec.config, kind, block, sizes, device, tdtype, reps,
                                          statistic, tp_mesh)
            tp2_s, tp2_comm = _median_over_ranks(tp2_s), _median_over_ranks(tp2_comm)
            if progress:
                progress(f"{layer.name} tp=2", 1)
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
                                    tp2_s, tp2_comm))
        log.info("%s: linear scale %.3f, attention scale %.3f, call overhead %.2e s, tp overhead %s s, "
                 "%.0f activation bytes/token", layer.name, kinds[-1].linear_time_scale,
                 kinds[-1].attn_time_scale, kinds[-1].overhead_s, kinds[-1].tp_overhead_s,
                 kinds[-1].activation_bytes_per_token)
    world = dist.get_world_size() if dist.is_initialized() else 1
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return ModelProfile(model=spec.name, device=name, dtype=dtype, reference_flops=reference_flops,
                        ranks_measuring=world, statistic=statistic, layers=tuple(kinds))


def _measures_tp2(layer) -> bool:
    """Whether `profile_model` also runs this layer at tp=2 (a dense block, as `tp2_shard` takes)."""
    return (layer.kind not in (LayerKind.EMBEDDING, LayerKind.LM_HEAD) and not layer.num_experts
            and layer.num_kv_heads > 0 and layer.num_kv_heads % 2 == 0)


def planned_units(spec: ModelSpec, sizes: Sequence[tuple[int, int]] | None = None, cuda: bool = False,
                  world: int = 1) -> int:
    """Progress units `profile_model` reports at `world` ranks: one per layer kind and size, plus
    one per block kind run at tp=2 (even `world` only)."""
    n = len(sizes or (DEFAULT_SIZES_CUDA if cuda else DEFAULT_SIZES_CPU))
    kinds = _layers_to_measure(spec)
    tp2 = sum(_measures_tp2(spec.layers[i]) for _, i, _ in kinds) if world >= 2 and world % 2 == 0 else 0
    return n * len(kinds) + tp2
