"""Measured profiles: what the cost model's constants are on this machine, and how close it gets.

Two sides:
- torch-free (this package's modules, read by the planner): `fit` (the model-profile schema and
  the fits of layer timings into `LayerSpec` time scales, overheads and activation bytes),
  `fit_hardware` (collective curves into links, matmul rates into peak and efficiency), `apply`
  (`load_cluster_profile`, `load_model_profile`, `apply_model_profile`), `results` (what a
  validation measured and the cost model's predictions for it);
- torch (`tessera.profile.measure`): `hardware` and `model` run the measurements on the devices,
  `memory` instruments states and saved activations, `validate` runs plans with the trainer.

Importing this package, or any module of it outside `measure`, does not import torch.
"""
from .apply import apply_model_profile, load_cluster_profile, load_model_profile, write_atomic
from .fit import LayerKindProfile, LayerMeasurement, ModelProfile

__all__ = ["apply_model_profile", "load_cluster_profile", "load_model_profile", "write_atomic",
           "LayerKindProfile", "LayerMeasurement", "ModelProfile"]
