"""Measured profiles: what the cost model's constants are on this machine, and how close it gets.

- `hardware`: collective curves, matmul FLOP/s, overlap slowdown -> a `ClusterSpec` JSON (torch).
- `model`: per-layer times and saved activations of a model on one device (torch), fitted by
  `fit` into `LayerSpec` time scales and activation bytes -> a `ModelProfile` JSON.
- `apply` (no torch): `load_cluster_profile`, `load_model_profile`, `apply_model_profile`.
- `memory` / `validate` (torch): instrumented memory; run plans, predicted vs measured.

Importing this package does not import torch: the planner reads profiles without it.
"""
from .apply import apply_model_profile, load_cluster_profile, load_model_profile, write_atomic
from .fit import LayerKindProfile, LayerMeasurement, ModelProfile

__all__ = ["apply_model_profile", "load_cluster_profile", "load_model_profile", "write_atomic",
           "LayerKindProfile", "LayerMeasurement", "ModelProfile"]
