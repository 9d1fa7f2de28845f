"""Fit the cost model's compute coefficients to measured layer timings; the model-profile schema.

For one layer kind measured at several (batch, seq) sizes, each measurement gives the forward FLOPs
of its linear part L = tokens * flops_per_token and of its attention-score part
A = tokens * attn_flops_coeff * seq (as `LayerSpec.forward_flops` defines them) and the measured
time t of forward + backward. The cost model predicts t = 3 (L s_lin + A s_att) / F, with F the
achieved FLOP/s of large matmuls (backward = 2 x forward). Least squares on

    t = a L + b A (+ c)              with a, b, c >= 0,

each row weighted by 1/t (relative error, so that small and large sizes count alike), gives
s_lin = a F / 3 and s_att = b F / 3: how much slower than a large matmul this layer's linear and
attention terms run, and c, a fixed per-call overhead (`LayerSpec.call_overhead_s`; fitted with
three or more sizes, else 0). The two terms separate only if the attention share A / L (which
grows with seq) varies by 1.5x or more across the sizes; otherwise one common scale is fitted to
L + A (with c). If the fit puts all the time of a layer with FLOPs into c (a = 0), it is redone
without c; a layer without FLOPs (the embedding) gets c = its time, all fixed cost.

Parallel overheads (`LayerSpec.tp_overhead_s` and `tp_slowdown`, `sp_overhead_s` and
`sp_slowdown`, `zero3_overhead_s`): with two ranks or more, the block is also run as the runtime
runs it over a pair of ranks: tensor parallel (tp2, DTensor), Ulysses (sp2, half the sequence per
rank), ZeRO-3 (zero3, FSDP2). Taking T2 fwd+bwd with X seconds of that variant's collectives
measured alone, from the one-rank time T1 the cost model expects T2 = c + (T1 - c) / 2 + X for
tp2 and sp2 (half the compute, the collectives on the critical path) and T2 = T1 + X for zero3
(one block alone has no neighbour to hide its gathers behind). The excess over that is, for tp2
and sp2, fitted over sizes as overhead + slowdown x (T1 - c) / 2 (`variant_overhead`); for zero3
its median, floored at 0. With 4 ranks on a node, blocks also run at tp4 (with 8, tp8 too), fitted
as tp2 with (T1 - c) / 4 per rank (`TPWideMeasurement`, `LayerSpec.tp_wider`): tp2's terms do not
carry over to wider groups. tp2, wider tp and sp2 are timed per block in a chain of blocks (see
`tessera.profile.measure.model.CHAIN`), and their T1 is then the same chain's on one rank
(`chain_reference_seconds`), timed alongside. The LM head has a tp2 variant too (vocabulary-parallel
projection and loss-parallel cross-entropy, X = the one all-reduce forward and one backward the
cost model charges it), set against the plain head timed alongside.

No torch import: this module only does arithmetic on measurements.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from pydantic import Field

from ..spec.model import Frozen, LayerKind

# 2: the scales are fitted jointly with the per-call intercept, which is now applied (a version-1
# profile's scales already absorb it); tp=2 overhead fields added.
PROFILE_VERSION = 2


def _trimmed_mean(xs: Sequence[float]) -> float:
    from scipy.stats import trim_mean  # lazily, as the fits import scipy

    return float(trim_mean(xs, 0.1))


# How repeated timings are summarised; profile and validation must use the same one. The median
# is the default. "min" estimates a machine's own speed when other jobs' load comes and goes over
# minutes; "mean" is trimmed (the top and bottom tenth dropped). Load that comes in bursts shorter
# than a step is met by the model profile's timing window instead (`profile_model(window_s=)`):
# on such a machine the median of step-long windows predicted steps better than either.
STATISTICS = {"median": lambda xs: float(np.median(xs)), "min": lambda xs: float(np.min(xs)),
              "mean": _trimmed_mean}


def summarize(values: Sequence[float], statistic: str = "median") -> float:
    try:
        return STATISTICS[statistic](list(values))
    except KeyError:
        raise ValueError(f"unknown statistic '{statistic}'; choose {' or '.join(STATISTICS)}") from None


@dataclass(frozen=True)
class TimeFit:
    """t ~ a * linear_flops + b * attn_flops + c, and how well it fits."""

    a: float
    b: float
    c: float
    r2: float
    max_rel_err: float


def fit_time_model(linear_flops: Sequence[float], attn_flops: Sequence[float], seconds: Sequence[float],
                   *, intercept: bool = False) -> TimeFit:
    """Non-negative relative least squares of `seconds` on the FLOPs terms (see module docstring).

    A term whose FLOPs are all zero (no attention in a head layer) gets coefficient 0.
    """
    from scipy.optimize import lsq_linear

    L, A, t = (np.asarray(x, dtype=float) for x in (linear_flops, attn_flops, seconds))
    if not (len(L) == len(A) == len(t)) or len(t) == 0:
        raise ValueError("a fit needs as many FLOP counts as timings, and at least one")
    if np.any(t <= 0):
        raise ValueError("timings must be positive")
    cols = [L, A] + ([np.ones_like(t)] if intercept else [])
    X = np.stack(cols, axis=1)
    used = [j for j in range(X.shape[1]) if np.any(X[:, j] > 0)]
    if not used:  # nothing to fit (an embedding lookup has no FLOPs in the model)
        return TimeFit(a=0.0, b=0.0, c=0.0, r2=0.0, max_rel_err=1.0)
    if len(used) > len(t):
        raise ValueError(f"{len(t)} measurements cannot determine {len(used)} coefficients")
    W = X[:, used] / t[:, None]
    sol = lsq_linear(W, np.ones_like(t), bounds=(0.0, np.inf), method="bvls")
    coef = np.zeros(X.shape[1])
    coef[used] = sol.x
    pred = X @ coef
    ss_res = float(np.sum((t - pred) ** 2))
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    return TimeFit(a=float(coef[0]), b=float(coef[1]), c=float(coef[2]) if intercept else 0.0, r2=r2,
                   max_rel_err=float(np.max(np.abs(pred - t) / t)))


def fit_activation_bytes(tokens: Sequence[float], nbytes: Sequence[float]) -> tuple[float, float]:
    """(bytes per token, worst relative error): least squares of bytes = k * tokens, through zero."""
    x, y = np.asarray(tokens, dtype=float), np.asarray(nbytes, dtype=float)
    k = float(x @ y / (x @ x))
    err = float(np.max(np.abs(k * x - y) / np.maximum(y, 1.0))) if len(y) else 0.0
    return k, err


# --- the model-profile JSON --------------------------------------------------------------------


class LayerMeasurement(Frozen):
    """One layer at one size: times (median over repetitions) and saved-activation bytes."""

    batch: int = Field(gt=0)
    seq_len: int = Field(gt=0)
    forward_s: float = Field(gt=0)
    backward_s: float = Field(gt=0)
    # Unique storages autograd saved for backward during one forward (parameters excluded).
    activation_bytes: float = Field(ge=0)
    # CUDA only: peak allocated bytes during forward + backward, above what was allocated before.
    peak_allocated_bytes: float | None = None
    linear_flops: float = Field(ge=0, description="forward FLOPs of the linear term (the spec's)")
    attn_flops: float = Field(ge=0, description="forward FLOPs of the attention-score term")

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len


class TPWideMeasurement(Frozen):
    """A block run tensor parallel over more than two ranks (consecutive ranks, as the runtime's
    TP groups), per measurement: fwd+bwd seconds and its TP all-reduces' seconds timed alone, and
    the overhead and slowdown fitted to them (`LayerSpec.tp_wider`)."""

    degree: int = Field(ge=3)
    seconds: tuple[float, ...]
    comm_seconds: tuple[float, ...]
    overhead_s: float = Field(ge=0)
    slowdown: float = Field(ge=0)


class LayerKindProfile(Frozen):
    """Measurements and fitted coefficients of one layer kind (identical blocks share one)."""

    kind: LayerKind
    layer: str = Field(description="the layer that was measured, e.g. block0")
    params: int
    flops_per_token: float
    attn_flops_coeff: float
    measurements: tuple[LayerMeasurement, ...]
    linear_time_scale: float = Field(gt=0)
    attn_time_scale: float = Field(gt=0)
    overhead_s: float = Field(ge=0, description="fitted per-call overhead (LayerSpec.call_overhead_s)")
    fit_r2: float
    fit_max_rel_err: float
    activation_bytes_per_token: float = Field(ge=0)
    # The part of it that tensor parallelism divides, from the block measured whole (B1) and as
    # one rank's tp=2 shard (B2): B1 = R + T, B2 = R + T/2, so T = 2 (B1 - B2). None: not measured.
    activation_bytes_tp_per_token: float | None = None
    activation_fit_max_rel_err: float = Field(ge=0)
    backward_over_forward: float = Field(gt=0, description="measured backward / forward time")
    # Blocks run tensor parallel at tp=2 (DTensor, two ranks), per measurement: fwd+bwd seconds
    # and the seconds of its TP all-reduces timed alone. None: not measured (fewer than 2 ranks).
    tp2_seconds: tuple[float, ...] | None = None
    tp2_comm_seconds: tuple[float, ...] | None = None
    tp_overhead_s: float | None = Field(default=None, ge=0, description="LayerSpec.tp_overhead_s")
    tp_slowdown: float | None = Field(default=None, ge=0, description="LayerSpec.tp_slowdown")
    # The same for Ulysses over two ranks (half the sequence each) and for ZeRO-3 (FSDP2) over two.
    sp2_seconds: tuple[float, ...] | None = None
    sp2_comm_seconds: tuple[float, ...] | None = None
    sp_overhead_s: float | None = Field(default=None, ge=0, description="LayerSpec.sp_overhead_s")
    sp_slowdown: float | None = Field(default=None, ge=0, description="LayerSpec.sp_slowdown")
    zero3_seconds: tuple[float, ...] | None = None
    zero3_comm_seconds: tuple[float, ...] | None = None
    zero3_overhead_s: float | None = Field(default=None, ge=0, description="LayerSpec.zero3_overhead_s")
    # Blocks run tensor parallel wider than two ranks (tp4 with 4 ranks or more), by degree.
    tp_wider: tuple[TPWideMeasurement, ...] = ()
    # fwd+bwd seconds per block of the unparallelised block chained as tp2 and sp2 were, timed with
    # them (the head: the plain head timed alongside its tp2): their T1. None: the measurements
    # above are their T1 (older profiles, tests).
    chain_reference_seconds: tuple[float, ...] | None = None


class ModelProfile(Frozen):
    """What `tessera profile model` writes: per layer kind, measured times and fitted scales."""

    version: int = PROFILE_VERSION
    model: str
    device: str
    dtype: str
    # Achieved FLOP/s of large matmuls in the same processes, same time: the F of the scales.
    reference_flops: float = Field(gt=0)
    ranks_measuring: int = Field(default=1, ge=1, description="ranks that measured at once")
    statistic: str = Field(default="median", description="how repeated timings were summarised")
    window_s: float = Field(default=0.0, ge=0, description="seconds each timing spanned (0: one run)")
    layers: tuple[LayerKindProfile, ...]

    def for_kind(self, kind: LayerKind) -> LayerKindProfile | None:
        return next((p for p in self.layers if p.kind == kind), None)


# The fitted parallel costs, named alike in `LayerKindProfile` and `LayerSpec` (None in a profile,
# 0 in a spec, where not measured).
PARALLEL_COSTS = ("tp_overhead_s", "tp_slowdown", "sp_overhead_s", "sp_slowdown", "zero3_overhead_s")
# The profile fields of each variant: its overhead and slowdown are `{prefix}_overhead_s`, `{prefix}_slowdown`.
_VARIANT_PREFIX = {"tp2": "tp", "sp2": "sp", "zero3": "zero3"}


def tp_degree(variant: str) -> int | None:
    """The degree of a tensor-parallel variant ("tp2" -> 2, "tp4" -> 4), None for any other."""
    degree = variant[2:] if variant.startswith("tp") else ""
    return int(degree) if degree.isdigit() and int(degree) >= 2 else None


def variant_overhead(variant: str, totals: Sequence[float], call_overhead_s: float, seconds: Sequence[float],
                     comm_seconds: Sequence[float]) -> tuple[float, float]:
    """(fixed seconds, slowdown): what a block run as `variant` over its ranks takes beyond the cost
    model's expectation (see module docstring). `totals`: the block's fwd+bwd seconds on one rank;
    `seconds`: as the variant; `comm_seconds`: its collectives timed alone.

    tp2, sp2 and wider tp (tp4 over 4 ranks; `tp_degree`): the excess is fitted as
    fixed + slowdown x (T1 - c) / g, the per-rank share of the compute over g ranks (waits on the
    slower rank grow with the work between collectives; smaller matmuls run less efficiently), by
    a Theil-Sen line (robust to an odd timing) with both terms >= 0.
    zero3: a fixed excess only, the median over sizes, floored at 0."""
    if not (len(totals) == len(seconds) == len(comm_seconds)):
        raise ValueError(f"{variant} timings must be given for every measured size")
    c = call_overhead_s
    degree = tp_degree(variant) or (2 if variant == "sp2" else 0)
    if degree:  # 1/degree of the compute per rank, the collectives on the critical path
        share = np.array([(t1 - c) / degree for t1 in totals])
        excess = np.array([t - c - h - x for t, h, x in zip(seconds, share, comm_seconds)])
        return _robust_line(share, excess)
    if variant == "zero3":  # all the compute; one block alone cannot hide its gathers
        return max(0.0, float(np.median([t - t1 - x for t, t1, x in zip(seconds, totals, comm_seconds)]))), 0.0
    raise ValueError(f"unknown variant '{variant}'")


def _robust_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(intercept, slope) >= 0 of y over x: Theil-Sen; where a term comes out negative it is 0 and
    the other is refitted alone (a median). Fewer than 3 points or one x: the median of y alone."""
    from scipy.stats import theilslopes

    if len(x) < 3 or np.ptp(x) <= 1e-6 * max(float(np.max(np.abs(x))), 1e-12):
        return max(0.0, float(np.median(y))), 0.0
    slope, intercept, _, _ = theilslopes(y, x)
    if slope <= 0:
        return max(0.0, float(np.median(y))), 0.0
    if intercept < 0:
        return 0.0, max(0.0, float(np.median(y / np.maximum(x, 1e-12))))
    return float(intercept), float(slope)


