"""Turn hardware measurements into the planner's `ClusterSpec` terms (no torch import).

`tessera.profile.measure.hardware` times collectives and matmuls on the devices; this module does
the arithmetic on what it measured:

- `monotone`: a collective's times over growing messages, each replaced by the least time at its
  size or any larger one (timing noise only ever adds time; a larger message is never faster).
- `fit_link`: the alpha-beta model of `tessera.cost.comm`, t = f (p-1) a + f (p-1)/p n / B (f = 2
  for all-reduce, 1 otherwise), fitted by non-negative least squares over the ring collectives'
  points, each row weighted by 1/t so that small and large messages count alike.
- `device_from_rates`: peak and efficiency from matmul rates. On a known GPU (the presets'
  datasheet figures) the efficiency is the measured rate of the reference dtype (bf16) over its
  datasheet peak, and every dtype's peak is its measured rate / efficiency, so that peak x
  efficiency is the measured rate for every dtype. On a CPU (or an unknown GPU) the peak is
  unknown: each dtype's peak IS its measured rate and the efficiency is 1.0.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..spec.cluster import CollectiveCurve, DeviceSpec, LinkSpec

_RING_FACTOR = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}


def monotone(seconds: Sequence[float]) -> list[float]:
    """Each time replaced by the least time measured at its size or any larger one."""
    out, low = [], float("inf")
    for t in reversed(seconds):
        low = min(low, t)
        out.append(low)
    return out[::-1]


def fit_link(curves: Sequence[CollectiveCurve]) -> LinkSpec | None:
    """Least-squares (alpha, 1/beta) of the alpha-beta model over ring collectives' points, or None
    with fewer than two points or no bandwidth term (see the module docstring)."""
    from scipy.optimize import nnls

    rows, rhs = [], []
    for c in curves:
        if c.collective not in _RING_FACTOR:
            continue
        f, p = _RING_FACTOR[c.collective], c.group_size
        for n, t in zip(c.message_bytes, c.seconds):
            if t > 0:
                rows.append([f * (p - 1) / t, f * (p - 1) / p * n / t])
                rhs.append(1.0)
    if len(rows) < 2:
        return None
    (alpha, inv_bw), _ = nnls(np.array(rows), np.array(rhs))
    if inv_bw <= 0:
        return None
    return LinkSpec(bandwidth=1.0 / inv_bw, latency=float(alpha))


def device_from_rates(name: str, measured: dict[str, float], reference: str, known: DeviceSpec | None,
                      memory: float, mem_bw: float, reserved: float) -> tuple[DeviceSpec, float]:
    """(DeviceSpec, compute efficiency) from measured matmul FLOP/s per dtype (see the module
    docstring). `reference`: the dtype whose datasheet peak sets the efficiency on a `known` GPU."""
    if known is not None and reference in measured and reference in known.peak_flops:
        efficiency = min(1.0, measured[reference] / known.peak_flops[reference])
        name = known.name
    else:
        efficiency = 1.0
    peaks = {d: rate / efficiency for d, rate in measured.items()}
    # A known GPU keeps its kernel description (SMs, GEMM tile, flash-attention throughput); the
    # measured bandwidth is already the achieved one.
    kernels = ({k: getattr(known, k) for k in ("sm_count", "gemm_tile", "attention_efficiency", "kernel_launch_s")}
               if known is not None else {})
    device = DeviceSpec(name=name, memory_bytes=memory, peak_flops=peaks, memory_bandwidth=mem_bw,
                        reserved_bytes=reserved, **kernels)
    return device, efficiency