def fit_layer_kind(kind: LayerKind, layer: str, params: int, flops_per_token: float,
                   attn_flops_coeff: float, measurements: Sequence[LayerMeasurement],
                   reference_flops: float, tp2_activation_bytes: Sequence[float] | None = None,
                   variants: dict[str, tuple[Sequence[float], Sequence[float]]] | None = None,
                   chain_reference: Sequence[float] | None = None) -> LayerKindProfile:
    """Fit one layer kind's scales, call overhead and parallel-variant overheads from its
    measurements (see module docstring for the formulas). `variants`: per variant ("tp2", "sp2",
    "zero3" over two ranks; "tp4", "tp8" over as many), the block's fwd+bwd seconds run that way
    and its collectives' seconds timed alone, per measurement; `chain_reference`: the one-rank
    fwd+bwd per block that tp and sp2 are set against (default: the measurements')."""
    ms = list(measurements)
    total = [m.forward_s + m.backward_s for m in ms]
    lin = [m.linear_flops for m in ms]
    att = [m.attn_flops for m in ms]
    to_scale = reference_flops / 3.0
    # The terms separate only if the attention share varies enough (it grows with seq).
    shares = [y / x for x, y in zip(lin, att) if x > 0]
    separable = bool(shares) and min(shares) > 0 and max(shares) / min(shares) >= 1.5

    def fit_scales(intercept: bool):
        fit = fit_time_model(lin, att, total, intercept=intercept)
        if separable and fit.a > 0 and fit.b > 0:
            return fit, fit.a * to_scale, fit.b * to_scale
        # The sizes do not separate the two terms (or there is no attention): one common scale.
        fit = fit_time_model([x + y for x, y in zip(lin, att)], [0.0] * len(ms), total, intercept=intercept)
        s = fit.a * to_scale if fit.a > 0 else 1.0
        return fit, s, s

    fit, s_lin, s_att = fit_scales(intercept=len(ms) >= 3)
    if fit.a == 0 and fit.c > 0 and any(x + y > 0 for x, y in zip(lin, att)):
        # Flat timings of a layer with FLOPs: keep the FLOPs term, not a constant. (A layer with
        # none, the embedding, keeps its intercept: its time is all fixed cost.)
        fit, s_lin, s_att = fit_scales(intercept=False)
    act, act_err = fit_activation_bytes([m.tokens for m in ms], [m.activation_bytes for m in ms])
    ratio = float(np.median([m.backward_s / m.forward_s for m in ms]))
    tp_part = None
    if tp2_activation_bytes is not None:
        half, _ = fit_activation_bytes([m.tokens for m in ms], tp2_activation_bytes)
        tp_part = min(act, max(0.0, 2.0 * (act - half)))
    measured = {}
    if chain_reference is not None:
        if len(chain_reference) != len(ms):
            raise ValueError("the chained reference timings must be given for every measured size")
        measured["chain_reference_seconds"] = tuple(chain_reference)
    wider = []
    for variant, (seconds, comm) in (variants or {}).items():
        t1 = total if variant == "zero3" or chain_reference is None else chain_reference
        fixed, slowdown = variant_overhead(variant, t1, fit.c, seconds, comm)
        degree = tp_degree(variant)
        if degree and degree > 2:
            wider.append(TPWideMeasurement(degree=degree, seconds=tuple(seconds),
                                           comm_seconds=tuple(comm), overhead_s=fixed, slowdown=slowdown))
            continue
        prefix = _VARIANT_PREFIX[variant]
        measured.update({f"{variant}_seconds": tuple(seconds), f"{variant}_comm_seconds": tuple(comm),
                         f"{prefix}_overhead_s": fixed})
        if variant != "zero3":
            measured[f"{prefix}_slowdown"] = slowdown
    return LayerKindProfile(
        kind=kind, layer=layer, params=params, flops_per_token=flops_per_token,
        attn_flops_coeff=attn_flops_coeff, measurements=tuple(ms), linear_time_scale=s_lin,
        attn_time_scale=s_att, overhead_s=fit.c, fit_r2=fit.r2, fit_max_rel_err=fit.max_rel_err,
        activation_bytes_per_token=act, activation_bytes_tp_per_token=tp_part,
        activation_fit_max_rel_err=act_err, backward_over_forward=ratio,
        tp_wider=tuple(sorted(wider, key=lambda w: w.degree)), **measured)
